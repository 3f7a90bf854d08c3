"""Greedy generation for the SFT sanity check (tiny prompts, no KV cache needed)."""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_generate(
    model, prompt_ids: list[int], max_new_tokens: int, eos_id: int
) -> tuple[list[int], bool]:
    """(new tokens, terminated): decode greedily until eos or max_new_tokens."""
    model.eval()
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        next_id = int(model(ids)[0, -1].argmax())
        if next_id == eos_id:
            return new, True
        new.append(next_id)
        ids = torch.cat([ids, ids.new_tensor([[next_id]])], dim=1)
    return new, False
