"""The attention backends and the choice between them.

Every backend computes grouped-query causal attention with the same contract:
q [B, Hq, T, D], k/v [B, Hkv, T, D], and a boolean mask [B, 1, T, T] (True =
attend) or None for pure causal attention; with a mask, q may hold fewer positions
than k/v (a cached decoding step). "sdpa" also takes a stream's `Pieces`
(align.kernels.pieces): one unpadded row of prefix-shared pairs, attended piece by piece.
Two backends take another mask and are offered only once their equivalence gate has a
passed receipt for the current code, software and device: "triton_fa2", this package's
Triton kernel, takes right-padded key lengths [B] (int32) or None and runs on CUDA;
"flex", torch's FlexAttention, takes a block mask (align.kernels.flex.FlexMask) and runs
on CUDA, or on the CPU without gradients. New backends register in `ATTENTION_BACKENDS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from align.kernels import flex_gate
from align.kernels.contract import check_gqa_shapes
from align.kernels.equivalence import interpreted, proven_here, require_proven_kernel
from align.kernels.flex import FlexMask, flex_attention_fn
from align.kernels.pieces import Pieces
from align.kernels.pieces import attend as attend_pieces

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor
]


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | Pieces | None
) -> torch.Tensor:
    """torch's fused scaled_dot_product_attention; K/V heads are shared, never copied. A
    stream of prefix-shared pairs (align.kernels.pieces) runs its exact pieces."""
    if isinstance(mask, Pieces):
        return attend_pieces(q, k, v, mask)
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


def require_proven_shape(
    backend: str, q: torch.Tensor, dtypes: frozenset, head_dims: frozenset, where: str = ""
) -> None:
    """Refuse queries of a dtype or head dim the backend's equivalence gate did not prove."""
    if q.dtype not in dtypes or q.shape[-1] not in head_dims:
        proven = f"dtypes {sorted(map(str, dtypes))}, head dims {sorted(head_dims)}"
        raise ValueError(
            f"attention backend {backend!r} is proven{where} only for {proven}; "
            f"got {q.dtype}, head dim {q.shape[-1]}"
        )


def triton_fa2_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_lengths: torch.Tensor | None
) -> torch.Tensor:
    """The gated Triton FlashAttention-2 kernel; `key_lengths` [B] right-pads each row."""
    if q.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"attention backend 'triton_fa2' runs on CUDA tensors (or the CPU under "
            f"TRITON_INTERPRET=1), got {q.device}"
        )
    require_proven_shape("triton_fa2", q, *proven_here())
    if key_lengths is not None and key_lengths.dim() != 1:
        raise ValueError(
            "attention backend 'triton_fa2' takes key lengths [B] (see "
            f"mistral.build_key_lengths), not a mask of shape {tuple(key_lengths.shape)}"
        )
    # Imported here: importing the module decorates the kernels, and Triton reads
    # TRITON_INTERPRET at that moment.
    from align.kernels.flash_attn import flash_attention

    return flash_attention(q, k, v, seq_lens=key_lengths, causal=True)


def flex_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask
) -> torch.Tensor:
    """torch's FlexAttention under a block mask, for the dtypes and head dims its gate proves."""
    require_proven_shape("flex", q, *flex_gate.proven_for(q.device), f" on {q.device.type}")
    return flex_attention_fn(q, k, v, mask)


ATTENTION_BACKENDS: dict[str, AttentionFn] = {
    "sdpa": sdpa_attention,
    "eager": eager_attention,
    "triton_fa2": triton_fa2_attention,
    "flex": flex_attention,
}
# The backends that take a boolean mask with fewer queries than keys: a cached decoding step.
MASKED_DECODING = ("sdpa", "eager")


def select_attn_implementation(name: str, device: torch.device | str) -> str:
    """Resolve the backend name a model on `device` will use; refuse one that is not available."""
    device = torch.device(device)  # refuses a malformed device string
    if name not in ATTENTION_BACKENDS:
        raise _unavailable(name)
    if name == "triton_fa2":
        if device.type != "cuda" and not (device.type == "cpu" and interpreted()):
            fallbacks = sorted(backend for backend in ATTENTION_BACKENDS if backend != name)
            raise ValueError(
                f"attention backend {name!r} needs a CUDA device (or the CPU under "
                f"TRITON_INTERPRET=1), got {device}; there is no fallback: choose one of "
                f"{fallbacks} for this device"
            )
        require_proven_kernel(device)
    if name == "flex":
        flex_gate.require_proven_flex(device)
    return name


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, impl: str
) -> torch.Tensor:
    """Grouped-query causal attention with the backend `impl`; returns [B, Hq, T, D].

    A boolean mask may pair fewer queries with more keys (a cached decoding step); the
    Triton kernel's key lengths may not."""
    fewer = isinstance(mask, Pieces) or (mask is not None and impl in MASKED_DECODING)
    check_gqa_shapes(q, k, v, fewer_queries=fewer)
    if impl not in ATTENTION_BACKENDS:
        raise _unavailable(impl)
    return ATTENTION_BACKENDS[impl](q, k, v, mask)


def _unavailable(name: str) -> ValueError:
    return ValueError(
        f"attention backend {name!r} is not available; "
        f"available backends: {sorted(ATTENTION_BACKENDS)}"
    )
