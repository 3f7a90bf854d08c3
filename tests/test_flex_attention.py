"""The flex attention backend on the CPU: its equivalence gate against SDPA in float64 under
the sdpa backend's own mask, the receipt that admits it, the model's forward through it
against sdpa's, and what it refuses (a CPU backward, a CPU arm that trains with it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from align.config import ArmConfig, apply_overrides, validate
from align.data.loader import collate_preference, collate_shared_prompt
from align.data.shards import pair_arrays
from align.data.tokenize import TokenizedPair
from align.eval.logprobs import sequence_logps
from align.exit_codes import ConfigError
from align.kernels import flex, flex_gate, gate
from align.model.attention import attention, select_attn_implementation
from align.model.hf_config import MistralConfig
from align.model.mistral import NmoMistralForCausalLM
from align.receipts import write_json_atomic


@pytest.fixture(scope="module")
def receipt(tmp_path_factory):
    """The CPU gate's receipt, written where a stage reads it, for the module's tests."""
    key = flex_gate.device_key("cpu")
    written = flex_gate.run_gate("cpu", key)
    path = tmp_path_factory.mktemp("kernels") / "flex.json"
    write_json_atomic(path, written)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(flex_gate.RECEIPT_ENV, str(path))
        yield path, key, written


def test_the_cpu_gate_passes_every_layout_and_times_each_compilation(receipt):
    _, key, written = receipt
    assert written["passed"], written["results"]
    assert [r["shape"] for r in written["results"]] == [s.as_dict() for s in flex_gate.CPU_GRID]
    for result in written["results"]:
        assert result["errors"]["out"] < 1e-5
        assert result["first_call_s"] > 0
    assert key["cuda_capability"].startswith("cpu-")
    assert gate.verify_receipt(flex_gate.SPEC, receipt[0], key)["passed"]


def test_a_mask_that_drops_the_window_fails_the_gate(receipt, monkeypatch):
    build = flex.build_flex_mask
    monkeypatch.setattr(flex, "build_flex_mask", lambda s, p, window: build(s, p, None))
    windowed = flex_gate.CPU_GRID[0]
    assert windowed.window is not None
    result = flex_gate.measure_shape(windowed, torch.device("cpu"), seed=0)
    assert not result["passed"] and result["errors"]["out"] > 1e-2


def test_flex_without_a_receipt_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(flex_gate.RECEIPT_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="no equivalence receipt") as error:
        select_attn_implementation("flex", "cpu")
    assert flex_gate.COMMAND in str(error.value)


def test_a_receipt_for_another_cpu_isa_is_stale(receipt, monkeypatch):
    path, key, _ = receipt
    # The vector ISA inductor compiles for follows the pin; a receipt for another is stale.
    # A pin can only narrow what the CPU has: below AVX-512, to AVX2; below AVX2, to none.
    pinned = "avx2" if "avx512" in key["cuda_capability"] else "default"
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", pinned)
    assert flex_gate.device_key("cpu")["cuda_capability"] != key["cuda_capability"]
    with pytest.raises(ValueError, match="vector ISA"):
        gate.verify_receipt(flex_gate.SPEC, path, flex_gate.device_key("cpu"))


def tiny_config(window: int) -> MistralConfig:
    # head_dim 64, as the CPU gate proves.
    return MistralConfig(
        vocab_size=97,
        hidden_size=128,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=window,
    )


def twin_models(window: int) -> tuple[NmoMistralForCausalLM, NmoMistralForCausalLM]:
    torch.manual_seed(0)
    sdpa = NmoMistralForCausalLM(tiny_config(window), "sdpa").eval()
    with_flex = NmoMistralForCausalLM(tiny_config(window), "flex").eval()
    with_flex.load_state_dict(sdpa.state_dict())
    return sdpa, with_flex


def test_the_models_shared_and_packed_rows_through_flex_match_sdpa(receipt):
    sdpa, with_flex = twin_models(window=48)
    rows = ((60, 50, 40), (40, 20, 15, 30, 25, 20))  # a shared row, a packed row of two
    shape = flex_gate.FlexShape(2, 2, 1, 150, 64, "float32", rows, 48, False)
    segment_ids, position_ids = flex_gate.segments_of(shape, torch.device("cpu"))
    ids = torch.randint(0, 97, segment_ids.shape, generator=torch.Generator().manual_seed(1))
    layout = {"segment_ids": segment_ids, "position_ids": position_ids, "return_hidden": True}
    with torch.no_grad():
        expected, found = sdpa(ids, **layout), with_flex(ids, **layout)
    assert torch.allclose(found, expected, rtol=0, atol=1e-5)


def test_packed_pairs_scored_through_flex_match_the_two_row_layout(receipt):
    sdpa, with_flex = twin_models(window=48)
    draw = np.random.default_rng(3).integers
    lengths = [(40, 30, 20), (10, 5, 8), (20, 12, 6), (3, 30, 40), (8, 2, 1)]
    pairs = [
        TokenizedPair(list(draw(1, 97, p)), list(draw(1, 97, c)), list(draw(1, 97, r)), False)
        for p, c, r in lengths
    ]
    arrays = pair_arrays(range(len(pairs)), pairs, pad_id=0)
    rows = np.arange(len(pairs))
    packed = collate_shared_prompt(arrays, rows, pack=True)
    assert packed.input_ids.shape[0] < len(rows)
    with torch.no_grad():
        expected = sequence_logps(sdpa, collate_preference(arrays, rows))
        found = sequence_logps(with_flex, packed)
    assert torch.allclose(found, expected, rtol=1e-5, atol=0)


def test_the_models_padded_rows_through_flex_match_sdpa(receipt):
    sdpa, with_flex = twin_models(window=32)
    ids = torch.randint(0, 97, (3, 70), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, 40:] = 0
    mask[2, 1:] = 0
    with torch.no_grad():
        expected = sdpa(ids, mask, return_hidden=True)
        found = with_flex(ids, mask, return_hidden=True)
    # Padded queries are each backend's own (sdpa's see the real keys, flex's themselves).
    real = mask.bool()
    assert torch.allclose(found[real], expected[real], rtol=0, atol=1e-5)


def test_widths_of_one_bucket_share_one_compilation(receipt):
    _, with_flex = twin_models(window=32)
    with torch.no_grad():
        for width in (130, 200, 256):
            with_flex(torch.zeros(1, width, dtype=torch.long))
    single = [s for s in flex.compile_seconds() if (s["rows"], s["q_heads"]) == (1, 2)]
    assert [shape["width"] for shape in single] == [256], single


def test_flex_refuses_a_head_dim_its_gate_did_not_prove(receipt):
    q = k = v = torch.randn(1, 2, 8, 16)
    segments, positions = flex.plain_segments(None, torch.Size((1, 8)), torch.device("cpu"))
    mask = flex.build_flex_mask(segments, positions, None)
    with pytest.raises(ValueError, match=r"proven on cpu only for .* head dims \[64, 128\]"):
        attention(q, k, v, mask, "flex")


def test_flex_refuses_a_backward_on_the_cpu(receipt):
    q = torch.randn(1, 2, 8, 16, requires_grad=True)
    k = v = torch.randn(1, 2, 8, 16)
    segments, positions = flex.plain_segments(None, torch.Size((1, 8)), torch.device("cpu"))
    with pytest.raises(ValueError, match="no backward on the CPU"):
        flex.flex_attention_fn(q, k, v, flex.build_flex_mask(segments, positions, None))


def test_a_cpu_arm_may_score_with_flex_but_not_train_with_it():
    scoring = ArmConfig(arm="a")
    apply_overrides(scoring, ["--ref.attn_implementation=flex"], "arm.toml")
    validate(scoring, "arm.toml")
    training = ArmConfig(arm="a")
    apply_overrides(training, ["--model.attn_implementation=flex"], "arm.toml")
    with pytest.raises(ConfigError, match=r"'model\.attn_implementation' expected a backend"):
        validate(training, "arm.toml")
