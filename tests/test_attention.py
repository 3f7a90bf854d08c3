"""The attention backend selector and the agreement of the eager and sdpa backends."""

from __future__ import annotations

import math

import pytest
import torch

from align.model.attention import ATTENTION_BACKENDS, attention, select_attn_implementation

# These tensors are tiny: thread hand-offs would cost far more than the arithmetic.
torch.set_num_threads(1)


@pytest.mark.parametrize("name", ["sdpa", "eager"])
def test_selector_returns_available_backends(name: str):
    assert select_attn_implementation(name, "cpu") == name
    assert select_attn_implementation(name, torch.device("cpu")) == name


@pytest.mark.parametrize("name", ["flash_attention_2", "triton_fa2", "SDPA", ""])
def test_selector_refuses_unknown_backends_listing_available_ones(name: str, monkeypatch):
    # Under Triton's interpreter the CPU may run triton_fa2 (with a receipt): not here.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError) as error:
        select_attn_implementation(name, "cpu")
    message = str(error.value)
    assert repr(name) in message
    assert all(available in message for available in ATTENTION_BACKENDS)


def test_attention_refuses_unknown_impl():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="triton_fa2"):
        attention(q, q, q, None, "triton_fa2")


def test_attention_refuses_heads_that_do_not_group():
    q, kv = torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="multiple"):
        attention(q, kv, kv, None, "eager")


def qkv(batch: int, q_heads: int, kv_heads: int, length: int, dim: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(q_heads * 100 + kv_heads)
    shapes = [(batch, q_heads, length, dim)] + [(batch, kv_heads, length, dim)] * 2
    return [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]


def padded_window_mask(lengths: list[int], length: int, window: int | None) -> torch.Tensor:
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    real = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    return allowed & (real[:, None, None, :] | (key == query))


def reference_attention(q, k, v, mask):
    """Per-head loops, K/V head chosen by integer division: the GQA definition spelled out."""
    batch, q_heads, length, dim = q.shape
    groups = q_heads // k.shape[1]
    out = torch.empty_like(q, dtype=torch.float64)
    for b in range(batch):
        for h in range(q_heads):
            scores = q[b, h].double() @ k[b, h // groups].double().T / math.sqrt(dim)
            allowed = mask[b, 0] if mask is not None else torch.ones(length, length).tril().bool()
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[b, h] = scores.softmax(-1) @ v[b, h // groups].double()
    return out


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("mask_kind", ["causal", "padded", "padded-window"])
def test_eager_and_sdpa_agree_with_the_definition(heads, mask_kind: str):
    q_heads, kv_heads = heads
    q, k, v = qkv(3, q_heads, kv_heads, 16, 8)
    mask = {
        "causal": None,
        "padded": padded_window_mask([16, 11, 4], 16, None),
        "padded-window": padded_window_mask([16, 11, 4], 16, 5),
    }[mask_kind]
    expected = reference_attention(q, k, v, mask)
    for impl in ("eager", "sdpa"):
        out = attention(q, k, v, mask, impl)
        assert out.shape == q.shape and out.dtype == q.dtype
        assert (out.double() - expected).abs().max().item() <= 1e-5


def test_eager_accumulates_in_float32_and_returns_input_dtype():
    q, k, v = qkv(2, 4, 2, 12, 16, dtype=torch.bfloat16)
    mask = padded_window_mask([12, 7], 12, 4)
    eager = attention(q, k, v, mask, "eager")
    sdpa = attention(q, k, v, mask, "sdpa")
    assert eager.dtype == sdpa.dtype == torch.bfloat16
    expected = reference_attention(q, k, v, mask)
    assert (eager.double() - expected).abs().max().item() <= 2e-2
    assert (eager.double() - sdpa.double()).abs().max().item() <= 2e-2
