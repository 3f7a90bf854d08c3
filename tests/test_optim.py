"""The optimizers: both decay what transformers' Trainer decays, an FSDP model is refused
unless the optimizer gets its sharded parameters; the 8-bit AdamW trains FSDP2 shards,
resumes exactly, is refused where it cannot run, and is what the RSS projection counts."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import tiny_mistral_config

from align.config import ArmConfig, OptimizerConfig
from align.exit_codes import INTERNAL, USAGE, ConfigError
from align.losses.fused import shift_labels
from align.model.checkpoint import save_hf_checkpoint
from align.model.mistral import NmoMistralForCausalLM
from align.train import adamw8bit
from align.train.checkpointing import CheckpointManager
from align.train.fsdp import apply_fsdp
from align.train.memory import MIB, job_shape, optimizer_state_bytes, projected_job_rss
from align.train.optim import (
    OPTIMIZERS,
    UnshardedParameters,
    build_optimizer,
    param_groups_record,
)

torch.set_num_threads(1)

# hidden 64: the embedding, lm_head, q, o and MLP matrices reach bitsandbytes' 8-bit size.
CONFIG = tiny_mistral_config(
    vocab_size=256, hidden_size=64, intermediate_size=128, max_position_embeddings=32
)
ADAMW8BIT = OptimizerConfig(name="adamw8bit", lr=1e-2, weight_decay=0.01)


def sharded_model(seed: int = 0) -> NmoMistralForCausalLM:
    torch.manual_seed(seed)
    model = NmoMistralForCausalLM(CONFIG)
    apply_fsdp(model)
    return model


def nll(model) -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(1, CONFIG.vocab_size, (4, 24), generator=generator)
    logps, counts = model(ids, labels=shift_labels(ids, torch.ones_like(ids, dtype=torch.bool)))
    return -logps.sum() / counts.sum()


def train(model, optimizer, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = nll(model)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class WithBiasesAndLayerNorm(torch.nn.Module):
    """The policy beside a biased projection and an nn.LayerNorm named without "norm",
    so every rule of transformers' decay test has a parameter to decide."""

    def __init__(self):
        super().__init__()
        self.policy = NmoMistralForCausalLM(CONFIG)
        self.proj = torch.nn.Linear(64, 64)
        self.ln_f = torch.nn.LayerNorm(64)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_weight_decay_skips_norm_weights_and_biases_as_transformers_does(name):
    model = WithBiasesAndLayerNorm()
    optimizer = build_optimizer(model, OptimizerConfig(name=name, weight_decay=0.1))
    # The unbound method reads nothing off the trainer: its rule, applied to this model.
    expected = set(transformers.Trainer.get_decay_parameter_names(None, model))
    names = [n for n, _ in model.named_parameters()]
    decayed, kept = param_groups_record(optimizer)
    assert decayed == {"weight_decay": 0.1, "params": [n for n in names if n in expected]}
    assert kept == {"weight_decay": 0.0, "params": [n for n in names if n not in expected]}
    assert {"proj.bias", "ln_f.weight", "ln_f.bias", "policy.norm.weight"} <= set(kept["params"])
    assert "policy.layers.0.attn_norm.weight" in kept["params"]
    assert {"policy.embed.weight", "policy.lm_head.weight", "proj.weight"} <= expected
    # The groups are the optimizer's own: each holds the tensors its names say.
    by_name = dict(model.named_parameters())
    for group, record in zip(optimizer.param_groups, (decayed, kept), strict=True):
        assert [id(p) for p in group["params"]] == [id(by_name[n]) for n in record["params"]]


def test_an_optimizer_built_after_a_no_grad_forward_is_refused_naming_the_root(info):
    """FSDP2 keeps the root's gathered parameters after a forward that no backward
    follows: an optimizer built then would hold plain copies of embed, norm and lm_head
    and never train them."""
    model = sharded_model()
    with torch.no_grad():
        nll(model)
    with pytest.raises(UnshardedParameters) as err:
        build_optimizer(model, OptimizerConfig(name="adamw"))
    assert err.value.exit_code == INTERNAL
    assert "3 parameter(s)" in str(err.value)
    assert "embed.weight, norm.weight, lm_head.weight" in str(err.value)
    # Resharded, the same model gives the optimizer every parameter as its shard.
    model.reshard()
    optimizer = build_optimizer(model, OptimizerConfig(name="adamw"))
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert len(held) == len(list(model.parameters())) == 3 + 9 * CONFIG.num_hidden_layers


def test_adamw8bit_trains_fsdp_shards_with_8bit_moments(info):
    model = sharded_model()
    optimizer = build_optimizer(model, ADAMW8BIT)
    losses = train(model, optimizer, 12)
    assert losses[-1] < 0.8 * losses[0], losses
    eight_bit = 0
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        expected = torch.uint8 if param.numel() >= adamw8bit.MIN_8BIT_SIZE else torch.float32
        assert local(state["state1"]).dtype == local(state["state2"]).dtype == expected, name
        if expected == torch.uint8:
            eight_bit += param.numel()
            assert local(state["absmax1"]).dtype == torch.float32
    assert eight_bit > 0.9 * sum(p.numel() for p in model.parameters())


def test_a_checkpoint_keeps_each_ranks_own_state_and_names_a_missing_one(info, tmp_path):
    manager = CheckpointManager(tmp_path, info, keep=2)
    model = sharded_model()
    optimizer = build_optimizer(model, ADAMW8BIT)
    with_state = manager.save(1, model, optimizer, {"world_size": 1}, {"window": [0.1, -2.5]})
    assert manager.load_rank_state(with_state) == {"window": [0.1, -2.5]}
    without = manager.save(2, model, optimizer, {"world_size": 1})
    with pytest.raises(ValueError, match=r"state_rank00000\.json: missing"):
        manager.load_rank_state(without)


def test_adamw8bit_state_survives_a_dcp_checkpoint_and_resume(info, tmp_path):
    manager = CheckpointManager(tmp_path, info, keep=1)
    model = sharded_model()
    optimizer = build_optimizer(model, ADAMW8BIT)
    train(model, optimizer, 3)
    checkpoint = manager.save(3, model, optimizer, {"world_size": 1})
    saved = {
        (name, key): local(value).clone()
        for name, param in model.named_parameters()
        for key, value in optimizer.state[param].items()
        if torch.is_tensor(value)
    }
    train(model, optimizer, 3)

    resumed = sharded_model(seed=1)  # different weights: the checkpoint must overwrite them
    resumed_optimizer = build_optimizer(resumed, ADAMW8BIT)
    manager.load(checkpoint, resumed, resumed_optimizer)
    # Each save and load is timed, for the receipt's checkpoint figures.
    assert len(manager.save_s) == len(manager.load_s) == 1
    assert min(manager.save_s + manager.load_s) > 0
    for name, param in resumed.named_parameters():
        state = resumed_optimizer.state[param]
        assert state["step"] == 3
        for key, value in state.items():
            if torch.is_tensor(value):
                assert torch.equal(local(value), saved[name, key]), (name, key)
    train(resumed, resumed_optimizer, 3)
    for (name, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


def test_adamw8bit_is_refused_on_a_device_it_cannot_run_on():
    with pytest.raises(ConfigError) as err:
        build_optimizer(torch.nn.Linear(64, 64, device="meta"), ADAMW8BIT)
    assert err.value.exit_code == USAGE
    message = str(err.value)
    assert "'adamw8bit'" in message
    assert "device meta" in message
    assert "bitsandbytes" in message


def test_adamw8bit_without_bitsandbytes_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes the import fail
    adamw8bit._optimizer_class.cache_clear()
    adamw8bit._probe.cache_clear()
    try:
        with pytest.raises(ConfigError, match="'adamw8bit' needs bitsandbytes"):
            build_optimizer(torch.nn.Linear(64, 64), ADAMW8BIT)
    finally:
        adamw8bit._optimizer_class.cache_clear()
        adamw8bit._probe.cache_clear()


# --- the preflight's optimizer-state term --------------------------------------------------


def test_every_optimizer_has_a_memory_model():
    for name in OPTIMIZERS:
        assert optimizer_state_bytes(name, "float32") > 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_projected_state_bytes_per_parameter_match_the_built_optimizer(name):
    model = torch.nn.Sequential(torch.nn.Linear(512, 512, bias=False), torch.nn.Linear(512, 384))
    optimizer = build_optimizer(model, OptimizerConfig(name=name))
    model(torch.randn(2, 512)).sum().backward()
    optimizer.step()
    held = sum(
        value.numel() * value.element_size()
        for state in optimizer.state.values()
        for key, value in state.items()
        if torch.is_tensor(value) and value.dim() > 0 and not key.startswith("qmap")
    )
    per_parameter = held / sum(p.numel() for p in model.parameters())
    # The small bias keeps float32 moments under bitsandbytes: a fraction of a percent.
    assert per_parameter == pytest.approx(optimizer_state_bytes(name, "float32"), rel=0.01)


def test_projection_counts_the_optimizer_that_runs(tmp_path):
    save_hf_checkpoint(NmoMistralForCausalLM(CONFIG), tmp_path / "base")
    params = NmoMistralForCausalLM(CONFIG).num_parameters()
    terms = {}
    for name in OPTIMIZERS:
        cfg = ArmConfig(arm="tiny")
        cfg.optimizer = dataclasses.replace(cfg.optimizer, name=name)
        projection = projected_job_rss(job_shape("dpo", cfg), tmp_path / "base", shard_bytes=0)
        assert projection["optimizer"] == name
        terms[name] = projection["terms_mb"]["optimizer_state"]
        assert terms[name] == pytest.approx(params * optimizer_state_bytes(name, "float32") / MIB)
    assert terms["adamw8bit"] / terms["adamw"] == pytest.approx((2 + 8 / 256) / 8)


# --- two ranks ---------------------------------------------------------------------------

DRIVER = Path(__file__).parent / "drivers" / "adamw8bit_resume.py"


@pytest.mark.slow
def test_two_rank_checkpoint_resume_is_bitwise_exact_with_uneven_shards(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(DRIVER)]
    run = subprocess.run(
        [*cmd, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("resumed equal") == 2, run.stdout
