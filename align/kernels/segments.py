"""The shared and packed layouts' attention rule, for every backend that takes a mask.

A row holds one or more pairs, each a prefix and its branches (prompt | chosen | rejected),
each branch's positions restarting after its prefix (align.constants' segment ids). A query
attends to keys at or before it in the row that are in its own segment or in its own pair's
prefix, never to padding or another pair; with a window, only to keys whose position is
within it of its own. So each branch sees exactly what it would see as its own row after
the prefix. A padded query sees only itself, so no row is fully masked (which would give
NaN). `visible` states the rule once: eager's dense mask and sdpa's stream pieces evaluate
it on index grids (`visible_between`), FlexAttention's mask function on single positions.
"""

from __future__ import annotations

import torch

from align.constants import PAD_SEGMENT, PREFIX_SEGMENT, SEGMENTS_PER_PAIR


def visible(
    query_segment: torch.Tensor,
    key_segment: torch.Tensor,
    query_position: torch.Tensor,
    key_position: torch.Tensor,
    query_index: torch.Tensor,
    key_index: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """Whether each query attends to each key (broadcast elementwise)."""
    allowed = (key_index <= query_index) & (
        (key_segment == query_segment) | (key_segment == prefix_of(query_segment))
    )
    allowed = allowed & (key_segment != PAD_SEGMENT) & (query_segment != PAD_SEGMENT)
    if sliding_window is not None:
        allowed = allowed & (query_position - key_position < sliding_window)
    return allowed | (query_index == key_index)


def prefix_of(segment):
    """The segment id of the prefix of the pair each segment id belongs to (tensor or array)."""
    return segment - (segment - PREFIX_SEGMENT) % SEGMENTS_PER_PAIR


def pair_slot(segment: torch.Tensor) -> torch.Tensor:
    """Each token's pair within its row (0 for padding, which scores nothing)."""
    return ((segment - PREFIX_SEGMENT) // SEGMENTS_PER_PAIR).clamp(min=0)


def build_segment_mask(
    segment_ids: torch.Tensor, position_ids: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean [B, 1, T, T] mask (True = attend) of prefix-shared rows [B, T]."""
    if segment_ids.dim() != 2 or position_ids.shape != segment_ids.shape:
        raise ValueError(
            f"segment_ids and position_ids must both be [B, T], got "
            f"{tuple(segment_ids.shape)} and {tuple(position_ids.shape)}"
        )
    index = torch.arange(segment_ids.shape[1], device=segment_ids.device)
    return visible_between(segment_ids, position_ids, index, index, sliding_window)[:, None]


def visible_between(
    segments: torch.Tensor,
    positions: torch.Tensor,
    queries: torch.Tensor,
    keys: torch.Tensor,
    sliding_window: int | None,
) -> torch.Tensor:
    """Whether each of `queries` attends to each of `keys` ([Q] and [K] indices into the
    last dimension of `segments` / `positions` [..., T]): [..., Q, K]."""
    return visible(
        segments[..., queries, None],
        segments[..., None, keys],
        positions[..., queries, None],
        positions[..., None, keys],
        queries[:, None],
        keys[None, :],
        sliding_window,
    )
