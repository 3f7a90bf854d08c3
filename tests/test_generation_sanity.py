"""Generation sanity: batched greedy decoding, the periodic check on two sharded ranks, the
band a policy's generations must stay in, and the data's chosen responses read as generations."""

from __future__ import annotations

import queue as queue_module
import time

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from tiny_models import TINY_SIZES, tiny_mistral_config

from align.config import GenerationBandConfig
from align.eval.generation import greedy_generate_batch
from align.eval.sanity import GenerationBand, chosen_responses, judge

torch.set_num_threads(1)
PROMPTS = [[5, 9, 12], [7, 3], [11, 14, 6, 8], [20, 21, 22]]
PAD = 0
MAX_NEW = 6


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from align.model.tiny import make_tiny_model
    from align.model.tokenizer import train_bpe_tokenizer

    work = tmp_path_factory.mktemp("generation")
    texts = [f"{a} plus {b} is {a + b}." for a in range(10) for b in range(10)]
    train_bpe_tokenizer(texts, 300, work / "tok")
    make_tiny_model(work / "model", work / "tok", seed=4, **TINY_SIZES)
    return work / "model"


def plain_model(path):
    from align.model.checkpoint import load_pretrained

    return load_pretrained(path)


def eos_that_ends(model, prompt: list[int], step: int) -> int:
    """A token id that greedy decoding of `prompt` first emits at `step`, so it can play eos."""
    ((new, _),) = greedy_generate_batch(model, [prompt], step + 1, eos_id=-1, pad_id=PAD)
    assert new[step] not in new[:step], new
    return new[step]


def test_batched_decoding_equals_decoding_each_prompt_alone(tiny_checkpoint):
    model = plain_model(tiny_checkpoint)
    eos = eos_that_ends(model, PROMPTS[1], 2)
    together = greedy_generate_batch(model, PROMPTS, MAX_NEW, eos, PAD)
    alone = [greedy_generate_batch(model, [p], MAX_NEW, eos, PAD)[0] for p in PROMPTS]
    assert together == alone
    assert together[1][1] is True and len(together[1][0]) == 2


def recomputed(model, prompt: list[int], max_new: int) -> list[int]:
    """Greedy decoding of one prompt the plain way: the whole sequence, every step."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "attn, window", [("sdpa", None), ("eager", None), ("sdpa", 3), ("eager", 3)]
)
def test_cached_decoding_equals_recomputing_the_whole_sequence(attn, window):
    from align.model.mistral import NmoMistralForCausalLM

    torch.manual_seed(0)
    model = NmoMistralForCausalLM(tiny_mistral_config(sliding_window=window), attn).eval()
    cached = greedy_generate_batch(model, PROMPTS, 12, eos_id=-1, pad_id=PAD)
    assert [new for new, _ in cached] == [recomputed(model, p, 12) for p in PROMPTS]

    # The logits too, two steps past right-padded prompts of different lengths.
    from align.eval.generation import right_padded
    from align.model.kv_cache import KVCache

    cache, ids, mask = KVCache(8), *right_padded(PROMPTS, PAD, "cpu")
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache)
        model(torch.tensor([[30]] * len(PROMPTS)), cache=cache)
        step = model(torch.tensor([[31]] * len(PROMPTS)), cache=cache)[:, 0]
        alone = torch.stack([model(torch.tensor([[*p, 30, 31]]))[0, -1] for p in PROMPTS])
    torch.testing.assert_close(step, alone, rtol=0, atol=1e-5)


def test_decoding_runs_one_token_per_row_after_the_prefill(tiny_checkpoint):
    model = plain_model(tiny_checkpoint)
    widths = []
    model.register_forward_hook(lambda module, args, out: widths.append(args[0].shape))
    greedy_generate_batch(model, PROMPTS, 4, eos_id=-1, pad_id=PAD)
    assert widths == [(4, 4)] + [(4, 1)] * 3


def test_a_decoding_cache_is_refused_with_the_prefix_shared_layout(tiny_checkpoint):
    from align.model.kv_cache import KVCache

    model = plain_model(tiny_checkpoint)
    ids = torch.tensor([[5, 9, 12]])
    with pytest.raises(ValueError, match="plain right-padded rows, not segments"):
        model(
            ids,
            position_ids=torch.tensor([[0, 1, 2]]),
            segment_ids=torch.ones_like(ids),
            cache=KVCache(8),
        )


def test_decoding_stops_when_every_prompt_has_ended(tiny_checkpoint):
    model = plain_model(tiny_checkpoint)
    eos = eos_that_ends(model, PROMPTS[1], 0)
    forwards = []
    model.register_forward_hook(lambda *args: forwards.append(1))
    ((new, ended),) = greedy_generate_batch(model, [PROMPTS[1]], MAX_NEW, eos, PAD)
    assert (new, ended, len(forwards)) == ([], True, 1)


def _check_on_rank(rank, world, init, path, prompts, eos, out) -> None:
    import torch.distributed as dist

    from align.eval.generation import generation_check
    from align.train.fsdp import load_sharded
    from align.train.precision import Precision
    from align.utils.dist import DistInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    info = DistInfo(rank, rank, world, torch.device("cpu"), "gloo")
    model = load_sharded(path, info, Precision("float32"), "sdpa")
    check = generation_check(model, prompts, MAX_NEW, eos, PAD, info)
    out.put((rank, check.as_dict()))
    dist.destroy_process_group()


def sharded_checks(tmp_path, path, prompts, eos) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    args = (2, init, str(path), prompts, eos, queue)
    procs = [ctx.Process(target=_check_on_rank, args=(r, *args)) for r in range(2)]
    for p in procs:
        p.start()
    # A rank that ran fewer forwards than the other would hang the sharded model here.
    results, deadline = {}, time.monotonic() + 120
    while len(results) < len(procs):
        try:
            rank, check = queue.get(timeout=2)
            results[rank] = check
        except queue_module.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank exited with {dead} before reporting its check"
            assert time.monotonic() < deadline, f"only ranks {sorted(results)} reported"
    for p in procs:
        p.join(timeout=60)
    return results


def test_a_sharded_check_on_two_ranks_equals_one_process_and_agrees_on_every_rank(
    tiny_checkpoint, tmp_path
):
    model = plain_model(tiny_checkpoint)
    # Prompt 1, rank 1's only one, ends after two tokens; rank 1 then idles in step with
    # rank 0, whose prompts run to the cap.
    eos = eos_that_ends(model, PROMPTS[1], 2)
    generations = greedy_generate_batch(model, PROMPTS[:3], MAX_NEW, eos, PAD)
    ended = [done for _, done in generations]
    tokens = [len(new) for new, _ in generations]
    results = sharded_checks(tmp_path, tiny_checkpoint, PROMPTS[:3], eos)
    want = {
        "prompts": 3,
        "terminated_fraction": pytest.approx(sum(ended) / 3),
        "mean_tokens": pytest.approx(sum(tokens) / 3),
    }
    assert results == {0: want, 1: want}
    assert ended == [False, True, False]


def test_a_rank_without_prompts_keeps_the_sharded_forwards_in_step(tiny_checkpoint, tmp_path):
    results = sharded_checks(tmp_path, tiny_checkpoint, PROMPTS[:1], eos=-1)
    want = {"prompts": 1, "terminated_fraction": 0.0, "mean_tokens": float(MAX_NEW)}
    assert results == {0: want, 1: want}


# --- the band ------------------------------------------------------------------------------

SFT = {"terminated_fraction": 1.0, "mean_tokens": 18.0}
CHOSEN = {"terminated_fraction": 1.0, "mean_tokens": 16.0}


def test_the_band_is_relative_to_the_sft_policy_and_the_data_chosen_responses():
    band = GenerationBand.of(GenerationBandConfig(), SFT, CHOSEN)
    assert band.min_terminated == pytest.approx(0.75)
    assert (band.length_low, band.length_high) == (pytest.approx(8.0), pytest.approx(27.0))
    weaker_sft = GenerationBand.of(
        GenerationBandConfig(), {**SFT, "terminated_fraction": 0.8}, CHOSEN
    )
    assert weaker_sft.min_terminated == pytest.approx(0.75)
    strict = GenerationBandConfig(min_terminated_vs_sft=1.0, min_terminated_vs_chosen=0.5)
    assert GenerationBand.of(strict, SFT, CHOSEN).min_terminated == 1.0


def test_generations_that_stop_ending_or_run_long_are_outside_with_their_figures():
    band = GenerationBand.of(GenerationBandConfig(), SFT, CHOSEN)
    inside = judge(band, {"terminated_fraction": 0.875, "mean_tokens": 15.0})
    assert inside["inside"] and inside["reasons"] == []
    runaway = judge(band, {"terminated_fraction": 0.0, "mean_tokens": 48.0})
    assert not runaway["inside"]
    terminated, length = runaway["reasons"]
    assert terminated.startswith("terminated fraction 0.00 below the minimum 0.75")
    assert "mean generation length 48.0 tokens outside [8.0, 27.0]" in length
    assert "SFT 1.00 / 18.0 tokens, data chosen 1.00 / 16.0 tokens" in length
    too_short = judge(band, {"terminated_fraction": 1.0, "mean_tokens": 3.0})
    assert len(too_short["reasons"]) == 1 and "3.0 tokens outside" in too_short["reasons"][0]


def test_chosen_responses_count_eos_and_measure_length_without_it():
    eos = 2
    ids = np.array(
        [
            [7, 8, 30, 31, eos, 0],  # prompt 2, response 2 tokens + eos
            [7, 30, 31, 32, 33, 34],  # prompt 1, truncated: 5 tokens, no eos
        ],
        dtype=np.int32,
    )
    arrays = {
        "pair_id": np.array([1, 2]),
        "prompt_len": np.array([2, 1], dtype=np.int32),
        "chosen_len": np.array([5, 6], dtype=np.int32),
        "chosen_ids": ids,
    }
    assert chosen_responses(arrays, eos) == {"terminated_fraction": 0.5, "mean_tokens": 3.5}
