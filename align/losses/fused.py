"""Label log-probs through the lm_head without materializing [B, T, V] logits.

`ChunkedLabelLogps` projects hidden states onto the vocabulary a chunk of scored
positions at a time, keeping each position's softmax normalizer and, while a graph
holds it, the last chunk's exponentiated logits. Backward consumes that chunk first
and recomputes the others' logits one chunk at a time: forward+backward costs four
[chunk, H] x [H, V] matmuls per chunk (logits, their recomputation, d hidden,
d weight) and three for the held one, against three for full logits, while peak extra
memory stays O(chunk_size x V) whatever T is. Arithmetic runs in float32 (float64 for
float64 inputs); gradients come back in the inputs' dtypes. The DPO, SFT and
sequence-log-prob entry points build on it.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from align.constants import IGNORE_INDEX
from align.losses.dpo import DPOObjective, DPOResult, dpo_objective

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
    """hidden [M, H], weight [V, H], labels [M] -> log p(label) [M], 0 where ignored.

    Forward saves each scored position's row max and sum of exp(logits - row max),
    and holds the last chunk's exp(logits - row max), which the first backward consumes
    in place instead of recomputing that chunk's logits. That tensor lives on ctx rather
    than in save_for_backward so that backward can drop it once consumed; a retained
    graph's next backward recomputes it, bit for bit. Without a graph (no_grad, or no
    input needing grad) ctx, and the held chunk with it, is dropped when forward returns.
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk_size):
        positions = (labels != IGNORE_INDEX).nonzero().squeeze(1)
        targets = labels.index_select(0, positions).long()
        _check_targets(targets, weight.shape[0])
        with torch.autocast(hidden.device.type, enabled=False):
            token_logps, row_max, exp_sums, ctx.last_exp = _forward_chunks(
                hidden, weight, positions, targets, chunk_size
            )
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(hidden, weight, positions, targets, row_max, exp_sums)
        return token_logps

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_token_logps):
        hidden, weight, positions, targets, row_max, exp_sums = ctx.saved_tensors
        last_exp, ctx.last_exp = ctx.last_exp, None
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        with torch.autocast(hidden.device.type, enabled=False):
            grad_hidden, grad_weight = _backward_chunks(
                hidden,
                weight,
                positions,
                targets,
                (row_max, exp_sums, last_exp),
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log p(target) at every row of hidden; row max and sum of exp(logits - row max)
    at each scored position; the last chunk's exp(logits - row max), None if no chunk)."""
    compute = _compute_dtype(hidden, weight)
    weight_c = weight.to(compute)
    token_logps = torch.zeros(hidden.shape[0], dtype=compute, device=hidden.device)
    row_max = torch.empty(positions.shape[0], dtype=compute, device=hidden.device)
    exp_sums = torch.empty_like(row_max)
    chunks = _chunks(positions.shape[0], chunk_size)
    buffer = _logits_buffer(chunks, weight, compute)
    for chunk in chunks:
        _, logits = _chunk_logits(hidden, weight_c, positions[chunk], buffer)
        label_logits = logits.gather(1, targets[chunk, None]).squeeze(1)
        row_max[chunk] = logits.amax(1)
        exp_sums[chunk] = _exp_shifted_(logits, row_max[chunk]).sum(1)
        token_logps[positions[chunk]] = label_logits - row_max[chunk] - exp_sums[chunk].log()
    last_exp = logits if chunks else None
    return token_logps, row_max, exp_sums, last_exp


def _backward_chunks(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    normalizers: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    grad_token_logps: torch.Tensor,
    chunk_size: int,
    need_hidden: bool,
    need_weight: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Gradients of sum(grad_token_logps x token log-probs) w.r.t. hidden and weight.

    `normalizers` are forward's row max, exp sums and held last chunk. Chunks run last
    to first, so the held chunk comes first and its buffer then takes the others' logits.
    """
    row_max, exp_sums, last_exp = normalizers
    compute = row_max.dtype
    weight_c = weight.to(compute)
    grad_scale = grad_token_logps.index_select(0, positions).to(compute)
    grad_hidden = torch.zeros_like(hidden) if need_hidden else None
    grad_weight = None
    chunks = _chunks(positions.shape[0], chunk_size)
    buffer = last_exp if last_exp is not None else _logits_buffer(chunks, weight, compute)
    for index, chunk in enumerate(reversed(chunks)):
        if index == 0 and last_exp is not None:
            rows, shifted_exp = hidden.index_select(0, positions[chunk]).to(compute), last_exp
        else:
            rows, logits = _chunk_logits(hidden, weight_c, positions[chunk], buffer)
            shifted_exp = _exp_shifted_(logits, row_max[chunk])
        grad_logits = _label_logp_grad_(
            shifted_exp, exp_sums[chunk], targets[chunk], grad_scale[chunk]
        )
        if need_hidden:
            grad_rows = (grad_logits @ weight_c).to(hidden.dtype)
            grad_hidden.index_copy_(0, positions[chunk], grad_rows)
        if need_weight:
            grad_weight = _add_outer_(grad_weight, grad_logits, rows)
    if not need_weight:
        return grad_hidden, None
    if grad_weight is None:  # no scored position
        return grad_hidden, torch.zeros_like(weight)
    return grad_hidden, grad_weight.to(weight.dtype)


def _chunks(count: int, chunk_size: int) -> list[slice]:
    """Slices over `count` positions, the short remainder first so that the last is full."""
    if not count:
        return []
    first = count % chunk_size or chunk_size
    return [slice(0, first)] + [slice(s, s + chunk_size) for s in range(first, count, chunk_size)]


def _logits_buffer(chunks: list[slice], weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # One buffer for every chunk: allocators that return large blocks to the OS would
    # otherwise fault in fresh pages per chunk.
    rows = max((chunk.stop - chunk.start for chunk in chunks), default=0)
    return torch.empty(rows, weight.shape[0], dtype=dtype, device=weight.device)


def _exp_shifted_(logits: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
    """exp(logits - row max), in place: forward and recompute share it, so they agree bitwise."""
    return logits.sub_(row_max[:, None]).exp_()


def _label_logp_grad_(
    shifted_exp: torch.Tensor, exp_sums: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """scale x d log softmax[target] / d logits = scale x (onehot - shifted_exp / exp_sums).

    In place; the softmax division folds into the one multiply over [chunk, V].
    """
    shifted_exp.mul_((-scale / exp_sums)[:, None])
    return shifted_exp.scatter_add_(1, targets[:, None], scale[:, None])


def _add_outer_(
    total: torch.Tensor | None, grad_logits: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """total + grad_logits.T @ rows; the first chunk writes a fresh [V, H] (no zero fill)."""
    if total is None:
        return torch.mm(grad_logits.T, rows)
    return total.addmm_(grad_logits.T, rows)


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
    slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed label log-probs [B], scored token counts [B]) from hidden [B, T, H]; with
    `slots` [B, T] (each position's sequence within its row, 0 <= slot < S) the sums of
    each row's sequences apart, [B * S] (row r's slot s at r * S + s).

    `labels[:, t]` is the token predicted at position t (see `shift_labels`).
    """
    token_logps = fused_token_logps(hidden, weight, labels, chunk_size)
    scored = labels != IGNORE_INDEX
    if slots is None:
        return token_logps.sum(-1), scored.sum(-1)
    if slots.shape != labels.shape:
        raise ValueError(
            f"slots {tuple(slots.shape)} must be shaped like labels {tuple(labels.shape)}"
        )
    width = int(slots.max()) + 1
    sums = token_logps.new_zeros(labels.shape[0], width).scatter_add(1, slots, token_logps)
    counts = scored.new_zeros(labels.shape[0], width, dtype=torch.long)
    counts.scatter_add_(1, slots, scored.long())
    return sums.flatten(), counts.flatten()


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
