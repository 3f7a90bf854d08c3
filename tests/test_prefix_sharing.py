"""The prefix-shared DPO layout: one row [prompt | chosen | rejected] per pair scores the
same tokens as the chosen-then-rejected rows, to float32 rounding, values and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_mistral_config

from align.config import BatchConfig
from align.constants import IGNORE_INDEX
from align.data.loader import (
    PairShard,
    SftShard,
    collate_preference,
    collate_shared_prompt,
)
from align.data.shards import PAIR_FORMAT, write_shard
from align.eval.logprobs import full_logits_sequence_logps, sequence_logps_and_counts
from align.exit_codes import ConfigError
from align.losses.dpo import DPOObjective, dpo_objective
from align.model.mistral import NmoMistralForCausalLM, build_segment_mask
from align.model.tiny import initialize_weights
from align.train.session import check_shard_layout

VOCAB = 61
TOLERANCE = 1e-5
# (prompt, chosen response, rejected response) token counts: ragged, with 1-token responses.
RAGGED = [(5, 7, 3), (2, 1, 9), (8, 4, 1), (1, 1, 1), (6, 10, 6)]
NO_PROMPT = [(0, 4, 3), (3, 2, 5)]
# Shared widths 26, 6, 7, 3, 9, 11: packed as [26], [11, 9, 6], [7, 3].
PACKABLE = [(12, 8, 6), (2, 3, 1), (4, 1, 2), (1, 1, 1), (3, 2, 4), (5, 3, 3)]


def pair_arrays(lengths: list[tuple[int, int, int]], seed: int = 0) -> dict[str, np.ndarray]:
    """A pair shard's arrays: chosen and rejected share their prompt tokens, pad id 0."""
    rng = np.random.default_rng(seed)
    width = max(p + max(c, r) for p, c, r in lengths)
    chosen = np.zeros((len(lengths), width), dtype=np.int32)
    rejected = np.zeros_like(chosen)
    for i, (p, c, r) in enumerate(lengths):
        prompt = rng.integers(3, VOCAB, p)
        chosen[i, : p + c] = np.concatenate([prompt, rng.integers(3, VOCAB, c)])
        rejected[i, : p + r] = np.concatenate([prompt, rng.integers(3, VOCAB, r)])
    prompt_len = np.array([p for p, _, _ in lengths], dtype=np.int32)
    return {
        "pair_id": np.arange(100, 100 + len(lengths), dtype=np.int64),
        "prompt_len": prompt_len,
        "chosen_len": prompt_len + np.array([c for _, c, _ in lengths], dtype=np.int32),
        "rejected_len": prompt_len + np.array([r for _, _, r in lengths], dtype=np.int32),
        "chosen_ids": chosen,
        "rejected_ids": rejected,
    }


def tiny_model(sliding_window: int | None, attn: str, seed: int = 0) -> NmoMistralForCausalLM:
    config = tiny_mistral_config(vocab_size=VOCAB, sliding_window=sliding_window)
    model = NmoMistralForCausalLM(config, attn_implementation=attn).float()
    with torch.no_grad():
        initialize_weights(model, torch.Generator().manual_seed(seed))
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_layout_positions_segments_and_labels():
    arrays = pair_arrays([(3, 2, 2), (1, 1, 3)])
    batch = collate_shared_prompt(arrays, np.arange(2))
    assert batch.input_ids.shape == (2, 7)
    c, r = arrays["chosen_ids"], arrays["rejected_ids"]
    assert batch.input_ids[0].tolist() == [*c[0, :5], *r[0, 3:5]]
    assert batch.input_ids[1, :5].tolist() == [*c[1, :2], *r[1, 1:4]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4], [0, 1, 1, 2, 3, 0, 0]]
    assert batch.segment_ids.tolist() == [[1, 1, 1, 2, 2, 3, 3], [1, 2, 3, 3, 3, 0, 0]]
    assert batch.attention_mask.tolist() == [[1] * 7, [1] * 5 + [0, 0]]
    ig = IGNORE_INDEX
    ids = batch.input_ids
    # chosen token t is predicted at P - 1 + t; rejected token 0 at P - 1, t >= 1 at P + Cc + t - 1.
    assert batch.labels[0, 0].tolist() == [ig, ig, ids[0, 3], ids[0, 4], ig, ig, ig]
    assert batch.labels[1, 0].tolist() == [ig, ig, ids[0, 5], ig, ig, ids[0, 6], ig]
    assert batch.labels[0, 1].tolist() == [ids[1, 1], ig, ig, ig, ig, ig, ig]
    assert batch.labels[1, 1].tolist() == [ids[1, 2], ig, ids[1, 3], ids[1, 4], ig, ig, ig]
    assert batch.num_loss_tokens == collate_preference(arrays, np.arange(2)).num_loss_tokens == 8


def test_segment_mask_keeps_rejected_blind_to_chosen_and_windows_by_position():
    segments = torch.tensor([[1, 1, 2, 2, 3, 3, 0]])
    positions = torch.tensor([[0, 1, 2, 3, 2, 3, 0]])
    mask = build_segment_mask(segments, positions, sliding_window=3)[0, 0]
    assert mask[5].tolist() == [False, True, False, False, True, True, False]  # pos 3 - 0 >= 3
    assert mask[4].tolist() == [True, True, False, False, True, False, False]
    assert mask[3].tolist() == [False, True, True, True, False, False, False]
    assert mask[6].tolist() == [False] * 6 + [True]  # padding sees only itself
    assert not build_segment_mask(segments, positions, None)[0, 0, 4:6, 2:4].any()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize(
    "lengths, pack",
    [(RAGGED, False), (NO_PROMPT, False), (PACKABLE, True), ([*NO_PROMPT, (0, 1, 2)], True)],
    ids=["ragged", "no_prompt", "packed", "packed_no_prompt"],
)
def test_shared_logps_and_dpo_gradients_match_the_unshared_rows(attn, lengths, pack):
    torch.manual_seed(0)
    arrays = pair_arrays(lengths, seed=1)
    rows = np.arange(len(lengths))[::-1]  # pairs come back in the order asked for
    shared = collate_shared_prompt(arrays, rows, pack=pack)
    plain = collate_preference(arrays, rows)
    if pack:
        assert shared.input_ids.shape[0] < len(rows)  # some row holds several pairs
    assert shared.input_ids.shape[1] > 6  # the window below is shorter than the sequence
    model = tiny_model(sliding_window=6, attn=attn)
    ref_chosen, ref_rejected = torch.randn(len(rows)) - 20, torch.randn(len(rows)) - 20
    objective = DPOObjective(beta=0.1)

    def logps_and_grads(batch):
        model.zero_grad(set_to_none=True)
        logps, counts = sequence_logps_and_counts(model, batch)
        dpo_objective(logps, counts, ref_chosen, ref_rejected, objective).losses.sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        return logps.detach(), counts, grads

    shared_logps, shared_counts, shared_grads = logps_and_grads(shared)
    plain_logps, plain_counts, plain_grads = logps_and_grads(plain)
    assert shared_counts.tolist() == plain_counts.tolist()
    assert shared_logps.shape == (2 * len(rows),)
    assert torch.allclose(shared_logps, plain_logps, rtol=TOLERANCE, atol=0.0)
    for name, grad in plain_grads.items():
        assert relative(shared_grads[name], grad) <= TOLERANCE, name
    with torch.no_grad():
        full = full_logits_sequence_logps(model, shared)
    assert torch.allclose(full, shared_logps, rtol=TOLERANCE, atol=0.0)


def test_pair_shard_collates_the_switched_layout(tmp_path):
    path = tmp_path / "pairs.safetensors"
    write_shard(path, pair_arrays(RAGGED), PAIR_FORMAT)
    shared, plain = PairShard(path, "shared"), PairShard(path)
    assert (shared.layout, plain.layout) == ("shared", "padded")
    assert shared.collate(np.arange(2)).segment_ids is not None
    assert plain.collate(np.arange(2)).segment_ids is None
    check_shard_layout(shared, BatchConfig(layout="shared"))
    check_shard_layout(plain, BatchConfig())
    with pytest.raises(ConfigError, match="opened with layout 'padded'"):
        check_shard_layout(plain, BatchConfig(layout="shared"))
    with pytest.raises(ConfigError, match="opened with layout 'shared'"):
        check_shard_layout(shared, BatchConfig())
    with pytest.raises(ConfigError, match="needs preference pairs; SftShard"):
        check_shard_layout(SftShard({}), BatchConfig(layout="packed"))
    with pytest.raises(ValueError, match="pair layout must be one of"):
        PairShard(path, "two_rows")


def test_refuses_pairs_whose_prompts_differ():
    arrays = pair_arrays(RAGGED)
    arrays["rejected_ids"][2, 1] += 1
    with pytest.raises(ValueError, match="pair_id 102 has different chosen and rejected prompt"):
        collate_shared_prompt(arrays, np.arange(5))


def test_triton_fa2_refuses_the_shared_layout_by_name():
    model = tiny_model(sliding_window=None, attn="sdpa")
    model.attn_implementation = "triton_fa2"  # the mask is chosen before any kernel runs
    batch = collate_shared_prompt(pair_arrays(RAGGED), np.arange(2))
    with pytest.raises(ValueError, match=r"'triton_fa2'.*shared and packed layouts"):
        sequence_logps_and_counts(model, batch)


def test_forward_refuses_half_a_layout_and_a_disagreeing_attention_mask():
    model = tiny_model(sliding_window=None, attn="sdpa")
    batch = collate_shared_prompt(pair_arrays(RAGGED), np.arange(2))
    with pytest.raises(ValueError, match="position_ids and segment_ids come together"):
        model(batch.input_ids, position_ids=batch.position_ids)
    with pytest.raises(ValueError, match="disagrees with segment_ids"):
        model(
            batch.input_ids,
            attention_mask=torch.ones_like(batch.input_ids),
            position_ids=batch.position_ids,
            segment_ids=batch.segment_ids,
        )
