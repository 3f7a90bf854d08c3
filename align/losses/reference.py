"""Full-logits label log-probs and objectives, the yardstick for the chunked fused path.

Materializes [B, T, V] logits in `dtype` (float64 by default) and lets autograd do the
rest; only tests and benchmarks use it.
"""

from __future__ import annotations

import torch

from align.constants import IGNORE_INDEX
from align.losses.dpo import DPOObjective, DPOResult, dpo_objective


def reference_token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """log softmax(hidden @ weight.T)[labels], shaped like labels; 0 where ignored."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    log_probs = torch.log_softmax(logits, dim=-1)
    scored = labels != IGNORE_INDEX
    picked = log_probs.gather(-1, labels.clamp_min(0)[..., None]).squeeze(-1)
    return torch.where(scored, picked, torch.zeros((), dtype=dtype, device=picked.device))


def reference_sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed label log-probs [B], scored token counts [B])."""
    token_logps = reference_token_logps(hidden, weight, labels, dtype)
    return token_logps.sum(-1), (labels != IGNORE_INDEX).sum(-1)


def reference_nll(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token-mean NLL over scored tokens, scored token count)."""
    logits = hidden.to(dtype) @ weight.to(dtype).T
    flat_logits = logits.reshape(-1, logits.shape[-1])
    nll = torch.nn.functional.cross_entropy(
        flat_logits, labels.reshape(-1), ignore_index=IGNORE_INDEX
    )
    return nll, (labels != IGNORE_INDEX).sum()


def reference_dpo(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    objective: DPOObjective,
    dtype: torch.dtype = torch.float64,
) -> DPOResult:
    """The DPO objective of hidden [2b, T, H] (chosen rows, then rejected rows)."""
    logps, counts = reference_sequence_logps(hidden, weight, labels, dtype)
    return dpo_objective(logps, counts, ref_chosen.to(dtype), ref_rejected.to(dtype), objective)
