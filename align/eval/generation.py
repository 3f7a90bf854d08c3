"""Greedy generation: the SFT gate's sanity check, the selection's length probe and the
DPO stage's periodic generation check, all decoded the same way.

`greedy_generate_batch` decodes several prompts together, right-padded: one prefill
forward, then one token per row per step through a key/value cache. A model on the
Triton kernel, which attends only over key lengths, recomputes the whole sequence each
step instead, so that the kernel its receipt names is the one that decodes. With a
sharded model every forward is a collective, so
`keep_going` lets the ranks agree on when to stop and every rank runs the same number
of forwards; `generation_check` splits a prompt set over the ranks that way and sums
what each rank saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from align.model.attention import MASKED_DECODING
from align.model.kv_cache import KVCache


def right_padded(
    rows: Sequence[list[int]], pad_id: int, device
) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[i, : len(row)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def greedy_generate_batch(
    model,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    device: torch.device | str = "cpu",
    keep_going: Callable[[bool], bool] = bool,
) -> list[tuple[list[int], bool]]:
    """(new tokens, terminated) per prompt, decoded greedily together until eos or the cap.

    `keep_going(this rank still decoding)` decides whether another step runs; on a sharded
    model it must agree across ranks (align.utils.dist.any_rank), and a rank without
    prompts (or done early) then runs a one-token forward to keep the collectives in step.
    """
    model.eval()
    rows = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    cache = None
    if rows and model.attn_implementation in MASKED_DECODING:
        cache = KVCache(max(map(len, rows)) + max_new_tokens)
    idle = torch.tensor([[pad_id]], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        active = [i for i, finished in enumerate(done) if not finished]
        if not keep_going(bool(active)):
            break
        if not active:
            model(idle)
            continue
        picks = _next_tokens(model, rows, active, cache, pad_id, device)
        for i, token in zip(active, picks, strict=True):
            if token == eos_id:
                done[i] = True
            else:
                new[i].append(token)
                rows[i].append(token)
    return [(tokens, finished) for tokens, finished in zip(new, done, strict=True)]


def _next_tokens(
    model, rows: list[list[int]], active: list[int], cache: KVCache | None, pad_id: int, device
) -> list[int]:
    """The greedy next token of each active row. With a cache every row keeps its slot
    (an ended row's tokens are decoded and dropped); without, only active rows run."""
    if cache is None or not cache.prefilled:
        running = [rows[i] for i in active] if cache is None else rows
        ids, mask = right_padded(running, pad_id, device)
        logits = model(ids, attention_mask=mask, cache=cache)
        picks = logits[torch.arange(len(running), device=logits.device), mask.sum(dim=1) - 1]
    else:
        last = torch.tensor([[row[-1]] for row in rows], dtype=torch.long, device=device)
        picks = model(last, cache=cache)[:, 0]
    tokens = picks.argmax(-1).tolist()
    return tokens if cache is None else [tokens[i] for i in active]


@dataclass(frozen=True)
class GenerationCheck:
    """Greedy generations on a prompt set: how many ended and how long they ran."""

    prompts: int
    terminated_fraction: float
    mean_tokens: float

    def as_dict(self) -> dict[str, float]:
        return {
            "prompts": self.prompts,
            "terminated_fraction": self.terminated_fraction,
            "mean_tokens": self.mean_tokens,
        }


def generation_check(
    model,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    info,
) -> GenerationCheck:
    """Every rank decodes its share of `prompts` (round-robin); the figures are job-wide.

    Run on every rank together: each forward of a sharded model is a collective.
    """
    from align.utils.dist import all_reduce_sum, any_rank

    mine = list(prompts[info.rank :: info.world_size])
    generations = greedy_generate_batch(
        model, mine, max_new_tokens, eos_id, pad_id, info.device, keep_going=any_rank
    )
    ended = sum(done for _, done in generations)
    tokens = sum(len(new) for new, _ in generations)
    total, ended, tokens = all_reduce_sum([len(mine), ended, tokens])
    return GenerationCheck(int(total), ended / total, tokens / total)


def generation_prompts(arrays: dict, count: int) -> list[list[int]]:
    """The first `count` distinct prompts of a pair shard's arrays, in row order."""
    prompts: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for row in range(len(arrays["pair_id"])):
        prompt = arrays["chosen_ids"][row, : arrays["prompt_len"][row]].tolist()
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            prompts.append(prompt)
        if len(prompts) == count:
            break
    return prompts
