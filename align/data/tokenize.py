"""Rendering and tokenization of pairs under the pre-registered truncation policy.

A pair is [bos] + prompt + response + [eos] for each response, the prompt shared.
Policy `prompt_left_response_right`: when too long, the prompt loses tokens from
the left (bos kept, at most down to half of seq_len), then each response is cut
from the right. Labels cover response tokens only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from align.data.formats import PreferenceRecord


def render_prompt(prompt: str) -> str:
    """Plain prompt/response join for checkpoints without a chat template."""
    return prompt.rstrip() + "\n"


@dataclass(frozen=True)
class TokenizedPair:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    truncated: bool


def truncate_pair(
    prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int
) -> tuple[list[int], list[int], list[int], bool]:
    """Apply `prompt_left_response_right` so prompt + each response fits in seq_len."""
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= seq_len:
        return prompt, chosen, rejected, False
    budget = min(len(prompt), max(seq_len - longest, seq_len // 2))
    prompt = prompt[:1] + prompt[len(prompt) - (budget - 1) :] if budget > 1 else prompt[:1]
    room = seq_len - len(prompt)
    return prompt, chosen[:room], rejected[:room], True


def tokenize_pairs(
    records: Sequence[PreferenceRecord], tokenizer, seq_len: int
) -> list[TokenizedPair]:
    """Tokenize a batch of records (one batched encode call per field)."""
    prompts = tokenizer.encode_batch([render_prompt(r.prompt) for r in records])
    chosens = tokenizer.encode_batch([r.chosen for r in records])
    rejecteds = tokenizer.encode_batch([r.rejected for r in records])
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    out = []
    for p, c, r in zip(prompts, chosens, rejecteds, strict=True):
        out.append(TokenizedPair(*truncate_pair([bos, *p], [*c, eos], [*r, eos], seq_len)))
    return out


def tokenize_sft(prompts: Sequence[str], responses: Sequence[str], tokenizer, seq_len: int):
    """SFT rows as (ids, prompt_len) with the response cut from the right to fit seq_len."""
    p_ids = tokenizer.encode_batch([render_prompt(p) for p in prompts])
    r_ids = tokenizer.encode_batch(list(responses))
    rows = []
    for p, r in zip(p_ids, r_ids, strict=True):
        prompt, response, _, _ = truncate_pair(
            [tokenizer.bos_id, *p], [*r, tokenizer.eos_id], [], seq_len
        )
        rows.append(([*prompt, *response], len(prompt)))
    return rows
