"""Greedy generation: the SFT gate's sanity check, the selection's length probe and the
DPO stage's periodic generation check, all decoded the same way (no KV cache: the
prompts are short and few).

`greedy_generate_batch` decodes several prompts together, right-padded, recomputing the
whole sequence each step. With a sharded model every forward is a collective, so
`keep_going` lets the ranks agree on when to stop and every rank runs the same number
of forwards; `generation_check` splits a prompt set over the ranks that way and sums
what each rank saw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def _padded(rows: Sequence[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
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
    idle = torch.tensor([[pad_id]], dtype=torch.long, device=device)
    for _ in range(max_new_tokens):
        active = [i for i, finished in enumerate(done) if not finished]
        if not keep_going(bool(active)):
            break
        if not active:
            model(idle)
            continue
        ids, mask = _padded([rows[i] for i in active], pad_id, device)
        logits = model(ids, attention_mask=mask)
        last = mask.sum(dim=1) - 1
        next_ids = logits[torch.arange(len(active), device=logits.device), last].argmax(-1)
        for i, token in zip(active, next_ids.tolist(), strict=True):
            if token == eos_id:
                done[i] = True
            else:
                new[i].append(token)
                rows[i].append(token)
    return [(tokens, finished) for tokens, finished in zip(new, done, strict=True)]


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
