"""Statistics of held-out evaluation (scipy; no torch)."""

from __future__ import annotations


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    # Imported here: every training rank imports this module, and scipy.stats costs each
    # of them most of a second at startup for a figure only the end of a run computes.
    from scipy.stats import binomtest

    if n == 0:
        raise ValueError("Wilson interval of zero trials is undefined")
    ci = binomtest(successes, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


def accuracy_summary(
    correct: list[bool] | tuple[bool, ...], confidence: float = 0.95
) -> dict[str, float]:
    """Accuracy, n and its Wilson interval; a tie (False) counts as wrong."""
    n = len(correct)
    k = int(sum(bool(c) for c in correct))
    low, high = wilson_interval(k, n, confidence)
    return {
        "n": n,
        "correct": k,
        "accuracy": k / n,
        "ci_low": low,
        "ci_high": high,
        "confidence": confidence,
    }
