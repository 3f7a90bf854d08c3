"""This package's GPU kernels and the equivalence gate that must prove them before use.

Importing the package imports neither triton nor the kernels: Triton reads
TRITON_INTERPRET when a kernel module is imported, so that import is left to the caller.
"""
