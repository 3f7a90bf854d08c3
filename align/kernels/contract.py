"""The tensor contract every attention backend shares: q [B, Hq, T, D], k/v [B, Hkv, T, D]."""

from __future__ import annotations

import torch


def check_gqa_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise unless q, k, v are grouped-query attention inputs of one batch and length."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"expected q [B, Hq, T, D] and k/v [B, Hkv, T, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
