"""The tensor contract every attention backend shares: q [B, Hq, T, D], k/v [B, Hkv, T, D];
a masked call may have fewer queries than keys (a cached decoding step, q [B, Hq, 1, D])."""

from __future__ import annotations

import torch


def check_gqa_shapes(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fewer_queries: bool = False
) -> None:
    """Raise unless q, k, v are grouped-query attention inputs of one batch and length;
    with `fewer_queries`, q may have fewer positions than k/v."""
    same = q.shape[2] <= k.shape[2] if fewer_queries else q.shape[2] == k.shape[2]
    if (
        q.dim() != 4
        or k.shape != v.shape
        or q.shape[0] != k.shape[0]
        or q.shape[3] != k.shape[3]
        or not same
    ):
        keys = "Tk >= Tq" if fewer_queries else "T"
        raise ValueError(
            f"expected q [B, Hq, T, D] and k/v [B, Hkv, {keys}, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
