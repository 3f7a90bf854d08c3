"""Per-row summed log-probabilities of the scored tokens.

`sequence_logps` is the one path stages use: chunked from hidden states inside the
model's forward, so [B, T, V] logits never exist. `full_logits_sequence_logps` is the
straightforward reference that tests compare it with. Logits at position t predict
token t + 1; a token is scored when its loss_mask is set. A shared or packed batch
(align.data.loader.collate_shared_prompt) brings its own label sets and layout.
"""

from __future__ import annotations

import torch

from align.constants import IGNORE_INDEX
from align.data.loader import TokenBatch
from align.kernels.segments import pair_slot
from align.losses.fused import shift_labels


def _mask_args(batch: TokenBatch) -> dict[str, torch.Tensor]:
    """The forward's mask arguments for the batch's layout. A prefix-shared batch passes
    only its segment and position ids: they define which tokens are real, and an
    attention_mask beside them would make the model compare the two on every forward."""
    if batch.segment_ids is None:
        return {"attention_mask": batch.attention_mask}
    return {"position_ids": batch.position_ids, "segment_ids": batch.segment_ids}


def sequence_logps_and_counts(
    model: torch.nn.Module, batch: TokenBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-prob float32, scored token count) per sequence through the chunked path:
    [B] for plain rows, [2b] (chosen then rejected, in `batch.rows` order) for a shared or
    packed batch of b pairs, on the model's device (the batch is moved there)."""
    batch = batch.to(model.device)
    labels = batch.labels
    if labels is None:
        labels = shift_labels(batch.input_ids, batch.loss_mask)
    logps, counts = model(batch.input_ids, labels=labels, **_mask_args(batch))
    return by_pair(batch, logps.float()), by_pair(batch, counts)


def by_pair(batch: TokenBatch, per_slot: torch.Tensor) -> torch.Tensor:
    """A shared or packed batch's per-(set, row, slot) results as [2b]: each pair of
    `batch.rows` in order, chosen then rejected. Plain rows' results pass through."""
    if batch.pair_slots is None:
        return per_slot
    sets = per_slot.view(len(batch.labels), -1)
    return sets[:, batch.pair_slots.to(per_slot.device)].flatten()


def sequence_logps(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    return sequence_logps_and_counts(model, batch)[0]


def full_logits_sequence_logps(model: torch.nn.Module, batch: TokenBatch) -> torch.Tensor:
    """The reference: log_softmax over full logits, gathered at the labels."""
    logits = model(batch.input_ids, **_mask_args(batch))
    if batch.labels is not None:
        logp = torch.log_softmax(logits.float(), dim=-1).expand(len(batch.labels), -1, -1, -1)
        scored = batch.labels != IGNORE_INDEX
        token = torch.where(
            scored, logp.gather(-1, batch.labels.clamp(min=0)[..., None])[..., 0], 0.0
        )
        # Each pair's tokens summed on their own: slot s of row r holds pair (r, s).
        pairs = pair_slot(batch.segment_ids)
        slots = int(pairs.max()) + 1
        sums = torch.stack([torch.where(pairs == s, token, 0.0).sum(-1) for s in range(slots)], -1)
        return by_pair(batch, sums.flatten())
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    token = logp.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return (token * batch.loss_mask[:, 1:]).sum(-1)
