"""align's DPO objectives and logged metrics equal TRL's DPOTrainer on identical float64 inputs.

TRL 1.16 computes its losses and metrics inside `DPOTrainer._compute_loss`. The test calls
that unbound method on a stand-in trainer carrying the attributes it reads, with a
stand-in model whose fused LM head returns given per-token log-probs, so TRL and align
score the same numbers. Where TRL has no equivalent, the test says which formula stands in:
cDPO is TRL's sigmoid and robust losses combined, an option TRL does not length-normalize
gets per-token mean log-probs as input, and R-DPO is checked against its paper by hand.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
from trl.trainer.dpo_trainer import DPOTrainer

from align.losses.dpo import NLL_METRIC, PER_TOKEN, DPOObjective, dpo_objective, metric_sums
from align.train.adapters import DpoAdapter

BETA = 0.3
SMOOTHING = 0.2
RPO_ALPHA = 0.4
RDPO_ALPHA = 0.05
PROMPT = 2
# Float64 rounding: sums of a dozen log-probs of order 1, differenced and averaged.
CLOSE = {"rel": 1e-12, "abs": 1e-12}
# TRL's metrics that align logs under the same names; TRL's others need logits.
TRL_METRICS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/margins",
    "rewards/accuracies",
    "logps/chosen",
    "logps/rejected",
)


@dataclass(frozen=True)
class Batch:
    """A collated TRL batch (chosen rows, then rejected rows) and the policy's log-probs
    of its labels, [rows, T - 1]: entry t scores the token at t + 1."""

    inputs: dict[str, torch.Tensor]
    token_logps: torch.Tensor

    @property
    def scored(self) -> torch.Tensor:
        return self.inputs["completion_mask"][:, 1:].bool()

    @property
    def counts(self) -> torch.Tensor:
        return self.scored.sum(1)

    @property
    def ref(self) -> torch.Tensor:
        return torch.cat((self.inputs["ref_chosen_logps"], self.inputs["ref_rejected_logps"]))

    def per_token(self) -> Batch:
        """Every log-prob divided by its row's completion length, so that sums are means."""
        counts = self.counts.double()
        pairs = len(counts) // 2
        ref = self.ref / counts
        inputs = {**self.inputs, "ref_chosen_logps": ref[:pairs], "ref_rejected_logps": ref[pairs:]}
        return Batch(inputs, self.token_logps / counts[:, None])


def make_batch(lengths: list[int], seed: int) -> Batch:
    """Chosen rows, then rejected rows: a PROMPT-token prompt, completions of `lengths`
    tokens, right padding; the reference 0 to 6 nats from the policy either way.

    The prompt keeps completion_mask[:, 0] at 0, as TRL's collator does: TRL's IPO divides
    by completion_mask's row sums, but its log-probs sum over completion_mask[:, 1:].
    """
    generator = torch.Generator().manual_seed(seed)
    rows, width = len(lengths), PROMPT + max(lengths) + 1
    ends = PROMPT + torch.tensor(lengths)[:, None]
    positions = torch.arange(width)
    completion = (positions >= PROMPT) & (positions < ends)
    attention = positions < ends
    token_logps = -0.05 - 3 * torch.rand(rows, width - 1, generator=generator, dtype=torch.float64)
    sums = torch.where(completion[:, 1:], token_logps, 0.0).sum(1)
    ref = sums + 6 * torch.rand(rows, generator=generator, dtype=torch.float64) - 3
    inputs = {
        "input_ids": torch.randint(3, 100, (rows, width), generator=generator) * attention,
        "attention_mask": attention.long(),
        "completion_mask": completion.long(),
        "ref_chosen_logps": ref[: rows // 2],
        "ref_rejected_logps": ref[rows // 2 :],
    }
    return Batch(inputs, token_logps)


# Completion lengths of eight chosen rows, then their eight rejected rows. Eight pairs:
# TRL averages its 0/1 accuracies in float32, which holds k / 8 exactly. The seeds give
# accuracies that differ between sums and per-token means (checked below).
RAGGED = make_batch([3, 9, 5, 7, 4, 8, 6, 2, 8, 2, 6, 5, 9, 3, 4, 7], seed=0)
# Every chosen response 6 tokens long: RPO's two NLL forms agree here.
EQUAL_CHOSEN = make_batch([6, 6, 6, 6, 6, 6, 6, 6, 8, 2, 6, 5, 9, 3, 4, 7], seed=8)


def fused_head(token_logps: torch.Tensor):
    """The policy TRL calls: `log_probs` holds log p(labels[:, t + 1]) at t, 0 where that
    label is ignored, as TRL's fused LM head returns them."""

    def forward(*, labels, fused_lm_head, **model_kwargs):
        assert fused_lm_head
        scored = labels[:, 1:] != -100
        zeros = torch.zeros_like(token_logps)
        return SimpleNamespace(
            log_probs=torch.where(scored, token_logps, 0.0),
            entropy=zeros,
            mean_logits=zeros,
            is_top1=torch.zeros_like(scored),
        )

    return forward


def trl_step(batch: Batch, losses: dict[str, float]) -> tuple[float, dict[str, float]]:
    """TRL's loss and logged metrics for one training micro-batch: `losses` maps TRL loss
    types to their weights, with precomputed reference log-probs on one process."""
    identity = SimpleNamespace(
        device=torch.device("cpu"), gather=lambda t: t, gather_for_metrics=lambda t: t
    )
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=identity,
        aux_loss_enabled=False,
        ld_alpha=None,
        precompute_ref_logps=True,
        f_divergence_type="reverse_kl",
        loss_types=list(losses),
        loss_weights=list(losses.values()),
        beta=BETA,
        label_smoothing=SMOOTHING,
        use_weighting=False,
        _metrics={"train": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )
    loss = DPOTrainer._compute_loss(trainer, fused_head(batch.token_logps), batch.inputs, False)
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    return float(loss), logged


def align_step(batch: Batch, objective: DPOObjective) -> dict[str, float]:
    """What align's trainer logs for `batch` as one step, from the same log-probs."""
    pairs = len(batch.counts) // 2
    logps = torch.where(batch.scored, batch.token_logps, 0.0).sum(1)
    result = dpo_objective(logps, batch.counts, batch.ref[:pairs], batch.ref[pairs:], objective)
    adapter = DpoAdapter(objective, batch.ref[:pairs], batch.ref[pairs:])
    return adapter.summarize({"pairs": pairs, **metric_sums(result)})


# cDPO's (1 - e) l(d) + e l(-d), l = -log sigmoid: TRL 1.16's sigmoid loss has no label
# smoothing, and its robust loss is ((1 - e) l(d) - e l(-d)) / (1 - 2e), so cDPO is
# 2 (1 - e) x sigmoid - (1 - 2e) x robust, both TRL's code with TRL's weights.
CDPO = {"sigmoid": 2 * (1 - SMOOTHING), "robust": -(1 - 2 * SMOOTHING)}
# RPO is TRL's "sft" loss weighted by rpo_alpha beside its preference loss.
CASES = {
    # name: (align's objective, TRL's loss types and weights, TRL fed per-token means)
    "sigmoid": (DPOObjective(beta=BETA), {"sigmoid": 1.0}, False),
    "cdpo": (DPOObjective(beta=BETA, label_smoothing=SMOOTHING), CDPO, False),
    "ipo": (DPOObjective(beta=BETA, loss="ipo"), {"ipo": 1.0}, False),
    "hinge": (DPOObjective(beta=BETA, loss="hinge"), {"hinge": 1.0}, False),
    "rpo": (
        DPOObjective(beta=BETA, rpo_alpha=RPO_ALPHA),
        {"sigmoid": 1.0, "sft": RPO_ALPHA},
        False,
    ),
    "sigmoid-normalized": (
        DPOObjective(beta=BETA, length_normalize=True),
        {"sigmoid_norm": 1.0},
        False,
    ),
    "cdpo-normalized": (
        DPOObjective(beta=BETA, label_smoothing=SMOOTHING, length_normalize=True),
        CDPO,
        True,
    ),
    "ipo-normalized": (
        DPOObjective(beta=BETA, loss="ipo", length_normalize=True),
        {"ipo": 1.0},
        False,
    ),
    "hinge-normalized": (
        DPOObjective(beta=BETA, loss="hinge", length_normalize=True),
        {"hinge": 1.0},
        True,
    ),
    "rpo-normalized": (
        DPOObjective(beta=BETA, rpo_alpha=RPO_ALPHA, length_normalize=True),
        {"sigmoid_norm": 1.0, "sft": RPO_ALPHA},
        False,
    ),
}


def case_batch(objective: DPOObjective) -> Batch:
    """RPO's NLL forms agree only on equal chosen lengths (see the ragged test below)."""
    return EQUAL_CHOSEN if objective.rpo_alpha else RAGGED


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_loss_equals_trls(case):
    objective, trl_losses, trl_per_token = case
    batch = case_batch(objective)
    trl_loss, _ = trl_step(batch.per_token() if trl_per_token else batch, trl_losses)
    assert align_step(batch, objective)["loss"] == pytest.approx(trl_loss, **CLOSE)


def expected_metrics(batch: Batch, objective: DPOObjective) -> dict[str, float]:
    """TRL's metrics on summed log-probs, and, where align scores per-token means, TRL's
    metrics on per-token means under align's `_per_token` names."""
    expected = {name: trl_step(batch, {"sigmoid": 1.0})[1][name] for name in TRL_METRICS}
    if objective.scores_per_token:
        per_token = trl_step(batch.per_token(), {"sigmoid": 1.0})[1]
        expected |= {name + PER_TOKEN: per_token[name] for name in TRL_METRICS}
    return expected


def assert_logs_trls_metrics(batch: Batch, objective: DPOObjective) -> dict[str, float]:
    """align's logged metrics for `batch`: every one but the loss and RPO's NLL is TRL's."""
    logged = align_step(batch, objective)
    expected = expected_metrics(batch, objective)
    nll = {NLL_METRIC} if objective.rpo_alpha else set()
    assert logged.keys() == {"loss", *expected, *nll}
    for name, value in expected.items():
        assert logged[name] == pytest.approx(value, **CLOSE), name
    return logged


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_every_logged_metric_equals_trls(case):
    assert_logs_trls_metrics(case_batch(case[0]), case[0])


def test_the_batches_tell_sums_from_per_token_means_apart():
    """Else a metric on the wrong scale could pass the metric test above."""
    for batch in (RAGGED, EQUAL_CHOSEN):
        sums = trl_step(batch, {"sigmoid": 1.0})[1]
        means = trl_step(batch.per_token(), {"sigmoid": 1.0})[1]
        for name in TRL_METRICS:
            assert sums[name] != pytest.approx(means[name], rel=1e-3), name
        assert 0 < means["rewards/accuracies"] < 1


def token_weighted_chosen_nll(batch: Batch) -> float:
    """TRL's "sft" term: one mean over every chosen token of the micro-batch."""
    pairs = len(batch.counts) // 2
    chosen = torch.where(batch.scored, batch.token_logps, 0.0)[:pairs]
    return -float(chosen.sum() / batch.counts[:pairs].sum())


def sequence_mean_chosen_nll(batch: Batch) -> float:
    """The RPO paper's term: each chosen response's token-mean NLL, averaged over pairs."""
    pairs = len(batch.counts) // 2
    chosen = torch.where(batch.scored, batch.token_logps, 0.0)[:pairs]
    return -float((chosen.sum(1) / batch.counts[:pairs]).mean())


@pytest.mark.parametrize("batch", [EQUAL_CHOSEN, RAGGED], ids=["equal-chosen", "ragged"])
def test_rpo_differs_from_trls_sft_term_only_by_how_chosen_tokens_are_averaged(batch):
    objective = DPOObjective(beta=BETA, rpo_alpha=RPO_ALPHA)
    logged = align_step(batch, objective)
    trl_loss, _ = trl_step(batch, {"sigmoid": 1.0, "sft": RPO_ALPHA})
    trl_dpo_loss, _ = trl_step(batch, {"sigmoid": 1.0})
    seq_mean, token_mean = sequence_mean_chosen_nll(batch), token_weighted_chosen_nll(batch)

    assert logged[NLL_METRIC] == pytest.approx(seq_mean, **CLOSE)
    assert logged["loss"] - logged[NLL_METRIC] * RPO_ALPHA == pytest.approx(trl_dpo_loss, **CLOSE)
    assert logged["loss"] - trl_loss == pytest.approx(RPO_ALPHA * (seq_mean - token_mean), **CLOSE)
    chosen_lengths = batch.counts[: len(batch.counts) // 2]
    if bool((chosen_lengths == chosen_lengths[0]).all()):
        assert seq_mean == pytest.approx(token_mean, **CLOSE)
    else:
        assert abs(seq_mean - token_mean) > 1e-3


def rdpo_by_hand(batch: Batch, normalize: bool) -> float:
    """Park et al. 2024: -log sigmoid(beta log-ratio(yw) - beta log-ratio(yl)
    - (alpha |yw| - alpha |yl|)), pair-mean, in plain floats."""
    counts = batch.counts.tolist()
    policy = torch.where(batch.scored, batch.token_logps, 0.0).sum(1).tolist()
    ref = batch.ref.tolist()
    ratios = [
        (p - r) / (n if normalize else 1) for p, r, n in zip(policy, ref, counts, strict=True)
    ]
    pairs = len(counts) // 2
    losses = []
    for w in range(pairs):
        lose = w + pairs
        z = (
            BETA * ratios[w]
            - BETA * ratios[lose]
            - (RDPO_ALPHA * counts[w] - RDPO_ALPHA * counts[lose])
        )
        losses.append(math.log1p(math.exp(-z)))
    return sum(losses) / pairs


@pytest.mark.parametrize("normalize", [False, True], ids=["sums", "normalized"])
def test_rdpo_follows_its_paper_and_logs_trls_metrics(normalize):
    """R-DPO has no TRL loss; its length penalty must not leak into the logged rewards."""
    objective = DPOObjective(beta=BETA, rdpo_alpha=RDPO_ALPHA, length_normalize=normalize)
    logged = assert_logs_trls_metrics(RAGGED, objective)
    plain = align_step(RAGGED, DPOObjective(beta=BETA, length_normalize=normalize))

    assert logged["loss"] == pytest.approx(rdpo_by_hand(RAGGED, normalize), **CLOSE)
    assert logged["loss"] != pytest.approx(plain["loss"], rel=1e-3)
