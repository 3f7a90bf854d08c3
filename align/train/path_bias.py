"""Path bias: the step-0 mismatch between the training forward path and the reference cache.

At step 0 the policy is the reference, so every implicit reward margin
(pi_c - ref_c) - (pi_r - ref_r) should be 0; what is measured through the training
path (its backend, dtype, micro-batch padding, sharding) is the path's bias. Its mean
absolute value over the pre-registered tolerance decides whether the cache is
accepted or rebuilt with the training path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from align.train.ref_cache import forward_impl_name

if TYPE_CHECKING:
    import numpy as np

    from align.config import ArmConfig

ACCEPT = "accept"
RECOMPUTE = "recompute"


@dataclass(frozen=True)
class TrainingPath:
    """The path a stage trains through, as far as it changes the numbers or the time: the
    forward_impl (attention backend, compute dtype, micro-batch, layout) and the master and
    gradient-reduction dtypes. Path bias and the probe record the one they measured."""

    forward_impl: str
    master: str
    reduce: str

    @classmethod
    def of(cls, cfg: ArmConfig) -> TrainingPath:
        """The path a pre-registration asks for."""
        model, batch = cfg.model, cfg.batch
        impl = forward_impl_name(
            model.attn_implementation, model.dtype, batch.micro_batch, batch.layout
        )
        return cls(impl, model.master_dtype, model.reduce_dtype)

    @classmethod
    def of_model(cls, model: Any, micro_batch: int, layout: str) -> TrainingPath:
        """The path a loaded model runs: its attention backend and read-back precision."""
        precision = model.precision
        impl = forward_impl_name(
            model.attn_implementation, precision["compute"], micro_batch, layout
        )
        return cls(impl, precision["master"], precision["reduce"])

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


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
    errors: np.ndarray, settings: dict[str, Any], cache_impl: str, training: TrainingPath
) -> dict[str, Any]:
    """The receipt's figures; `settings` is the `[path_bias]` section the measurement ran
    under, recorded whole so the gate can refuse a run that pre-registers another."""
    import numpy as np

    abs_err = np.abs(errors)
    mean_abs = float(abs_err.mean())
    tolerance = settings["tolerance"]
    ratio = mean_abs / tolerance
    return {
        "n": len(errors),
        "mean_abs": mean_abs,
        "p99_abs": float(np.quantile(abs_err, 0.99)),
        "max_abs": float(abs_err.max()),
        "tolerance": tolerance,
        "settings": settings,
        "ratio": ratio,
        "cache_forward_impl": cache_impl,
        "training_forward_impl": training.forward_impl,
        "training_path": training.as_dict(),
        "action": ACCEPT if ratio <= 1.0 else RECOMPUTE,
    }


@dataclass(frozen=True)
class PathBias:
    """The path-bias receipt's decision as its readers use it (the gates, the workflow's
    choice of cache): the cache kept or recomputed, on which ratio, measured against which
    cache and through which training path; `figures` whole, for the arm result to carry."""

    action: str
    ratio: float
    cache_forward_impl: str
    training_forward_impl: str
    training_path: dict[str, str] | None
    settings: dict[str, Any] | None
    figures: dict[str, Any]

    @classmethod
    def of(cls, receipt: dict[str, Any]) -> PathBias:
        figures = receipt["figures"]
        return cls(
            action=figures["action"],
            ratio=figures["ratio"],
            cache_forward_impl=figures["cache_forward_impl"],
            training_forward_impl=figures["training_forward_impl"],
            training_path=figures.get("training_path"),
            settings=figures.get("settings"),
            figures=figures,
        )

    @property
    def required_forward_impl(self) -> str:
        """The forward_impl whose cache the DPO stage must train on."""
        return self.cache_forward_impl if self.action == ACCEPT else self.training_forward_impl


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
