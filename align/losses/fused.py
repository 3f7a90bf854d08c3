"""Label log-probs through the lm_head without materializing [B, T, V] logits.

`ChunkedLabelLogps` projects hidden states onto the vocabulary a chunk of scored
positions at a time, keeping only each position's log-normalizer; backward recomputes
one chunk's logits at a time. Peak extra memory is O(chunk_size x V) whatever T is.
Arithmetic runs in float32 (float64 for float64 inputs); gradients come back in the
inputs' dtypes. The DPO, SFT and sequence-log-prob entry points build on it.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from align.losses.dpo import DPOObjective, DPOResult, dpo_objective

IGNORE_INDEX = -100
DEFAULT_CHUNK_SIZE = 1024


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _chunk_logits(
    hidden: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor, buffer: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden rows at `positions` in compute dtype, their logits written into `buffer`)."""
    rows = hidden.index_select(0, positions).to(weight.dtype)
    logits = buffer[: positions.shape[0]]
    torch.mm(rows, weight.T, out=logits)
    return rows, logits


def _check_targets(targets: torch.Tensor, vocab_size: int) -> None:
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        raise ValueError(
            f"labels must lie in [0, {vocab_size}) or equal {IGNORE_INDEX}, got values in "
            f"[{int(targets.min())}, {int(targets.max())}]"
        )


class ChunkedLabelLogps(torch.autograd.Function):
    """hidden [M, H], weight [V, H], labels [M] -> log p(label) [M], 0 where ignored."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size):
        positions = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        targets = labels.index_select(0, positions).long()
        _check_targets(targets, weight.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):
            token_logps, log_norms = _forward_chunks(hidden, weight, positions, targets, chunk_size)
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(hidden, weight, positions, targets, log_norms)
        return token_logps

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_token_logps):
        hidden, weight, positions, targets, log_norms = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        with torch.autocast(hidden.device.type, enabled=False):
            grad_hidden, grad_weight = _backward_chunks(
                hidden,
                weight,
                positions,
                targets,
                log_norms,
                grad_token_logps,
                ctx.chunk_size,
                need_hidden,
                need_weight,
            )
        return grad_hidden, grad_weight, None, None


def _forward_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target) at every row of hidden, log-normalizer at each scored position)."""
    compute = _compute_dtype(hidden, weight)
    weight_c = weight.to(compute)
    token_logps = torch.zeros(hidden.shape[0], dtype=compute, device=hidden.device)
    log_norms = torch.empty(positions.shape[0], dtype=compute, device=hidden.device)
    buffer = _logits_buffer(positions, weight, chunk_size, compute)
    for chunk in _chunks(positions, chunk_size):
        _, logits = _chunk_logits(hidden, weight_c, positions[chunk], buffer)
        label_logits = logits.gather(1, targets[chunk, None]).squeeze(1)
        log_norms[chunk] = _logsumexp_destroying(logits)
        token_logps[positions[chunk]] = label_logits - log_norms[chunk]
    return token_logps, log_norms


def _backward_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    log_norms: torch.Tensor,
    grad_token_logps: torch.Tensor,
    chunk_size: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of sum(grad_token_logps x token log-probs) w.r.t. hidden and weight."""
    compute = log_norms.dtype
    weight_c = weight.to(compute)
    grad_scale = grad_token_logps.index_select(0, positions).to(compute)
    grad_hidden = torch.zeros_like(hidden) if need_hidden else None
    grad_weight = torch.zeros_like(weight_c) if need_weight else None
    buffer = _logits_buffer(positions, weight, chunk_size, compute)
    for chunk in _chunks(positions, chunk_size):
        rows, logits = _chunk_logits(hidden, weight_c, positions[chunk], buffer)
        grad_logits = _label_logp_grad_(logits, log_norms[chunk], targets[chunk], grad_scale[chunk])
        if need_hidden:
            grad_rows = (grad_logits @ weight_c).to(hidden.dtype)
            grad_hidden.index_copy_(0, positions[chunk], grad_rows)
        if need_weight:
            grad_weight.addmm_(grad_logits.T, rows)
    if need_weight:
        grad_weight = grad_weight.to(weight.dtype)
    return grad_hidden, grad_weight


def _chunks(positions: torch.Tensor, chunk_size: int) -> list[slice]:
    return [slice(s, s + chunk_size) for s in range(0, positions.shape[0], chunk_size)]


def _logits_buffer(
    positions: torch.Tensor, weight: torch.Tensor, chunk_size: int, dtype: torch.dtype
) -> torch.Tensor:
    # One buffer for every chunk: allocators that return large blocks to the OS would
    # otherwise fault in fresh pages per chunk.
    rows = min(chunk_size, positions.shape[0])
    return torch.empty(rows, weight.shape[0], dtype=dtype, device=weight.device)


def _logsumexp_destroying(logits: torch.Tensor) -> torch.Tensor:
    """Row logsumexp, overwriting `logits` so that no second [chunk, V] tensor exists."""
    row_max = logits.amax(1, keepdim=True)
    return logits.sub_(row_max).exp_().sum(1).log_().add_(row_max.squeeze(1))


def _label_logp_grad_(
    logits: torch.Tensor, log_norms: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """scale x d log softmax(logits)[target] / d logits = scale x (onehot - softmax), in place."""
    probs = logits.sub_(log_norms[:, None]).exp_()
    probs.mul_(-scale[:, None])
    return probs.scatter_add_(1, targets[:, None], scale[:, None])


def _check_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
):
    if hidden.shape[:-1] != labels.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be labels {tuple(labels.shape)} plus a hidden dim"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}], got {tuple(weight.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if not (isinstance(chunk_size, int) and chunk_size > 0):
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")


def fused_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """log p(labels) under logits hidden @ weight.T, shaped like labels; 0 where ignored."""
    _check_inputs(hidden, weight, labels, chunk_size)
    flat = ChunkedLabelLogps.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), chunk_size
    )
    return flat.view(labels.shape)


def fused_sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed label log-probs [B], scored token counts [B]) from hidden [B, T, H].

    `labels[:, t]` is the token predicted at position t (see `shift_labels`).
    """
    token_logps = fused_token_logps(hidden, weight, labels, chunk_size)
    return token_logps.sum(-1), (labels != IGNORE_INDEX).sum(-1)


def fused_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean NLL over all scored tokens, scored token count), for SFT."""
    token_logps = fused_token_logps(hidden, weight, labels, chunk_size)
    count = (labels != IGNORE_INDEX).sum()
    if int(count) == 0:
        raise ValueError("no scored tokens: every label is the ignore index")
    return -token_logps.sum() / count, count


def fused_dpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    objective: DPOObjective,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> DPOResult:
    """The DPO objective from hidden [2b, T, H]: chosen rows first, then their rejected rows.

    `ref_chosen` / `ref_rejected` [b] are the reference model's summed log-probs over the
    same scored tokens.
    """
    if hidden.shape[0] != 2 * ref_chosen.shape[0] or ref_chosen.shape != ref_rejected.shape:
        raise ValueError(
            f"hidden has {hidden.shape[0]} rows; expected 2 x {ref_chosen.shape[0]} pairs "
            f"(reference log-probs {tuple(ref_chosen.shape)} and {tuple(ref_rejected.shape)})"
        )
    logps, counts = fused_sequence_logps(hidden, weight, labels, chunk_size)
    return dpo_objective(logps, counts, ref_chosen, ref_rejected, objective)


def shift_labels(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """labels[:, t] = input_ids[:, t + 1] where that token is scored, else ignore_index."""
    if input_ids.dim() != 2 or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and loss_mask must both be [B, T], got {tuple(input_ids.shape)} "
            f"and {tuple(loss_mask.shape)}"
        )
    labels = torch.full_like(input_ids, ignore_index)
    labels[:, :-1] = input_ids[:, 1:].masked_fill(~loss_mask[:, 1:].bool(), ignore_index)
    return labels
