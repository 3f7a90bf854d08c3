"""The Mistral model, its config and checkpoints.

Importing this package does not import torch: the config is stdlib-only and
`load_pretrained` imports the torch side on first access.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from align.model.hf_config import MistralConfig, load_hf_config

if TYPE_CHECKING:
    from align.model.checkpoint import load_pretrained

__all__ = ["MistralConfig", "load_hf_config", "load_pretrained"]


def __getattr__(name: str) -> Any:
    if name == "load_pretrained":
        from align.model.checkpoint import load_pretrained

        return load_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
