"""Path bias: the step-0 mismatch between the training forward path and the reference cache.

At step 0 the policy is the reference, so every implicit reward margin
(pi_c - ref_c) - (pi_r - ref_r) should be 0; what is measured through the training
path (its backend, dtype, micro-batch padding, sharding) is the path's bias. Its mean
absolute value over the pre-registered tolerance decides whether the cache is
accepted or rebuilt with the training path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

ACCEPT = "accept"
RECOMPUTE = "recompute"


def sample_rows(n: int, sample_pairs: int, seed: int) -> np.ndarray:
    """The pre-registered sample of pairs, sorted so batches follow shard order."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=min(n, sample_pairs), replace=False))


def margin_errors(
    policy_chosen: np.ndarray,
    policy_rejected: np.ndarray,
    ref_chosen: np.ndarray,
    ref_rejected: np.ndarray,
) -> np.ndarray:
    """Per-pair step-0 implicit reward margin (nats): zero when the paths agree exactly."""
    import numpy as np

    return (policy_chosen.astype(np.float64) - ref_chosen) - (
        policy_rejected.astype(np.float64) - ref_rejected
    )


def path_bias_figures(
    errors: np.ndarray, tolerance: float, cache_impl: str, training_impl: str
) -> dict[str, Any]:
    import numpy as np

    abs_err = np.abs(errors)
    mean_abs = float(abs_err.mean())
    ratio = mean_abs / tolerance
    return {
        "n": len(errors),
        "mean_abs": mean_abs,
        "p99_abs": float(np.quantile(abs_err, 0.99)),
        "max_abs": float(abs_err.max()),
        "tolerance": tolerance,
        "ratio": ratio,
        "cache_forward_impl": cache_impl,
        "training_forward_impl": training_impl,
        "action": ACCEPT if ratio <= 1.0 else RECOMPUTE,
    }


def required_forward_impl(report: dict[str, Any]) -> str:
    """The forward_impl whose cache the DPO stage must train on, per the report."""
    figures = report["figures"]
    return (
        figures["cache_forward_impl"]
        if figures["action"] == ACCEPT
        else figures["training_forward_impl"]
    )


def table(figures: dict[str, Any]) -> str:
    rows = [
        ("cache path", figures["cache_forward_impl"]),
        ("training path", figures["training_forward_impl"]),
        ("pairs", figures["n"]),
        ("mean |margin|", f"{figures['mean_abs']:.3e}"),
        ("p99 |margin|", f"{figures['p99_abs']:.3e}"),
        ("max |margin|", f"{figures['max_abs']:.3e}"),
        ("tolerance", f"{figures['tolerance']:.3e}"),
        ("ratio", f"{figures['ratio']:.3f}"),
        ("action", figures["action"]),
    ]
    return "\n".join(f"  {name:<14} {value}" for name, value in rows)
