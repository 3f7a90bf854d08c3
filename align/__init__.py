"""align: a gated, pre-registered DPO pipeline for Mistral-architecture models.

Importing the package imports nothing heavy; torch is loaded only by the
modules that train or run a model.
"""

__version__ = "0.1.0"
