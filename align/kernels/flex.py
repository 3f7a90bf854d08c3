"""FlexAttention (torch.nn.attention.flex_attention) as an attention backend.

Every layout reaches it as segments and positions under the prefix-shared rule of
align.kernels.segments, the one eager's dense mask evaluates; plain right-padded rows are
one prefix segment. torch compiles the rule into a block mask, so fully masked blocks (a
shared row's chosen x rejected blocks, the window's far past) are skipped.

Rows are padded to a multiple of `BUCKET` positions, so a compiled kernel serves every
width of its bucket: compilation is paid once per (rows, heads, bucket, head dim, dtype),
timed in `compile_seconds`. torch 2.13 runs FlexAttention's backward on CUDA only: on
the CPU this backend scores (no gradient) and refuses a forward that would need one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from align.constants import PAD_SEGMENT, PREFIX_SEGMENT
from align.kernels.segments import visible

BACKEND = "flex"
# FlexAttention's default block: a bucket is whole blocks, so padding adds no partial one.
BUCKET = 128
# Shapes compiled before torch.compile would stop compiling; past it, refuse rather than
# let dynamo run the uncompiled (dense, slow) path.
RECOMPILE_LIMIT = 64

_compiled = None
_compile_seconds: dict[tuple, float] = {}


@dataclass(frozen=True)
class FlexMask:
    """A block mask over rows padded to their bucket, and the rows' own width."""

    block_mask: BlockMask
    length: int


def bucket_width(length: int) -> int:
    """The bucket `length` positions are padded to: the next multiple of BUCKET."""
    return -(-length // BUCKET) * BUCKET


def plain_segments(
    attention_mask: torch.Tensor | None, shape: torch.Size, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows as segments: real tokens one prefix segment, padding apart."""
    batch, length = shape
    real = (
        torch.ones(batch, length, dtype=torch.bool, device=device)
        if attention_mask is None
        else attention_mask.bool()
    )
    segments = torch.where(real, PREFIX_SEGMENT, PAD_SEGMENT)
    positions = torch.arange(length, device=device).expand(batch, length)
    return segments, positions


def build_flex_mask(
    segment_ids: torch.Tensor, position_ids: torch.Tensor, sliding_window: int | None
) -> FlexMask:
    """The block mask of `segment_ids` / `position_ids` [B, T], padded to T's bucket."""
    batch, length = segment_ids.shape
    pad = bucket_width(length) - length
    segments = F.pad(segment_ids, (0, pad), value=PAD_SEGMENT)
    positions = F.pad(position_ids, (0, pad), value=0)

    def allowed(b, h, q, k):
        return visible(
            segments[b, q], segments[b, k], positions[b, q], positions[b, k], q, k, sliding_window
        )

    width = length + pad
    block = create_block_mask(allowed, batch, None, width, width, device=segment_ids.device)
    return FlexMask(block, length)


def flex_attention_fn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: FlexMask
) -> torch.Tensor:
    """Attention of q [B, Hq, T, D] over k/v [B, Hkv, T, D] under `mask`; [B, Hq, T, D]."""
    if not isinstance(mask, FlexMask):
        raise ValueError(
            f"attention backend {BACKEND!r} takes a FlexMask (see build_flex_mask), "
            f"got {type(mask).__name__}"
        )
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if q.device.type == "cpu" and needs_grad:
        raise ValueError(
            f"attention backend {BACKEND!r} has no backward on the CPU in torch "
            f"{torch.__version__} (FlexAttention's backward runs on CUDA): train on the CPU "
            "with 'sdpa' or 'eager'; flex may score there, without gradients"
        )
    length, width = mask.length, mask.block_mask.shape[-1]
    if q.shape[2] != length or k.shape[2] != length:
        raise ValueError(
            f"attention backend {BACKEND!r}: the mask is for {length} positions, got "
            f"queries {q.shape[2]} and keys {k.shape[2]}"
        )
    padded = [F.pad(x, (0, 0, 0, width - length)) for x in (q, k, v)]
    out = _run_compiled(*padded, mask.block_mask)
    return out[:, :, :length]


def _run_compiled(q, k, v, block_mask: BlockMask) -> torch.Tensor:
    global _compiled
    if _compiled is None:
        import torch._dynamo.config as dynamo_config

        dynamo_config.recompile_limit = RECOMPILE_LIMIT
        dynamo_config.fail_on_recompile_limit_hit = True
        _compiled = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    signature = (*q.shape, k.shape[1], str(q.dtype), str(q.device), q.requires_grad)
    first = signature not in _compile_seconds
    started = time.perf_counter()
    out = _compiled(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    if first:
        _compile_seconds[signature] = time.perf_counter() - started
    return out


def compile_seconds() -> list[dict[str, object]]:
    """Each compiled shape of this process and the seconds of its first (compiling) call."""
    fields = ("rows", "q_heads", "width", "head_dim", "kv_heads", "dtype", "device", "grad")
    return [
        {**dict(zip(fields, signature, strict=True)), "seconds": round(seconds, 3)}
        for signature, seconds in _compile_seconds.items()
    ]
