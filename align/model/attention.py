"""The attention backends and the choice between them.

Every backend computes grouped-query causal attention with the same contract:
q [B, Hq, T, D], k/v [B, Hkv, T, D], and a boolean mask [B, 1, T, T] (True =
attend) or None for pure causal attention. New backends register in
`ATTENTION_BACKENDS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """torch's fused scaled_dot_product_attention; K/V heads are shared, never copied."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
    )


def eager_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """softmax(QK^T / sqrt(d) + mask) V, accumulated in float32."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    scores = torch.matmul(q.float(), k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if mask is None:
        length = q.shape[-2]
        mask = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    # -inf rather than a large negative: a fully masked row shows up as NaN, not as a silent mean.
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v).to(q.dtype)


ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "sdpa": sdpa_attention,
    "eager": eager_attention,
}


def select_attn_implementation(name: str, device: torch.device | str) -> str:
    """Resolve the backend name a model on `device` will use; refuse one that is not available."""
    torch.device(device)  # refuses a malformed device string
    if name not in ATTENTION_BACKENDS:
        raise _unavailable(name)
    return name


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str
) -> torch.Tensor:
    """Grouped-query causal attention with the backend `impl`; returns [B, Hq, T, D]."""
    if q.dim() != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"expected q [B, Hq, T, D] and k/v [B, Hkv, T, D], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    if impl not in ATTENTION_BACKENDS:
        raise _unavailable(impl)
    return ATTENTION_BACKENDS[impl](q, k, v, mask)


def _unavailable(name: str) -> ValueError:
    return ValueError(
        f"attention backend {name!r} is not available; "
        f"available backends: {sorted(ATTENTION_BACKENDS)}"
    )
