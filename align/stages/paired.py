"""Paired evaluation (section 13): every policy scored on one common held-out set.

Owns the common set (the union of held-out shards, deduplicated by pair_id), the
per-pair correctness of each policy, the paired statistics between every two
policies (accuracy difference with a seeded paired-bootstrap interval, exact
McNemar test on the discordant pairs), and the drift each arm shows against the
SFT policy: chosen log-prob change and the length of its greedy generations.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import binomtest

from align.config import ModelConfig, PairedEvalConfig
from align.data.loader import PairShard
from align.eval.generation import greedy_generate_batch
from align.eval.preference import implicit_reward_correct, preference_correct, score_pairs
from align.eval.stats import accuracy_summary
from align.exit_codes import ConfigError
from align.stages.select import SFT
from align.train.phases import PhaseMeter
from align.train.precision import describe as describe_precision
from align.train.session import load_policy
from align.utils.dist import DistInfo

SFT_METHOD = (
    "preference of the SFT policy itself: log p(chosen) > log p(rejected); "
    "it is the reference, so it has no implicit reward"
)
ARM_METHOD = "implicit reward margin against the SFT reference: (pi_c - sft_c) - (pi_r - sft_r) > 0"
# Bootstrap index draws per block: bounds memory on large eval sets without
# changing the draws (the generator streams the same numbers either way).
BOOTSTRAP_BLOCK_DRAWS = 1 << 22
PAIR_KEYS = ("pair_id", "prompt_len", "chosen_len", "rejected_len")
ID_KEYS = ("chosen_ids", "rejected_ids")


def union_pairs(
    shards: Mapping[str, dict[str, np.ndarray]], pad_id: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The shards' rows in order, the first occurrence of each pair_id kept, padded to the widest.

    Returns the arrays and what each source contributed.
    """
    width = max(arrays["chosen_ids"].shape[1] for arrays in shards.values())
    seen: set[int] = set()
    picked: dict[str, list[np.ndarray]] = {key: [] for key in (*PAIR_KEYS, *ID_KEYS)}
    contributed: dict[str, int] = {}
    for name, arrays in shards.items():
        keep = []
        for pid in arrays["pair_id"].tolist():
            keep.append(pid not in seen)
            seen.add(pid)
        fresh = np.array(keep, dtype=bool)
        contributed[name] = int(fresh.sum())
        for key in PAIR_KEYS:
            picked[key].append(arrays[key][fresh])
        for key in ID_KEYS:
            ids = np.full((int(fresh.sum()), width), pad_id, dtype=np.int32)
            ids[:, : arrays[key].shape[1]] = arrays[key][fresh]
            picked[key].append(ids)
    union = {key: np.concatenate(parts) for key, parts in picked.items()}
    total = sum(len(arrays["pair_id"]) for arrays in shards.values())
    return union, {
        "sources": contributed,
        "pairs": len(union["pair_id"]),
        "duplicates_removed": total - len(union["pair_id"]),
    }


def mcnemar_exact(a_correct: np.ndarray, b_correct: np.ndarray) -> dict[str, Any]:
    """Exact McNemar test: under no difference, each discordant pair is a fair coin."""
    a, b = np.asarray(a_correct, dtype=bool), np.asarray(b_correct, dtype=bool)
    a_only, b_only = int((a & ~b).sum()), int((~a & b).sum())
    discordant = a_only + b_only
    p_value = 1.0 if discordant == 0 else float(binomtest(a_only, discordant, 0.5).pvalue)
    return {
        "both": int((a & b).sum()),
        "neither": int((~a & ~b).sum()),
        "a_only": a_only,
        "b_only": b_only,
        "p_value": p_value,
    }


def paired_bootstrap(
    a_correct: np.ndarray, b_correct: np.ndarray, n_boot: int, seed: int, confidence: float
) -> dict[str, float]:
    """Accuracy difference a - b and its percentile interval over resampled pairs.

    Pairs are resampled whole, so the correlation between the two policies on the
    same pair is kept; that is what makes the interval paired.
    """
    diff = np.asarray(a_correct, dtype=np.float64) - np.asarray(b_correct, dtype=np.float64)
    n = len(diff)
    if n == 0:
        raise ValueError("paired bootstrap of an empty eval set is undefined")
    rng = np.random.default_rng(seed)
    block = max(1, BOOTSTRAP_BLOCK_DRAWS // n)
    means = np.concatenate(
        [
            diff[rng.integers(0, n, size=(min(block, n_boot - start), n))].mean(axis=1)
            for start in range(0, n_boot, block)
        ]
    )
    tail = (1.0 - confidence) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return {"diff": float(diff.mean()), "ci_low": float(low), "ci_high": float(high)}


def compare(
    name_a: str, a_correct: np.ndarray, name_b: str, b_correct: np.ndarray, cfg: PairedEvalConfig
) -> dict[str, Any]:
    """Every paired statistic of policy a against policy b on the same pairs."""
    boot = paired_bootstrap(a_correct, b_correct, cfg.n_boot, cfg.seed, cfg.confidence)
    return {
        "a": name_a,
        "b": name_b,
        "accuracy_a": float(np.mean(a_correct)),
        "accuracy_b": float(np.mean(b_correct)),
        **boot,
        "confidence": cfg.confidence,
        "n_boot": cfg.n_boot,
        "seed": cfg.seed,
        "excludes_zero": boot["ci_low"] > 0 or boot["ci_high"] < 0,
        "mcnemar": mcnemar_exact(a_correct, b_correct),
    }


def all_comparisons(
    correct: Mapping[str, np.ndarray], cfg: PairedEvalConfig
) -> list[dict[str, Any]]:
    """Each pair of policies once, in the order given."""
    return [compare(a, correct[a], b, correct[b], cfg) for a, b in combinations(correct, 2)]


@dataclass
class PolicyScores:
    """One policy on the eval set: summed response log-probs and its greedy generations."""

    chosen: np.ndarray
    rejected: np.ndarray
    generated_tokens: list[int]
    terminated: list[bool]
    # The dtypes read back from the live model that scored (align.train.precision).
    precision: dict[str, Any]

    def generation_summary(self, max_new_tokens: int) -> dict[str, Any]:
        return {
            "prompts": len(self.generated_tokens),
            "max_new_tokens": max_new_tokens,
            "mean_tokens": float(np.mean(self.generated_tokens)),
            "terminated_fraction": float(np.mean(self.terminated)),
        }


def correctness(scores: Mapping[str, PolicyScores]) -> dict[str, np.ndarray]:
    """Per-pair correctness of every policy; the SFT policy under SFT, the arms against it."""
    sft = scores[SFT]
    out = {}
    for name, s in scores.items():
        if name == SFT:
            out[name] = preference_correct(s.chosen, s.rejected)
        else:
            out[name] = implicit_reward_correct(s.chosen, s.rejected, sft.chosen, sft.rejected)
    return out


def policy_figures(
    scores: Mapping[str, PolicyScores], cfg: PairedEvalConfig, max_new_tokens: int
) -> dict[str, Any]:
    """Accuracy, log-prob drift and generation length of each policy, and every comparison."""
    correct = correctness(scores)
    sft = scores[SFT]
    policies = {}
    for name, s in scores.items():
        policies[name] = {
            "method": SFT_METHOD if name == SFT else ARM_METHOD,
            **accuracy_summary(correct[name].tolist(), cfg.confidence),
            "mean_chosen_logp_change": float(np.mean(s.chosen - sft.chosen)),
            "mean_rejected_logp_change": float(np.mean(s.rejected - sft.rejected)),
            "generation": s.generation_summary(max_new_tokens),
            "precision": s.precision,
        }
    return {"policies": policies, "comparisons": all_comparisons(correct, cfg)}


def response_lengths(arrays: dict[str, np.ndarray]) -> dict[str, float]:
    """Mean chosen and rejected response tokens of the eval set, beside which generations are read."""
    return {
        side: float(np.mean(arrays[f"{side}_len"] - arrays["prompt_len"]))
        for side in ("chosen", "rejected")
    }


def score_policy(
    checkpoint: str | Path,
    model_cfg: ModelConfig,
    info: DistInfo,
    shard: PairShard,
    batch_size: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    pins: dict[str, Any],
    meter: PhaseMeter,
) -> PolicyScores:
    """Load one policy, score every pair of `shard` and generate on `prompts`, then free it."""
    with meter.phase("load"):
        model = load_policy(checkpoint, model_cfg, info)
    with meter.phase("evaluate"):
        chosen, rejected = score_pairs(model, shard, batch_size, info, desc=f"score {checkpoint}")
        generations = greedy_generate_batch(
            model, prompts, max_new_tokens, pins["eos_id"], pins["pad_id"], info.device
        )
    precision = model.precision
    del model
    gc.collect()
    return PolicyScores(
        chosen=chosen.astype(np.float64),
        rejected=rejected.astype(np.float64),
        generated_tokens=[len(new) for new, _ in generations],
        terminated=[done for _, done in generations],
        precision=precision,
    )


def shared_precision(scores: Mapping[str, PolicyScores]) -> dict[str, Any]:
    """The precision, read back from each live model, that every policy was scored at.

    One pre-registered forward path scores every policy, so that the comparison is not
    confounded by it; a policy read back at another precision is refused, named.
    """
    (first, scored), *others = scores.items()
    record = scored.precision
    differ = [name for name, s in others if s.precision != record]
    if differ:
        raise ConfigError(
            f"policies {differ} were scored at another precision than {first} "
            f"({describe_precision(record)}): "
            + "; ".join(f"{name}: {describe_precision(scores[name].precision)}" for name in differ)
        )
    return record


def scoring_banner(
    policies: Mapping[str, str | Path],
    eval_pairs: int,
    model_cfg: ModelConfig,
    precision: Mapping[str, Any],
    devices: list[str],
) -> str:
    """What scores the policies: read off the first live model and the process group."""
    rows = [
        ("policies", ", ".join(f"{name} ({path})" for name, path in policies.items())),
        ("eval set", f"{eval_pairs} pairs"),
        ("attention", model_cfg.attn_implementation),
        ("precision", describe_precision(precision)),
        ("devices", ", ".join(f"{rank}={device}" for rank, device in enumerate(devices))),
    ]
    return "\n".join(f"  {name:<15} {value}" for name, value in rows)
