"""Schedule, optimizer, batch order, DPO loss, sequence log-probs and held-out statistics."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm
from tiny_models import tiny_mistral_config

from align.config import BatchConfig, OptimizerConfig
from align.data.loader import PairShard
from align.data.sampler import StepSampler, epoch_order, steps_per_epoch
from align.data.shards import PAIR_FORMAT, pair_arrays, write_shard
from align.data.tokenize import TokenizedPair
from align.eval.logprobs import sequence_logps
from align.eval.preference import implicit_reward_preference, policy_preference
from align.eval.stats import accuracy_summary, wilson_interval
from align.exit_codes import USAGE, ConfigError
from align.losses.dpo import DPOObjective, dpo_losses
from align.model.mistral import NmoMistralForCausalLM
from align.train.adapters import DpoAdapter
from align.train.optim import (
    assert_horizon_consistent,
    build_optimizer,
    lr_factor,
    training_horizon,
)
from align.train.trainer import reduce_step_sums

# These tensors are tiny: thread hand-offs would cost far more than the arithmetic.
torch.set_num_threads(1)

PAD = 3

# --- learning-rate schedule --------------------------------------------------------------


def test_warmup_rises_linearly_to_one():
    assert [lr_factor(s, 4, 20, 0.1) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_decays_to_min_ratio_at_the_horizon():
    warmup, horizon, floor = 4, 20, 0.1
    values = [lr_factor(s, warmup, horizon, floor) for s in range(warmup, horizon + 1)]
    assert values[0] == 1.0
    assert all(a > b for a, b in itertools.pairwise(values))
    assert lr_factor(12, warmup, horizon, floor) == pytest.approx(floor + (1 - floor) * 0.5)
    assert lr_factor(horizon, warmup, horizon, floor) == pytest.approx(floor)
    assert lr_factor(horizon + 7, warmup, horizon, floor) == pytest.approx(floor)


def test_no_warmup_starts_at_full_rate():
    assert lr_factor(0, 0, 10, 0.0) == 1.0
    assert lr_factor(10, 0, 10, 0.0) == pytest.approx(0.0)


# --- horizon -----------------------------------------------------------------------------

BATCH = BatchConfig(world_size=1, micro_batch=8, grad_accum=2, global_batch=16, epochs=8)


@pytest.mark.parametrize(("pairs", "steps"), [(96, 48), (97, 48), (100, 48), (1, 8)])
def test_training_horizon_is_epochs_times_floor_steps_at_least_one(pairs, steps):
    assert training_horizon(pairs, BATCH) == steps


def test_consistent_horizon_is_accepted():
    assert_horizon_consistent(48, 100, BATCH)


def test_inconsistent_horizon_is_refused_naming_the_numbers():
    with pytest.raises(ConfigError) as err:
        assert_horizon_consistent(28, 100, BATCH)
    message = str(err.value)
    assert err.value.exit_code == USAGE
    assert "horizon 28" in message
    assert "8 x floor(100 / 16) = 48" in message


# --- optimizer ---------------------------------------------------------------------------


def test_build_optimizer_refuses_an_unknown_name():
    with pytest.raises(ConfigError) as err:
        build_optimizer(torch.nn.Linear(2, 2), OptimizerConfig(name="sgd"))
    assert err.value.exit_code == USAGE
    assert "'sgd'" in str(err.value)


def test_build_optimizer_honours_the_config_and_skips_frozen_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    cfg = OptimizerConfig(lr=3e-4, betas=[0.8, 0.9], eps=1e-6, weight_decay=0.01)
    optimizer = build_optimizer(model, cfg)
    assert isinstance(optimizer, torch.optim.AdamW)
    decayed, kept = optimizer.param_groups
    for group in (decayed, kept):
        assert (group["lr"], group["betas"], group["eps"]) == (3e-4, (0.8, 0.9), 1e-6)
    # The bias is not decayed, as transformers' Trainer decays no bias.
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.01, 0.0)
    assert [id(p) for p in decayed["params"]] == [id(model[1].weight)]
    assert [id(p) for p in kept["params"]] == [id(model[1].bias)]


# --- batch order -------------------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 4])
@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(8, 90), accum=st.integers(1, 2), micro=st.integers(1, 3), seed=st.integers(0, 9)
)
def test_every_row_once_per_epoch_across_ranks(world, n, accum, micro, seed):
    batch = BatchConfig(
        world_size=world,
        micro_batch=micro,
        grad_accum=accum,
        global_batch=world * micro * accum,
        epochs=2,
        seed=seed,
    )
    if n < world * accum:
        return
    samplers = [StepSampler(n, batch, rank, world) for rank in range(world)]
    per_epoch = steps_per_epoch(n, batch.global_batch)
    assert len(samplers[0]) == 2 * per_epoch
    for epoch in range(2):
        seen = []
        for step in range(epoch * per_epoch, (epoch + 1) * per_epoch):
            counts = [len(s.rank_rows(step)) for s in samplers]
            assert counts == [accum] * world
            for sampler in samplers:
                for rows in sampler.rank_rows(step):
                    assert len(rows) >= 1
                    seen.extend(rows.tolist())
        assert sorted(seen) == list(range(n))


def test_last_step_of_an_epoch_takes_the_remainder():
    batch = BatchConfig(world_size=1, micro_batch=4, grad_accum=2, global_batch=8, epochs=1)
    sampler = StepSampler(37, batch, 0, 1)
    assert len(sampler) == 4
    assert [len(sampler.global_rows(s)) for s in range(4)] == [8, 8, 8, 13]


def test_epoch_order_is_fixed_by_the_seed_and_differs_per_epoch():
    assert np.array_equal(epoch_order(20, 1, 0), epoch_order(20, 1, 0))
    assert not np.array_equal(epoch_order(20, 1, 0), epoch_order(20, 2, 0))
    assert not np.array_equal(epoch_order(20, 1, 0), epoch_order(20, 1, 1))


def test_sampler_refuses_fewer_rows_than_micro_batches_of_a_step():
    batch = BatchConfig(world_size=2, micro_batch=1, grad_accum=2, global_batch=4, epochs=1)
    with pytest.raises(ConfigError, match="3 rows cannot fill"):
        StepSampler(3, batch, 0, 2)


# --- DPO loss ----------------------------------------------------------------------------


def test_dpo_loss_at_policy_equal_reference_is_log2_with_zero_rewards():
    logps = torch.tensor([-3.5, -12.25, -0.5, -40.0])
    other = torch.tensor([-4.0, -1.0, -7.5, -39.0])
    losses, chosen_r, rejected_r = dpo_losses(
        logps, other, logps.clone(), other.clone(), DPOObjective(beta=0.1)
    )
    assert torch.equal(losses, torch.full_like(losses, math.log(2)))
    assert torch.equal(chosen_r, torch.zeros(4))
    assert torch.equal(rejected_r, torch.zeros(4))


def test_dpo_gradient_raises_chosen_and_lowers_rejected():
    policy_c = torch.tensor([-3.0, -5.0, -1.0], requires_grad=True)
    policy_r = torch.tensor([-2.0, -6.0, -9.0], requires_grad=True)
    ref_c, ref_r = torch.tensor([-3.5, -4.0, -2.0]), torch.tensor([-2.5, -6.5, -8.0])
    losses, _, _ = dpo_losses(policy_c, policy_r, ref_c, ref_r, DPOObjective(beta=0.5))
    losses.sum().backward()
    # Gradient descent moves against the gradient: chosen up, rejected down.
    assert (policy_c.grad < 0).all()
    assert (policy_r.grad > 0).all()
    assert torch.allclose(policy_c.grad, -policy_r.grad)


def test_dpo_loss_and_rewards_match_the_formula():
    losses, chosen_r, rejected_r = dpo_losses(
        torch.tensor([-1.0]),
        torch.tensor([-3.0]),
        torch.tensor([-2.0]),
        torch.tensor([-2.0]),
        DPOObjective(beta=0.5),
    )
    assert chosen_r.item() == pytest.approx(0.5)
    assert rejected_r.item() == pytest.approx(-0.5)
    assert losses.item() == pytest.approx(math.log1p(math.exp(-1.0)))


def test_dpo_refuses_an_unknown_loss():
    with pytest.raises(ValueError, match=r"dpo\.loss expected one of .* found 'simpo_typo'"):
        DPOObjective(beta=0.1, loss="simpo_typo")


# --- sequence log-probs on a tiny model --------------------------------------------------

VOCAB = 40


@pytest.fixture(scope="module")
def tiny_model() -> NmoMistralForCausalLM:
    config = tiny_mistral_config(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        pad_token_id=PAD,
    )
    torch.manual_seed(0)
    model = NmoMistralForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.5)
    return model.eval()


PAIRS = [
    TokenizedPair(prompt=[1, 10, 11, 12], chosen=[20, 21, 2], rejected=[30, 2], truncated=False),
    TokenizedPair(prompt=[1, 13], chosen=[22, 2], rejected=[31, 32, 33, 34, 2], truncated=False),
    TokenizedPair(
        prompt=[1, 14, 15], chosen=[23, 24, 25, 26, 27, 2], rejected=[35, 2], truncated=False
    ),
]


@pytest.fixture(scope="module")
def shard(tmp_path_factory) -> PairShard:
    path = tmp_path_factory.mktemp("shard") / "pairs.safetensors"
    write_shard(path, pair_arrays([101, 102, 103], PAIRS, PAD), PAIR_FORMAT)
    return PairShard(path)


@torch.no_grad()
def hand_logp(model, prompt: list[int], response: list[int]) -> float:
    """Summed log p(response | prompt), from one unpadded forward of this row alone."""
    ids = torch.tensor([prompt + response])
    logp = torch.log_softmax(model(ids)[0].double(), dim=-1)
    return sum(float(logp[t - 1, ids[0, t]]) for t in range(len(prompt), ids.shape[1]))


def test_collate_puts_chosen_then_rejected_right_padded(shard):
    batch = shard.collate(np.array([2, 0]))
    assert batch.input_ids.shape == (4, 9)
    assert batch.input_ids[0, :9].tolist() == [1, 14, 15, 23, 24, 25, 26, 27, 2]
    assert batch.input_ids[1].tolist() == [1, 10, 11, 12, 20, 21, 2, PAD, PAD]
    assert batch.input_ids[2, :5].tolist() == [1, 14, 15, 35, 2]
    assert batch.attention_mask.sum(1).tolist() == [9, 7, 5, 6]
    assert batch.loss_mask.sum(1).tolist() == [6, 3, 2, 2]
    assert not batch.loss_mask[:, :3].any()
    assert batch.num_loss_tokens == 13


@torch.no_grad()
def test_sequence_logps_equals_a_hand_computation(tiny_model, shard):
    rows = np.array([0, 1, 2])
    got = sequence_logps(tiny_model, shard.collate(rows))
    assert got.dtype == torch.float32
    expected = [hand_logp(tiny_model, p.prompt, p.chosen) for p in PAIRS]
    expected += [hand_logp(tiny_model, p.prompt, p.rejected) for p in PAIRS]
    assert got.tolist() == pytest.approx(expected, abs=1e-4)


@torch.no_grad()
def test_dpo_adapter_against_its_own_reference_gives_log2(tiny_model, shard):
    all_rows = np.arange(len(shard))
    logps = sequence_logps(tiny_model, shard.collate(all_rows))
    adapter = DpoAdapter(DPOObjective(beta=0.1), ref_chosen=logps[:3], ref_rejected=logps[3:])
    # Rows out of order: the adapter must look the reference up by row, not by position.
    batch = shard.collate(np.array([2, 0]))
    loss, sums = adapter.loss(tiny_model, batch, denominator=2.0)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-5)
    assert sums["rewards/chosen"] == pytest.approx(0.0, abs=1e-5)
    assert sums["rewards/rejected"] == pytest.approx(0.0, abs=1e-5)
    assert sums["pairs"] == 2


# --- the training metrics a step logs -----------------------------------------------------

METRICS_OBJECTIVE = DPOObjective(beta=0.2, rpo_alpha=0.3)
# The reference sits apart from the policy, so rewards are neither zero nor all one sign.
REFERENCE_OFFSETS = ((0.7, -0.4), (-1.1, 0.9), (0.3, 0.2))
# Micro-batches per rank: rank 0 holds two pairs, rank 1 one, so a mean of rank means is wrong.
RANK_ROWS = (([0], [1]), ([2],))


def hand_metrics(model) -> dict[str, float]:
    """What a step over all three pairs must log, from the DPO formulas and hand log-probs."""
    rows = []
    for pair, (off_c, off_r) in zip(PAIRS, REFERENCE_OFFSETS, strict=True):
        chosen, rejected = (hand_logp(model, pair.prompt, r) for r in (pair.chosen, pair.rejected))
        reward_c = METRICS_OBJECTIVE.beta * off_c
        reward_r = METRICS_OBJECTIVE.beta * off_r
        nll = -chosen / len(pair.chosen)
        loss = math.log1p(math.exp(-(reward_c - reward_r))) + METRICS_OBJECTIVE.rpo_alpha * nll
        rows.append((loss, reward_c, reward_r, float(reward_c > reward_r), chosen, rejected, nll))
    names = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies")
    names += ("logps/chosen", "logps/rejected", "nll/chosen_seq_mean")
    means = {name: sum(row[i] for row in rows) / len(rows) for i, name in enumerate(names)}
    means["rewards/margins"] = means["rewards/chosen"] - means["rewards/rejected"]
    return means


def metrics_adapter(model, shard) -> DpoAdapter:
    logps = sequence_logps(model, shard.collate(np.arange(len(shard)))).double()
    offsets = torch.tensor(REFERENCE_OFFSETS, dtype=torch.float64)
    return DpoAdapter(METRICS_OBJECTIVE, logps[:3] - offsets[:, 0], logps[3:] - offsets[:, 1])


def step_metrics_worker(rank: int, init_file: str, model_path: str, shard_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        model, shard = torch.load(model_path, weights_only=False), PairShard(shard_path)
        with torch.no_grad():
            adapter = metrics_adapter(model, shard)
            batches = [shard.collate(np.array(rows)) for rows in RANK_ROWS[rank]]
            sums = [adapter.loss(model, batch, denominator=3.0)[1] for batch in batches]
        tokens = sum(int(batch.attention_mask.sum()) for batch in batches)
        torch.save(reduce_step_sums(adapter, sums, tokens), f"{model_path}.rank{rank}")
    finally:
        dist.destroy_process_group()


def test_a_step_logs_the_dpo_metrics_over_every_pair_on_every_rank(tiny_model, shard, tmp_path):
    model_path = tmp_path / "model.pt"
    torch.save(tiny_model, model_path)
    args = (str(tmp_path / "init"), str(model_path), str(shard.path))
    mp.spawn(step_metrics_worker, args=args, nprocs=2, join=True)
    expected = hand_metrics(tiny_model)
    attended = int(shard.collate(np.arange(len(shard))).attention_mask.sum())
    for rank in range(2):
        metrics, tokens = torch.load(f"{model_path}.rank{rank}")
        assert metrics.keys() == expected.keys()
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, rel=1e-4, abs=1e-5), name
        assert tokens == attended


# --- held-out statistics -----------------------------------------------------------------


def wilson_by_hand(k: int, n: int, confidence: float) -> tuple[float, float]:
    z = norm.ppf(1 - (1 - confidence) / 2)
    p = k / n
    denominator = 1 + z**2 / n
    centre = (p + z**2 / (2 * n)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    return centre - half, centre + half


@pytest.mark.parametrize(("k", "n", "confidence"), [(81, 100, 0.95), (0, 20, 0.95), (7, 9, 0.9)])
def test_wilson_interval_matches_the_formula(k, n, confidence):
    low, high = wilson_interval(k, n, confidence)
    want_low, want_high = wilson_by_hand(k, n, confidence)
    assert low == pytest.approx(want_low, abs=1e-9)
    assert high == pytest.approx(want_high, abs=1e-9)


def test_wilson_interval_of_81_in_100():
    low, high = wilson_interval(81, 100)
    assert (round(low, 4), round(high, 4)) == (0.7222, 0.8749)


def test_wilson_interval_of_no_trials_is_refused():
    with pytest.raises(ValueError):
        wilson_interval(0, 0)


def test_accuracy_summary_counts():
    summary = accuracy_summary([True, False, True, True])
    assert (summary["n"], summary["correct"], summary["accuracy"]) == (4, 3, 0.75)
    assert (summary["ci_low"], summary["ci_high"]) == pytest.approx(wilson_interval(3, 4))


def test_ties_count_as_wrong():
    chosen = np.array([-1.0, -2.0, -3.0, -4.0])
    rejected = np.array([-1.0, -3.0, -3.0, -1.0])
    summary = policy_preference(chosen, rejected)
    assert (summary["n"], summary["correct"]) == (4, 1)
    ref = np.zeros(4)
    assert implicit_reward_preference(chosen, rejected, ref, ref)["correct"] == 1


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo group (left alone if an earlier test of this process made one)."""
    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        init = f"file://{tmp_path / 'init'}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    yield
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize(("started_ago_s", "stops"), [(100.0, True), (10.0, False)])
def test_the_wall_budget_counted_from_the_trainer_modules_import(
    one_rank_group, started_ago_s, stops
):
    """max_wall_seconds counts from the start the stage passes in, not from whenever the
    trainer's module happened to be imported."""
    import time

    from align.config import TrainerConfig
    from align.train.trainer import StopRequest, Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.cfg = TrainerConfig(max_wall_seconds=50.0)
    trainer.stop = StopRequest()
    trainer.stage_started = time.monotonic() - started_ago_s
    assert trainer._stop_requested() is stops
