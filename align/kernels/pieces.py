"""Exact attention of prefix-shared pairs laid end to end in one unpadded stream.

The shared and packed layouts' rows, their padding dropped, become one stream of pairs,
each [prompt | chosen | rejected] (align.data.loader). Under the rule of
align.kernels.segments a pair needs two attention calls: the prompt and the chosen
response are one causal sequence, and the rejected response attends to the prompt and
then causally to itself. So sdpa computes none of the chosen x rejected, cross-pair and
padding blocks that a dense [B, 1, T, T] mask makes it compute, and no linear layer runs
on padding.

A layer may query fewer positions than it keys (`Stream.labelled`): the last layer's
output is read only where a label is, so it computes its queries, its output projection
and its MLP there alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from align.constants import IGNORE_INDEX, PAD_SEGMENT
from align.kernels.segments import prefix_of, visible_between


@dataclass(frozen=True)
class Piece:
    """One attention call: the queries (a slice of the layer's queried positions), the key
    ranges of the stream they see, concatenated in order, and its mask [queries, keys]
    (True = attend), or None where the keys are the queries themselves, causally."""

    queries: slice
    keys: tuple[tuple[int, int], ...]
    mask: torch.Tensor | None


@dataclass(frozen=True)
class Pieces:
    """The attention calls of one layer, whose queries tile its queried positions in order.
    The stream's keys are cut at `key_bounds` into runs, and `key_runs` are the runs each
    call's key ranges are made of, in order."""

    pieces: tuple[Piece, ...]
    num_queries: int
    key_bounds: tuple[int, ...]
    key_runs: tuple[tuple[int, ...], ...]

    @property
    def num_keys(self) -> int:
        return self.key_bounds[-1]


@dataclass(frozen=True)
class Stream:
    """Where a batch's real tokens lie in its [B, T] rows (`real`, flat indices in stream
    order), their positions [1, N], every layer's pieces, and the last layer's: its queries
    are the stream positions `labelled`, or all of them (None) when no label set is given."""

    real: torch.Tensor
    positions: torch.Tensor
    every_layer: Pieces
    labelled: torch.Tensor | None
    last_layer: Pieces


def build_stream(
    segment_ids: torch.Tensor,
    position_ids: torch.Tensor,
    sliding_window: int | None,
    labels: torch.Tensor | None = None,
) -> Stream:
    """The stream of prefix-shared rows `segment_ids` / `position_ids` [B, T]; `labels`
    [K, B, T] name the positions whose last-layer output is read (all, without them)."""
    device = segment_ids.device
    flat = segment_ids.cpu().flatten().numpy()
    real = np.flatnonzero(flat != PAD_SEGMENT)
    segments = flat[real]
    positions = position_ids.cpu().flatten().numpy()[real]
    rows = real // segment_ids.shape[1]
    pairs = _pair_runs(rows, segments)
    rule = _Rule(torch.from_numpy(segments), torch.from_numpy(positions), sliding_window)
    every_layer = _pieces(pairs, np.arange(len(real)), len(real), rule, device)
    labelled, last_layer = None, every_layer
    if labels is not None:
        read = (labels.reshape(-1, flat.size) != IGNORE_INDEX).any(0).cpu().numpy()
        labelled = np.flatnonzero(read[real])
        last_layer = _pieces(pairs, labelled, len(real), rule, device)
        labelled = _to(labelled, device)
    return Stream(
        _to(real, device), _to(positions, device)[None], every_layer, labelled, last_layer
    )


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device)


def _pair_runs(rows: np.ndarray, segments: np.ndarray) -> list[list[tuple[int, int, bool]]]:
    """Each pair's runs (start, end, whether it is the prefix) in stream order: a run is a
    maximal stretch of one row and segment id, and a pair the runs of one row and prefix."""
    change = (np.diff(segments, prepend=-1) != 0) | (np.diff(rows, prepend=-1) != 0)
    starts = np.flatnonzero(change)
    ends = np.append(starts[1:], len(segments))
    pairs: list[list[tuple[int, int, bool]]] = []
    last = None
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        segment = int(segments[start])
        key = (int(rows[start]), int(prefix_of(segment)))
        if key != last:
            pairs.append([])
            last = key
        pairs[-1].append((start, end, segment == key[1]))
    return pairs


@dataclass(frozen=True)
class _Rule:
    """The stream's segments and positions, on which `visible` decides a piece's mask."""

    segments: torch.Tensor
    positions: torch.Tensor
    sliding_window: int | None

    def mask(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        return visible_between(self.segments, self.positions, queries, keys, self.sliding_window)

    def causal_suffices(self, start: int, end: int) -> bool:
        """Whether plain causal attention is the rule over [start, end): no window cuts it."""
        span = self.positions[start:end]
        window = self.sliding_window
        return window is None or int(span.max() - span.min()) < window


def _pieces(
    pairs: list[list[tuple[int, int, bool]]],
    queried: np.ndarray,
    num_keys: int,
    rule: _Rule,
    device: torch.device,
) -> Pieces:
    """The calls that give the queried stream positions' attention outputs, in order: per
    pair, the prefix with its first branch as one causal sequence, then each later branch
    against the prefix and itself."""
    pieces = []
    for runs in pairs:
        prefix = runs[0][:2] if runs[0][2] else None
        branches = [run[:2] for run in runs if not run[2]]
        calls = []
        if prefix is not None:
            first_end = branches.pop(0)[1] if branches else prefix[1]
            calls.append(((prefix[0], first_end), ((prefix[0], first_end),)))
        calls += [(branch, (prefix, branch) if prefix else (branch,)) for branch in branches]
        for (start, end), keys in calls:
            low, high = (int(i) for i in np.searchsorted(queried, [start, end]))
            if low < high:
                pieces.append(_piece(queried, slice(low, high), (start, end), keys, rule, device))
    edges = {0, num_keys} | {edge for piece in pieces for span in piece.keys for edge in span}
    bounds = tuple(sorted(edges))
    run_at = {edge: run for run, edge in enumerate(bounds)}
    key_runs = tuple(
        tuple(run for start, end in piece.keys for run in range(run_at[start], run_at[end]))
        for piece in pieces
    )
    return Pieces(tuple(pieces), len(queried), bounds, key_runs)


def _piece(
    queried: np.ndarray,
    queries: slice,
    span: tuple[int, int],
    keys: tuple[tuple[int, int], ...],
    rule: _Rule,
    device: torch.device,
) -> Piece:
    whole = queries.stop - queries.start == span[1] - span[0]
    if keys == (span,) and whole and rule.causal_suffices(*span):
        return Piece(queries, keys, None)
    key_index = torch.cat([torch.arange(start, end) for start, end in keys])
    query_index = torch.from_numpy(queried[queries])
    return Piece(queries, keys, rule.mask(query_index, key_index).to(device))


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: Pieces) -> torch.Tensor:
    """sdpa over q [1, Hq, Nq, D] (the layer's queried positions) and k/v [1, Hkv, N, D]
    (the whole stream), piece by piece; [1, Hq, Nq, D].

    q, k and v are split, not sliced, into the pieces' parts: the backward of a split is
    one concatenation, where each slice's backward would write a zero-filled gradient of
    the whole stream, to be summed with every other slice's.
    """
    if q.shape[0] != 1 or q.shape[2] != plan.num_queries or k.shape[2] != plan.num_keys:
        raise ValueError(
            f"a stream's attention takes q [1, Hq, {plan.num_queries}, D] and k/v "
            f"[1, Hkv, {plan.num_keys}, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    if not plan.pieces:  # nothing queried: a batch whose pairs score no token
        return q
    gqa = q.shape[1] != k.shape[1]
    sizes = [piece.queries.stop - piece.queries.start for piece in plan.pieces]
    key_sizes = np.diff(plan.key_bounds).tolist()
    key_parts, value_parts = (x.split(key_sizes, dim=2) for x in (k, v))
    outputs = [
        F.scaled_dot_product_attention(
            queries,
            _join(key_parts, runs),
            _join(value_parts, runs),
            attn_mask=piece.mask,
            is_causal=piece.mask is None,
            enable_gqa=gqa,
        )
        for piece, runs, queries in zip(
            plan.pieces, plan.key_runs, q.split(sizes, dim=2), strict=True
        )
    ]
    return torch.cat(outputs, dim=2)


def _join(parts: tuple[torch.Tensor, ...], runs: tuple[int, ...]) -> torch.Tensor:
    """The split stream's `runs`, concatenated in order."""
    chosen = [parts[run] for run in runs]
    return chosen[0] if len(chosen) == 1 else torch.cat(chosen, dim=2)
