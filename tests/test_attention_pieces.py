"""A stream of prefix-shared pairs attended piece by piece (align.kernels.pieces) against
sdpa under the dense segment mask that states the rule for every backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_prefix_sharing import NO_PROMPT, PACKABLE, RAGGED, pair_arrays, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from align.constants import IGNORE_INDEX
from align.data.loader import collate_shared_prompt
from align.kernels.pieces import attend, build_stream
from align.kernels.segments import build_segment_mask

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 8
# Pairs of several of the CPU kernel's query blocks, one prompt-less.
LONG = [(70, 40, 90), (5, 3, 2), (0, 80, 65)]


def layouts():
    return [
        pytest.param(RAGGED, False, None, id="ragged"),
        pytest.param(RAGGED, False, 4, id="ragged_window"),
        pytest.param(NO_PROMPT, False, None, id="no_prompt"),
        pytest.param(PACKABLE, True, 5, id="packed_window"),
        pytest.param(LONG, False, None, id="long"),
        pytest.param(LONG, True, 50, id="long_packed_window"),
    ]


def dense_reference(q, k, v, batch, window):
    """sdpa over the padded rows under the dense mask, at the stream's real positions."""
    mask = build_segment_mask(batch.segment_ids, batch.position_ids, window)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    real = (batch.segment_ids != 0).flatten()
    return out.transpose(1, 2).flatten(0, 1)[real]


def score(model, batch):
    """The model's per-(set, row, slot) label log-probs and counts of a shared batch."""
    return model(
        batch.input_ids,
        labels=batch.labels,
        position_ids=batch.position_ids,
        segment_ids=batch.segment_ids,
    )


def to_stream(x, stream):
    """[B, H, T, D] rows as the stream [1, H, N, D]."""
    return x.transpose(1, 2).flatten(0, 1)[stream.real].transpose(0, 1)[None]


# CUDA's sdpa picks different kernels for the pieces (flash where causal, efficient where
# masked) than for the dense mask, so they agree to a looser float32 rounding there.
DEVICES = [
    pytest.param("cpu", 1e-6, id="cpu"),
    pytest.param(
        "cuda",
        2e-5,
        id="cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    ),
]


@pytest.mark.parametrize("device, tolerance", DEVICES)
@pytest.mark.parametrize("lengths, pack, window", layouts())
def test_stream_pieces_match_sdpa_under_the_dense_segment_mask(
    lengths, pack, window, device, tolerance
):
    batch = collate_shared_prompt(pair_arrays(lengths), np.arange(len(lengths)), pack=pack)
    batch = batch.to(torch.device(device))
    rows, width = batch.input_ids.shape
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(rows, heads, width, HEAD_DIM, generator=generator).to(device).requires_grad_()
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    stream = build_stream(batch.segment_ids, batch.position_ids, window)
    expected = dense_reference(q, k, v, batch, window)
    got = attend(*(to_stream(x, stream) for x in (q, k, v)), stream.every_layer)
    got = got[0].transpose(0, 1)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    weights = torch.randn(expected.shape, generator=generator).to(device)
    dense_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    stream_grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
    for dense, streamed in zip(dense_grads, stream_grads, strict=True):
        torch.testing.assert_close(streamed, dense, rtol=10 * tolerance, atol=tolerance)


@pytest.mark.parametrize("lengths, pack, window", layouts())
def test_pieces_compute_no_chosen_by_rejected_cross_pair_or_padding_block(lengths, pack, window):
    batch = collate_shared_prompt(pair_arrays(lengths), np.arange(len(lengths)), pack=pack)
    stream = build_stream(batch.segment_ids, batch.position_ids, window)
    pieces = stream.every_layer.pieces
    computed = sum(
        (piece.queries.stop - piece.queries.start) * sum(end - start for start, end in piece.keys)
        for piece in pieces
    )
    # The prompt with its chosen response, and the rejected response against the prompt
    # and itself: nothing else.
    assert computed == sum((p + c) * (p + c) + r * (p + r) for p, c, r in lengths)
    real = batch.segment_ids != 0
    dense = build_segment_mask(batch.segment_ids, batch.position_ids, window)[:, 0]
    assert computed < int(real.sum()) * batch.input_ids.shape[1]
    allowed = dense[real].sum()  # a real query's row of the mask: its own row's keys
    kept = sum(
        int(piece.mask.sum()) if piece.mask is not None else _causal(piece) for piece in pieces
    )
    assert kept == int(allowed)


def _causal(piece):
    n = piece.queries.stop - piece.queries.start
    return n * (n + 1) // 2


def test_the_last_layer_queries_only_the_labelled_positions():
    lengths = [(5, 3, 4), (2, 6, 2)]
    batch = collate_shared_prompt(pair_arrays(lengths), np.arange(2))
    stream = build_stream(batch.segment_ids, batch.position_ids, None, batch.labels)
    scored = (batch.labels != IGNORE_INDEX).any(0).flatten()[stream.real]
    assert stream.labelled.tolist() == torch.nonzero(scored).flatten().tolist()
    # Each pair's last prompt token and every response token but the last of each branch.
    assert len(stream.labelled) == sum(1 + (c - 1) + (r - 1) for _, c, r in lengths)
    assert stream.last_layer.num_queries == len(stream.labelled)
    covered = [
        i
        for piece in stream.last_layer.pieces
        for i in range(piece.queries.start, piece.queries.stop)
    ]
    assert covered == list(range(len(stream.labelled)))


def test_sdpa_runs_shared_rows_without_building_a_dense_mask(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the dense segment mask was built")

    monkeypatch.setattr("align.model.mistral.build_segment_mask", refuse)
    batch = collate_shared_prompt(pair_arrays(RAGGED), np.arange(len(RAGGED)))
    model = tiny_model(sliding_window=None, attn="sdpa")
    logps, _ = score(model, batch)
    assert torch.isfinite(logps).all()
    with pytest.raises(AssertionError, match="dense segment mask"):
        tiny_model(sliding_window=None, attn="eager")(
            batch.input_ids, position_ids=batch.position_ids, segment_ids=batch.segment_ids
        )


def test_a_stream_refuses_queries_its_pieces_do_not_tile():
    batch = collate_shared_prompt(pair_arrays(RAGGED), np.arange(len(RAGGED)))
    stream = build_stream(batch.segment_ids, batch.position_ids, None)
    q = torch.randn(1, HEADS, stream.every_layer.num_queries - 1, HEAD_DIM)
    k = torch.randn(1, KV_HEADS, stream.every_layer.num_queries, HEAD_DIM)
    with pytest.raises(ValueError, match="stream's attention takes q"):
        attend(q, k, k, stream.every_layer)


def test_a_batch_that_scores_no_token_streams_to_zero_log_probs():
    # A prompt-less pair of one-token responses: nothing predicts either token.
    batch = collate_shared_prompt(pair_arrays([(0, 1, 1)]), np.arange(1))
    assert (batch.labels == IGNORE_INDEX).all()
    model = tiny_model(sliding_window=None, attn="sdpa")
    logps, counts = score(model, batch)
    assert logps.tolist() == [0.0, 0.0] and counts.tolist() == [0, 0]


def test_checkpointed_layers_stream_the_gradients_of_plain_ones():
    from align.train.fsdp import apply_activation_checkpointing

    batch = collate_shared_prompt(pair_arrays(LONG), np.arange(len(LONG)), pack=True)
    grads = []
    for checkpointed in (False, True):
        model = tiny_model(sliding_window=None, attn="sdpa")
        if checkpointed:
            apply_activation_checkpointing(model)
        logps, _ = score(model, batch)
        logps.sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert len(grads[0]) == len(grads[1])
    for plain, checkpointed in zip(*grads, strict=True):
        assert torch.equal(plain, checkpointed)


class _Ops(TorchDispatchMode):
    """The aten ops run under it that write a tensor (views left out), with its shape."""

    def __init__(self):
        super().__init__()
        self.ran: list[tuple[object, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and not func.is_view:
            self.ran.append((func, tuple(out.shape)))
        return out


@pytest.mark.parametrize("lengths, pack, window", layouts())
def test_the_stream_backward_wrote_a_zero_filled_whole_stream_gradient_for_every_piece(
    lengths, pack, window
):
    batch = collate_shared_prompt(pair_arrays(lengths), np.arange(len(lengths)), pack=pack)
    stream = build_stream(batch.segment_ids, batch.position_ids, window)
    length = stream.every_layer.num_queries
    q, k, v = (
        torch.randn(1, heads, length, HEAD_DIM, requires_grad=True)
        for heads in (HEADS, KV_HEADS, KV_HEADS)
    )
    out = attend(q, k, v, stream.every_layer)
    with _Ops() as ops:
        out.sum().backward()
    assert torch.ops.aten.slice_backward.default not in {func for func, _ in ops.ran}
    # q's, k's and v's gradients are each written whole once, by the split's backward.
    whole = [func for func, shape in ops.ran if shape[2:] == (length, HEAD_DIM)]
    assert len(whole) == 3, whole
