"""Arm selection (section 13): what the selection reads, which arms may win, the decision.

Owns the gates on the selection's inputs (the SFT gate's checkpoint, the manifest's
held-out shards, arm results trained from that checkpoint whose policies still hash
as recorded), the standing of each arm, and the pre-registered rule with the reason
for its decision. A descoped arm was never measured; a tripwire-ended or failed arm
was measured badly; an arm whose greedy generations leave the pre-registered band
(align.eval.sanity) is ineligible however well it ranks pairs. They are recorded
apart and none can be selected. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from align.config import GenerationBandConfig, SelectionConfig
from align.constants import SELECTION_RULES as RULES
from align.data.manifest import Manifest, ShardRecord
from align.data.shards import PAIR_FORMAT, read_metadata
from align.eval.sanity import GenerationBand, judge
from align.exit_codes import ConfigError, GateRefused
from align.paths import RunPaths
from align.receipts import DESCOPED, FAILED, PASSED, hash_file, load_receipt, verify_hash
from align.stages.arm_result import ArmResult
from align.utils.weights_hash import weights_hash

# The SFT policy's name among the scored policies; no arm may take it.
SFT = "sft"
UNION = "union"
ELIGIBLE = "eligible"
NEVER_MEASURED = "descoped"
TRIPWIRE_ENDED = "tripwire_ended"
FAILED_ARM = "failed"
INELIGIBLE = "ineligible"
NOT_RECORDED = "not recorded"


def check_selection_config(cfg: SelectionConfig, arms: Sequence[str], where: str) -> None:
    """Refuse a pre-registration the rule cannot be applied with, naming the key (its
    sections' own ranges were checked when it loaded)."""
    if cfg.rule not in RULES:
        raise ConfigError(f"{where}: key 'rule' expected one of {RULES}, found {cfg.rule!r}")
    if SFT in arms:
        raise ConfigError(f"{where}: arm name {SFT!r} is the SFT policy's; rename the arm")
    if cfg.default_arm not in arms:
        raise ConfigError(
            f"{where}: key 'default_arm' expected one of the workflow's arms {list(arms)}, "
            f"found {cfg.default_arm!r}"
        )


def manifest_gate(paths: RunPaths, arms: Sequence[str]) -> Manifest:
    """The manifest lists every arm and its held-out shards are intact; returned with their
    paths resolved."""
    manifest = Manifest.of(
        load_receipt(paths.manifest, "manifest", stage="build_manifest"), paths.manifest
    )
    entries = dict(manifest.arms)
    for arm in arms:
        if arm not in entries:
            raise GateRefused("manifest", f"{paths.manifest}: arm {arm!r} absent")
        held = entries[arm].shards["held"]
        path = paths.resolve(held.path, "manifest", paths.manifest)
        verify_hash("manifest", path, held.hash)
        shards = {**entries[arm].shards, "held": ShardRecord(str(path), held.hash)}
        entries[arm] = dataclasses.replace(entries[arm], shards=shards)
    return dataclasses.replace(manifest, arms=entries)


def arm_result_gate(paths: RunPaths, arm: str, sft_checkpoint: str | Path) -> ArmResult:
    """The arm's result, as recorded; a policy it names was trained from the SFT checkpoint
    `sft_checkpoint` (resolved) and is unchanged."""
    path = paths.arm(arm).arm_result
    result = ArmResult.of(load_receipt(path, "arm_result", stage="dpo"))
    if result.arm != arm:
        raise GateRefused("arm_result", f"{path}: arm expected {arm!r}, found {result.arm!r}")
    if result.policy is None:
        if result.status == PASSED and not result.descoped:
            raise GateRefused("arm_result", f"{path}: a PASSED arm result names no policy")
        return result
    trained_from = paths.resolve(str(result.checkpoint), "arm_result", path)
    if trained_from != Path(sft_checkpoint):
        raise GateRefused(
            "arm_result",
            f"{path}: trained from {result.checkpoint!r}, expected the SFT gate's "
            f"checkpoint {str(sft_checkpoint)!r}",
        )
    recorded = result.policy_hash
    if recorded is None:
        raise GateRefused("arm_result", f"{path}: no weights hash recorded for {result.policy}")
    policy = paths.resolve(result.policy, "arm_result", path)
    if not policy.is_dir():
        raise GateRefused("arm_result", f"{policy}: policy missing ({path} names it)")
    found = weights_hash(policy)
    if found != recorded:
        raise GateRefused(
            "arm_result", f"{policy}: weights hash expected {recorded[:12]}, found {found[:12]}"
        )
    return result


def eval_set_sources(
    eval_set: str, manifest: Manifest, arms: Sequence[str]
) -> dict[str, dict[str, str]]:
    """The shards the common eval set is built from: every arm's held-out shard, or one named."""
    if eval_set == UNION:
        held = {arm: manifest.arms[arm].shards["held"] for arm in arms}
        return {arm: {"path": shard.path, "hash": shard.hash} for arm, shard in held.items()}
    path = Path(eval_set)
    if not path.is_file():
        raise GateRefused("eval_set", f"{path}: paired.eval_set names no file")
    fmt = read_metadata(path).get("format")
    if fmt != PAIR_FORMAT:
        raise GateRefused("eval_set", f"{path}: format expected {PAIR_FORMAT!r}, found {fmt!r}")
    return {str(path): {"path": str(path), "hash": hash_file(path)}}


def arm_standing(result: ArmResult) -> dict[str, Any]:
    """Whether the arm may be selected, and why not: never measured, or measured badly."""
    tripwire = result.tripwire
    alarms = tripwire.fired_wires if tripwire else []
    base = {
        "status": result.status,
        "tripwire": "recorded" if tripwire else NOT_RECORDED,
        "alarms": alarms,
        "rerun": tripwire.rerun if tripwire else None,
        "policy": result.policy,
    }

    def standing(kind: str, measured: bool, reason: str) -> dict[str, Any]:
        return {**base, "standing": kind, "measured": measured, "reason": reason}

    why = result.reason or "no reason recorded"
    if result.descoped or result.status == DESCOPED:
        return standing(NEVER_MEASURED, False, f"never measured: descoped ({why})")
    if tripwire and tripwire.ended_by_tripwire:
        fired = ", ".join(alarms) or "no alarm named"
        return standing(
            TRIPWIRE_ENDED, True, f"measured badly: training ended by a tripwire ({fired})"
        )
    if result.status == FAILED:
        return standing(FAILED_ARM, True, f"measured badly: arm result FAILED ({why})")
    if result.status != PASSED:
        raise GateRefused("arm_result", f"arm {result.arm}: unknown status {result.status!r}")
    if base["rerun"]:
        return standing(
            ELIGIBLE,
            True,
            f"passed; a tripwire fired ({', '.join(alarms)}) and the pre-registered rerun passed",
        )
    return standing(ELIGIBLE, True, "passed")


def generation_band(cfg: GenerationBandConfig, figures: Mapping[str, Any]) -> GenerationBand:
    """The band of the selection: the SFT policy's greedy generations on the common prompts
    and the eval set's chosen responses are the references."""
    sft = figures["policies"][SFT]["generation"]
    return GenerationBand.of(cfg, sft, figures["eval_set"]["chosen_responses"])


def judge_generations(
    standings: Mapping[str, Mapping[str, Any]],
    policies: Mapping[str, Mapping[str, Any]],
    band: GenerationBand,
) -> dict[str, dict[str, Any]]:
    """Every scored arm's generations against the band; an eligible arm outside it becomes
    ineligible, with the figures and the reason. Arms that were not scored are unchanged."""
    judged = {}
    for arm, standing in standings.items():
        out = dict(standing)
        if arm in policies:
            verdict = judge(band, policies[arm]["generation"])
            out["generation"] = verdict
            if standing["standing"] == ELIGIBLE and not verdict["inside"]:
                out["standing"] = INELIGIBLE
                out["reason"] = (
                    "measured, but its greedy generations leave the pre-registered band: "
                    + "; ".join(verdict["reasons"])
                )
        judged[arm] = out
    return judged


def oriented(comparisons: Sequence[Mapping[str, Any]], a: str, b: str) -> dict[str, Any]:
    """The comparison of a against b, read from a's side whichever order it was computed in."""
    for c in comparisons:
        if (c["a"], c["b"]) == (a, b):
            return dict(c)
        if (c["a"], c["b"]) == (b, a):
            return {
                **c,
                "a": a,
                "b": b,
                "accuracy_a": c["accuracy_b"],
                "accuracy_b": c["accuracy_a"],
                "diff": -c["diff"],
                "ci_low": -c["ci_high"],
                "ci_high": -c["ci_low"],
            }
    raise ValueError(f"no paired comparison of {a} and {b}")


def describe(c: Mapping[str, Any]) -> str:
    level = round(100 * c["confidence"])
    return (
        f"{c['a']} {c['accuracy_a']:.3f} vs {c['b']} {c['accuracy_b']:.3f}, difference "
        f"{c['diff']:+.3f} [{level}% CI {c['ci_low']:+.3f}, {c['ci_high']:+.3f}]"
    )


def dominant_arm(eligible: Sequence[str], comparisons: Sequence[Mapping[str, Any]]) -> str | None:
    """The arm whose paired accuracy beats every other eligible arm's with an interval above 0."""
    for arm in eligible:
        against = [oriented(comparisons, arm, other) for other in eligible if other != arm]
        if all(c["ci_low"] > 0 for c in against):
            return arm
    return None


def decide(
    rule: str,
    default_arm: str,
    standings: Mapping[str, Mapping[str, Any]],
    comparisons: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """Apply the pre-registered rule; every branch names itself and gives its reason."""
    if rule not in RULES:
        raise ConfigError(f"selection rule expected one of {RULES}, found {rule!r}")
    eligible = [arm for arm, s in standings.items() if s["standing"] == ELIGIBLE]
    excluded = {arm: s["reason"] for arm, s in standings.items() if s["standing"] != ELIGIBLE}
    common = {"rule": rule, "default_arm": default_arm, "eligible": eligible, "excluded": excluded}
    not_eligible = "; ".join(f"{arm} {why}" for arm, why in excluded.items())

    def decision(selected: str | None, branch: str, reason: str) -> dict[str, Any]:
        return {**common, "selected": selected, "branch": branch, "reason": reason}

    if not eligible:
        return decision(None, "no_eligible_arm", f"no arm can be selected: {not_eligible}")
    if len(eligible) == 1:
        return decision(
            eligible[0],
            "only_eligible_arm",
            f"{eligible[0]} is the only eligible arm (not eligible: {not_eligible})",
        )
    winner = dominant_arm(eligible, comparisons)
    if winner is not None:
        evidence = "; ".join(
            describe(oriented(comparisons, winner, other)) for other in eligible if other != winner
        )
        return decision(
            winner,
            "paired_accuracy",
            f"{winner} has the higher paired accuracy and the interval excludes 0: {evidence}",
        )
    evidence = "; ".join(
        describe(oriented(comparisons, a, b))
        for i, a in enumerate(eligible)
        for b in eligible[i + 1 :]
    )
    if default_arm in eligible:
        return decision(
            default_arm,
            "default_arm",
            f"no arm's paired accuracy advantage excludes 0 ({evidence}); "
            f"the pre-registered default arm {default_arm} is selected",
        )
    return decision(
        None,
        "inconclusive_default_not_eligible",
        f"no arm's paired accuracy advantage excludes 0 ({evidence}) and the pre-registered "
        f"default arm {default_arm} is not eligible ({excluded.get(default_arm, 'not an arm')})",
    )
