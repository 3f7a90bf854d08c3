"""Master, compute and reduce dtypes: what the pre-registration names is what runs.

One rank here (a one-rank gloo group); two ranks and resume in test_trainer_multirank.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_pairs import write_tiny_pairs

from align.config import ModelConfig, OptimizerConfig
from align.exit_codes import ConfigError
from align.train.optim import build_optimizer
from align.train.precision import Precision, check_read_back
from align.train.representability import moved_fraction, round_to, sample_weights
from align.train.session import load_policy
from align.utils.dist import destroy_distributed, init_distributed

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    work = tmp_path_factory.mktemp("precision")
    write_tiny_pairs(work, 4, 12)
    return work / "base"


@pytest.fixture
def info(tmp_path):
    info = init_distributed(tmp_path, "cpu")
    yield info
    destroy_distributed()


def load(checkpoint, info, **model):
    return load_policy(checkpoint, ModelConfig(**model), info)


class ForwardDtypes:
    """Hooks of the test's own: what each decoder layer and attention block really receive."""

    def __init__(self, model):
        self.seen: dict[str, set[torch.dtype]] = {"layer_in": set(), "attn_out": set()}
        self.handles = []
        for layer in model.layers:
            self.handles.append(layer.register_forward_pre_hook(self._layer))
            self.handles.append(layer.attn.register_forward_hook(self._attn))

    def _layer(self, module, args):
        self.seen["layer_in"].add(args[0].dtype)

    def _attn(self, module, args, output):
        self.seen["attn_out"].add(output.dtype)


def nll_step_loss(model, vocab: int) -> torch.Tensor:
    """A loss whose gradient reaches every parameter: every token id appears as input."""
    ids = torch.arange(vocab).reshape(2, -1)
    labels = torch.roll(ids, -1, dims=1)
    logps, _ = model(ids, labels=labels)
    return -logps.sum() / ids.numel()


def test_a_bf16_compute_arm_keeps_float32_masters_and_computes_in_bf16(checkpoint, info):
    model = load(checkpoint, info, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    record = model.precision
    assert (record["compute"], record["master"], record["reduce"]) == (
        "bfloat16",
        "float32",
        "float32",
    )
    assert record["read_back"]["linear_weights"] == ["bfloat16"]
    assert record["read_back"]["linear_outputs"] == ["bfloat16"]
    assert record["read_back"]["fsdp_master"] == ["float32"]
    assert record["loss"] == "float32"

    hooks = ForwardDtypes(model)
    loss = nll_step_loss(model, model.config.vocab_size)
    assert hooks.seen == {"layer_in": {torch.bfloat16}, "attn_out": {torch.bfloat16}}
    loss.backward()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


def test_a_float32_arm_computes_in_float32(checkpoint, info):
    model = load(checkpoint, info)
    hooks = ForwardDtypes(model)
    nll_step_loss(model, model.config.vocab_size)
    assert hooks.seen == {"layer_in": {torch.float32}, "attn_out": {torch.float32}}
    assert model.precision["read_back"]["linear_outputs"] == ["float32"]


def test_a_pure_bf16_arm_says_so_and_holds_bf16_masters(checkpoint, info):
    model = load(checkpoint, info, dtype="bfloat16", master_dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.precision["master"] == "bfloat16"


def test_a_live_model_that_differs_from_the_preregistration_is_refused():
    found = {
        "parameters": ["float32"],
        "fsdp_master": ["float32"],
        "fsdp_compute": ["float32"],
        "fsdp_reduce": ["float32"],
        "linear_inputs": ["float32"],
        "linear_weights": ["float32"],
        "linear_outputs": ["float32"],
    }
    check_read_back(found, Precision("float32"))
    with pytest.raises(
        ConfigError, match=r"linear_outputs expected \['bfloat16'\], found \['float32'\]"
    ):
        check_read_back(found, Precision("bfloat16"))


def moved_by_one_step(model, lr: float) -> float:
    """Fraction of master elements one AdamW step at `lr` changes."""
    optimizer = build_optimizer(model, OptimizerConfig(name="adamw", lr=lr, weight_decay=0.0))
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    nll_step_loss(model, model.config.vocab_size).backward()
    optimizer.step()
    after = [p.detach().full_tensor() for p in model.parameters()]
    changed = sum(int((a != b).sum()) for a, b in zip(after, before, strict=True))
    return changed / sum(b.numel() for b in before)


def test_one_step_at_lr_5e7_moves_at_least_99_percent_of_float32_masters(checkpoint, info):
    model = load(checkpoint, info, dtype="bfloat16")
    fraction = moved_by_one_step(model, 5e-7)
    print(f"float32 masters, bf16 compute: {fraction:.2%} of elements moved at lr 5e-7")
    assert fraction >= 0.99


def test_one_step_at_lr_5e7_moves_almost_no_bf16_masters(checkpoint, info):
    model = load(checkpoint, info, dtype="bfloat16", master_dtype="bfloat16")
    fraction = moved_by_one_step(model, 5e-7)
    print(f"bf16 masters: {fraction:.2%} of elements moved at lr 5e-7")
    assert fraction < 0.05
    # The preflight's estimate from the checkpoint's weights tells the same story.
    assert moved_fraction(sample_weights(checkpoint), 5e-7, "bfloat16") < 0.05


def test_bfloat16_rounding_is_round_to_nearest_even():
    values = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 1.0 + 2**-9, -2.5], dtype=np.float32)
    expected = torch.from_numpy(values).to(torch.bfloat16).double().numpy()
    np.testing.assert_array_equal(round_to(values, "bfloat16"), expected)


def test_moved_fraction_counts_only_representable_updates():
    weights = np.array([1.0, 1e-4, 0.75, 2e-4], dtype=np.float32)
    # Just below 1.0 and 0.75, bf16 steps are 2**-8 apart: a 1e-3 step rounds back.
    assert moved_fraction(weights, 1e-3, "bfloat16") == pytest.approx(0.5)
    assert moved_fraction(weights, 1e-3, "float32") == 1.0
