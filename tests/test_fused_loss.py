"""The chunked fused lm_head objectives match full-logits float64 references, forward and backward."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from tiny_models import tiny_mistral_config

from align.config import DpoConfig
from align.data.loader import TokenBatch
from align.eval.logprobs import full_logits_sequence_logps as sequence_logps
from align.losses.dpo import DPOObjective, dpo_objective
from align.losses.fused import (
    IGNORE_INDEX,
    ChunkedLabelLogps,
    fused_dpo,
    fused_nll,
    fused_sequence_logps,
    fused_token_logps,
    shift_labels,
)
from align.losses.reference import reference_dpo, reference_nll, reference_sequence_logps
from align.model.mistral import NmoMistralForCausalLM

# These matrices are tiny: thread hand-offs would cost far more than the arithmetic.
torch.set_num_threads(1)

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2e-2}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, in float64."""
    expected = expected.detach().double()
    difference = (actual.detach().double() - expected).norm()
    return float(difference / expected.norm().clamp_min(1e-30))


@dataclasses.dataclass
class Case:
    rows: int
    length: int
    hidden: int
    vocab: int
    chunk: int
    ignored: float
    seed: int = 0


def make_inputs(case: Case, dtype: torch.dtype):
    """Hidden [rows, T, H], weight [V, H] (logits of unit scale) and ragged labels."""
    generator = torch.Generator().manual_seed(case.seed)
    hidden = torch.randn(case.rows, case.length, case.hidden, generator=generator)
    weight = torch.randn(case.vocab, case.hidden, generator=generator) / case.hidden**0.5
    labels = torch.randint(0, case.vocab, (case.rows, case.length), generator=generator)
    labels[torch.rand(case.rows, case.length, generator=generator) < case.ignored] = IGNORE_INDEX
    labels[:, 0] = torch.randint(0, case.vocab, (case.rows,), generator=generator)
    return hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_(), labels


def float64_leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().double().requires_grad_() for t in tensors]


def gradients(output: torch.Tensor, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(output, inputs))


CASES = {
    "ragged-uneven-chunks": Case(rows=4, length=13, hidden=32, vocab=101, chunk=5, ignored=0.3),
    "chunk-of-one": Case(rows=2, length=7, hidden=16, vocab=37, chunk=1, ignored=0.2, seed=1),
    "one-chunk": Case(rows=3, length=19, hidden=64, vocab=300, chunk=4096, ignored=0.5, seed=2),
    "mostly-ignored": Case(rows=6, length=11, hidden=24, vocab=257, chunk=7, ignored=0.8, seed=3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_sequence_logps_and_gradients_match_the_float64_reference(case, dtype):
    hidden, weight, labels = make_inputs(case, dtype)
    hidden64, weight64 = float64_leaves(hidden, weight)
    row_weights = torch.randn(case.rows, generator=torch.Generator().manual_seed(9))

    logps, counts = fused_sequence_logps(hidden, weight, labels, case.chunk)
    expected, expected_counts = reference_sequence_logps(hidden64, weight64, labels)

    assert logps.dtype == torch.float32
    assert torch.equal(counts, expected_counts)
    assert relative_error(logps, expected) <= TOLERANCE[dtype]
    grads = gradients((logps * row_weights).sum(), [hidden, weight])
    expected_grads = gradients((expected * row_weights.double()).sum(), [hidden64, weight64])
    for grad, expected_grad, source in zip(grads, expected_grads, (hidden, weight), strict=True):
        assert grad.dtype == source.dtype
        assert relative_error(grad, expected_grad) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_nll_and_gradients_match_the_float64_reference(dtype):
    hidden, weight, labels = make_inputs(CASES["ragged-uneven-chunks"], dtype)
    hidden64, weight64 = float64_leaves(hidden, weight)

    nll, count = fused_nll(hidden, weight, labels, chunk_size=6)
    expected, expected_count = reference_nll(hidden64, weight64, labels)

    assert int(count) == int(expected_count) == int((labels != IGNORE_INDEX).sum())
    assert relative_error(nll, expected) <= TOLERANCE[dtype]
    for grad, expected_grad in zip(
        gradients(nll, [hidden, weight]),
        gradients(expected, [hidden64, weight64]),
        strict=True,
    ):
        assert relative_error(grad, expected_grad) <= TOLERANCE[dtype]


def reference_logps_apart_from_policy(hidden, weight, labels):
    """Reference log-probs 10 to 20 nats from the policy's, in alternating directions.

    Rewards are differences of float32 sums; margins this wide keep their rounding at
    float32's relative precision instead of amplifying it.
    """
    pairs = hidden.shape[0] // 2
    with torch.no_grad():
        policy, _ = reference_sequence_logps(hidden, weight, labels)
    offsets = torch.linspace(10, 20, pairs, dtype=torch.float64)
    signs = torch.tensor([(-1.0) ** i for i in range(pairs)], dtype=torch.float64)
    return policy[:pairs] - signs * offsets, policy[pairs:] + signs * offsets.flip(0)


OBJECTIVES = {
    "sigmoid": DPOObjective(beta=0.1),
    "conservative": DPOObjective(beta=0.1, label_smoothing=0.2),
    "ipo": DPOObjective(beta=0.1, loss="ipo"),
    "hinge": DPOObjective(beta=0.1, loss="hinge"),
    "rpo": DPOObjective(beta=0.1, rpo_alpha=0.5),
    "length-normalized": DPOObjective(beta=0.1, length_normalize=True),
    "ipo-length-normalized": DPOObjective(beta=0.5, loss="ipo", length_normalize=True),
    "rdpo": DPOObjective(beta=0.1, rdpo_alpha=0.05),
}
DPO_CASE = Case(rows=6, length=17, hidden=32, vocab=211, chunk=10, ignored=0.35, seed=4)
RESULT_FIELDS = (
    "losses",
    "chosen_logps",
    "rejected_logps",
    "chosen_logps_per_token",
    "rejected_logps_per_token",
    "chosen_rewards",
    "rejected_rewards",
    "chosen_rewards_per_token",
    "rejected_rewards_per_token",
    "scored_margins",
)


def check_dpo_against_reference(objective: DPOObjective, dtype: torch.dtype) -> None:
    hidden, weight, labels = make_inputs(DPO_CASE, dtype)
    hidden64, weight64 = float64_leaves(hidden, weight)
    ref_chosen, ref_rejected = reference_logps_apart_from_policy(hidden64, weight64, labels)

    result = fused_dpo(
        hidden, weight, labels, ref_chosen.float(), ref_rejected.float(), objective, DPO_CASE.chunk
    )
    expected = reference_dpo(hidden64, weight64, labels, ref_chosen, ref_rejected, objective)

    tolerance = TOLERANCE[dtype]
    assert relative_error(result.loss, expected.loss) <= tolerance
    for field in RESULT_FIELDS:
        assert relative_error(getattr(result, field), getattr(expected, field)) <= tolerance, field
    assert torch.equal(result.chosen_tokens, expected.chosen_tokens)
    assert torch.equal(result.rejected_tokens, expected.rejected_tokens)
    assert (result.nll_chosen_seq_mean is None) == (objective.rpo_alpha == 0)
    if result.nll_chosen_seq_mean is not None:
        assert relative_error(result.nll_chosen_seq_mean, expected.nll_chosen_seq_mean) <= tolerance
    for grad, expected_grad in zip(
        gradients(result.loss, [hidden, weight]),
        gradients(expected.loss, [hidden64, weight64]),
        strict=True,
    ):
        assert relative_error(grad, expected_grad) <= tolerance


@pytest.mark.parametrize("objective", OBJECTIVES.values(), ids=OBJECTIVES.keys())
def test_every_dpo_variant_matches_the_reference_in_float32(objective):
    check_dpo_against_reference(objective, torch.float32)


@pytest.mark.parametrize("name", ["sigmoid", "rpo", "ipo-length-normalized"])
def test_dpo_variants_match_the_reference_in_bfloat16(name):
    check_dpo_against_reference(OBJECTIVES[name], torch.bfloat16)


def test_gradcheck_in_float64():
    case = Case(rows=4, length=5, hidden=6, vocab=11, chunk=3, ignored=0.3, seed=5)
    hidden, weight, labels = make_inputs(case, torch.float64)
    ref = torch.tensor([-12.0, -9.0], dtype=torch.float64)
    objective = DPOObjective(beta=0.3, rpo_alpha=0.2, rdpo_alpha=0.1)

    def sequence_sums(h, w):
        return fused_sequence_logps(h, w, labels, case.chunk)[0]

    def dpo_loss(h, w):
        return fused_dpo(h, w, labels, ref, ref - 1, objective, case.chunk).loss

    assert torch.autograd.gradcheck(sequence_sums, (hidden, weight))
    assert torch.autograd.gradcheck(dpo_loss, (hidden, weight))


def test_sigmoid_loss_is_exactly_log2_when_policy_equals_reference():
    hidden, weight, labels = make_inputs(DPO_CASE, torch.float32)
    with torch.no_grad():
        ref, _ = fused_sequence_logps(hidden, weight, labels, DPO_CASE.chunk)
    pairs = DPO_CASE.rows // 2

    result = fused_dpo(
        hidden, weight, labels, ref[:pairs], ref[pairs:], OBJECTIVES["sigmoid"], DPO_CASE.chunk
    )

    assert torch.equal(result.losses, torch.full((pairs,), math.log(2)))
    assert torch.equal(result.chosen_rewards, torch.zeros(pairs))
    assert torch.equal(result.margins, torch.zeros(pairs))


HELD_CASE = Case(rows=4, length=15, hidden=8, vocab=300, chunk=7, ignored=0.0)


def test_forward_saves_no_logits_and_holds_one_full_chunk_until_backward():
    hidden, weight, labels = make_inputs(HELD_CASE, torch.float32)
    saved = []

    def pack(tensor):
        saved.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps = ChunkedLabelLogps.apply(
            hidden.reshape(-1, HELD_CASE.hidden), weight, labels.reshape(-1), HELD_CASE.chunk
        )
    node = logps.grad_fn

    positions = HELD_CASE.rows * HELD_CASE.length
    assert positions % HELD_CASE.chunk != 0  # the short chunk runs first, the held one is full
    assert sum(saved) <= hidden.numel() + weight.numel() + 4 * positions
    assert node.last_exp.shape == (HELD_CASE.chunk, HELD_CASE.vocab)
    logps.sum().backward()
    assert node.last_exp is None


def test_held_chunk_and_its_recomputation_give_identical_gradients():
    hidden, weight, labels = make_inputs(HELD_CASE, torch.float32)
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(3))
    loss = (fused_token_logps(hidden, weight, labels, HELD_CASE.chunk) * upstream).sum()

    held = torch.autograd.grad(loss, [hidden, weight], retain_graph=True)
    recomputed = torch.autograd.grad(loss, [hidden, weight])

    for a, b in zip(held, recomputed, strict=True):
        assert torch.equal(a, b)


def test_frozen_weight_and_no_grad_calls():
    hidden, weight, labels = make_inputs(CASES["ragged-uneven-chunks"], torch.float32)
    frozen = weight.detach()
    logps, _ = fused_sequence_logps(hidden, frozen, labels, chunk_size=4)
    (grad_hidden,) = torch.autograd.grad(logps.sum(), [hidden])
    with torch.no_grad():
        no_grad_logps, _ = fused_sequence_logps(hidden, weight, labels, chunk_size=4)
    hidden64, weight64 = float64_leaves(hidden, weight)
    expected, _ = reference_sequence_logps(hidden64, weight64.detach(), labels)
    (expected_grad,) = torch.autograd.grad(expected.sum(), [hidden64])
    assert relative_error(grad_hidden, expected_grad) <= 1e-6
    assert torch.equal(no_grad_logps, logps.detach())
    assert not no_grad_logps.requires_grad


# --- the per-pair formulas ---------------------------------------------------------------

POLICY = torch.tensor([-10.0, -20.0, -14.0, -18.0], dtype=torch.float64)
COUNTS = torch.tensor([5, 10, 7, 8])
REF_CHOSEN = torch.tensor([-12.0, -19.0], dtype=torch.float64)
REF_REJECTED = torch.tensor([-13.0, -17.0], dtype=torch.float64)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def hand_margins(beta: float, normalize: bool = False) -> list[float]:
    """beta x (chosen - rejected log-ratio), pair by pair, in plain floats."""
    policy, counts = POLICY.tolist(), COUNTS.tolist()
    ref = REF_CHOSEN.tolist() + REF_REJECTED.tolist()
    scale = [1 / c for c in counts] if normalize else [1.0] * 4
    ratio = [(policy[i] - ref[i]) * scale[i] for i in range(4)]
    return [beta * (ratio[0] - ratio[2]), beta * (ratio[1] - ratio[3])]


def objective_losses(**fields) -> list[float]:
    objective = DPOObjective(**fields)
    return dpo_objective(POLICY, COUNTS, REF_CHOSEN, REF_REJECTED, objective).losses.tolist()


def test_each_variant_follows_its_formula():
    m = hand_margins(0.5)
    assert objective_losses(beta=0.5) == pytest.approx([softplus(-x) for x in m])
    assert objective_losses(beta=0.5, label_smoothing=0.2) == pytest.approx(
        [0.8 * softplus(-x) + 0.2 * softplus(x) for x in m]
    )
    ipo = [(x / 0.5 - 1 / (2 * 0.5)) ** 2 for x in hand_margins(0.5, normalize=True)]
    assert objective_losses(beta=0.5, loss="ipo") == pytest.approx(ipo)
    assert objective_losses(beta=0.5, loss="ipo", length_normalize=True) == pytest.approx(ipo)
    assert objective_losses(beta=0.5, loss="hinge") == pytest.approx([max(0.0, 1 - x) for x in m])
    length_gaps = [5 - 7, 10 - 8]
    assert objective_losses(beta=0.5, rdpo_alpha=0.1) == pytest.approx(
        [softplus(-(x - 0.1 * gap)) for x, gap in zip(m, length_gaps, strict=True)]
    )
    assert objective_losses(beta=0.5, length_normalize=True) == pytest.approx(
        [softplus(-x) for x in hand_margins(0.5, normalize=True)]
    )
    chosen_nll = [10.0 / 5, 20.0 / 10]
    assert objective_losses(beta=0.5, rpo_alpha=0.5) == pytest.approx(
        [softplus(-x) + 0.5 * n for x, n in zip(m, chosen_nll, strict=True)]
    )


def test_unknown_or_invalid_objectives_raise():
    with pytest.raises(
        ValueError, match=r"dpo\.loss expected one of \('sigmoid', 'ipo', 'hinge'\)"
    ):
        DPOObjective(beta=0.1, loss="kto")
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOObjective(beta=0.1, loss="ipo", label_smoothing=0.1)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOObjective(beta=0.1, label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta"):
        DPOObjective(beta=0.0)
    with pytest.raises(ValueError, match="rpo_alpha"):
        DPOObjective(beta=0.1, rpo_alpha=-1.0)


def test_the_objective_is_built_from_its_config_section_field_for_field():
    section = DpoConfig(beta=0.3, loss="ipo", rpo_alpha=0.2, length_normalize=True, rdpo_alpha=0.1)
    assert dataclasses.asdict(DPOObjective.of(section)) == dataclasses.asdict(section)


def test_bad_inputs_raise():
    hidden, weight, labels = make_inputs(CASES["chunk-of-one"], torch.float32)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_sequence_logps(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="labels must lie"):
        fused_sequence_logps(hidden, weight, labels.masked_fill(labels == labels[0, 0], 37))
    with pytest.raises(ValueError, match="hidden"):
        fused_sequence_logps(hidden[:, 1:], weight, labels)
    with pytest.raises(ValueError, match="no scored tokens"):
        fused_nll(hidden, weight, torch.full_like(labels, IGNORE_INDEX))
    empty_rejected = labels.clone()
    empty_rejected[1] = IGNORE_INDEX
    ref = torch.zeros(1)
    objective = DPOObjective(beta=0.1, length_normalize=True)
    with pytest.raises(ValueError, match="no scored tokens"):
        fused_dpo(hidden, weight, empty_rejected, ref, ref, objective)


# --- against the model's full-logits path -----------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_shift_labels_and_fused_equal_full_logits_sequence_logps(tied):
    config = tiny_mistral_config(vocab_size=97, tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = NmoMistralForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(1)
    lengths = torch.tensor([20, 14, 9, 17])
    prompt = torch.tensor([4, 6, 2, 9])
    positions = torch.arange(20)[None, :]
    attention = positions < lengths[:, None]
    batch = TokenBatch(
        input_ids=torch.randint(1, 97, (4, 20), generator=generator) * attention,
        attention_mask=attention.long(),
        loss_mask=(positions >= prompt[:, None]) & attention,
        rows=np.arange(4),
    )

    with torch.no_grad():
        expected = sequence_logps(model, batch)
        hidden = model(batch.input_ids, batch.attention_mask, return_hidden=True)
        labels = shift_labels(batch.input_ids, batch.loss_mask)
        logps, counts = fused_sequence_logps(hidden, model.lm_head.weight, labels, chunk_size=7)

    assert torch.allclose(logps, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(counts, batch.loss_mask[:, 1:].sum(-1))
