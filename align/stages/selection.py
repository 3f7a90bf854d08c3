"""The select_arms stage (section 13): every input re-checked before torch is imported, each
policy scored on the common held-out set, the pre-registered rule applied, and
selection.json written with the hashes of what was read, the paired statistics and the
decision with its reason. A run in which no arm can be selected is a finding, not an
error: its receipt is FAILED and says why, so the report can show it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.config import ArmConfig, SelectionConfig, load_config, to_dict
from align.data.manifest import Manifest
from align.log import stage_logger
from align.paths import RunPaths, SelectionPaths
from align.receipts import FAILED, PASSED, hash_file
from align.stages import gates
from align.stages import select as sel
from align.stages.arm_result import ArmResult
from align.stages.entry import Stage, parse_stage_args
from align.train.memory import check_stage_rss, selection_seq_len
from align.utils.guard import configure_cpu

LOG = stage_logger("select_arms")


def score_everything(cfg: SelectionConfig, paths: RunPaths, sources, pins, policies, projection):
    """Build the common eval set, score the SFT policy and every arm policy on it."""
    from align.data.loader import PairShard
    from align.data.shards import PAIR_FORMAT, read_shard, write_shard
    from align.eval.generation import generation_prompts
    from align.eval.sanity import chosen_responses
    from align.stages import paired
    from align.train.phases import PhaseMeter
    from align.train.session import start_session

    work = SelectionPaths.of(paths)
    info = start_session(work.run_dir, cfg.run, None)
    meter = PhaseMeter(info.device.type)
    arrays, union = paired.union_pairs(
        {name: read_shard(src["path"]) for name, src in sources.items()}, pins["pad_id"]
    )
    write_shard(work.eval_set, arrays, PAIR_FORMAT, split="eval", sources=sorted(sources))
    shard = PairShard(work.eval_set)
    prompts = generation_prompts(arrays, cfg.generation_check.prompts)
    scores, banner = {}, None
    for name, checkpoint in policies.items():
        scores[name] = paired.score_policy(
            checkpoint,
            cfg.model,
            info,
            shard,
            cfg.eval.batch_size,
            prompts,
            cfg.generation_check.max_new_tokens,
            pins,
            meter,
        )
        if banner is None:
            # Policies as receipts name them: relative to the results directory inside it.
            named = {policy: paths.recorded(path) for policy, path in policies.items()}
            banner = paired.scoring_banner(
                named, len(shard), cfg.model, scores[name].precision, list(info.devices)
            )
            if info.is_main:
                LOG.info(f"banner\n{banner}")
    precision = paired.shared_precision(scores)
    figures = paired.policy_figures(scores, cfg.paired, cfg.generation_check.max_new_tokens)
    eval_set = {
        "name": cfg.paired.eval_set,
        "path": paths.recorded(work.eval_set),
        "hash": hash_file(work.eval_set),
        **union,
        "response_tokens": paired.response_lengths(arrays),
        "chosen_responses": chosen_responses(arrays, pins["eos_id"]),
    }
    placed = {"precision": precision, "devices": list(info.devices), "banner": banner}
    return {"eval_set": eval_set, **figures, **placed, "phases": meter.report(projection)}


@dataclass(frozen=True)
class SelectionInputs:
    """What selection's gates passed: the SFT policy and its weights' hash, the manifest,
    each arm's result, the eval set's sources, and the gate table."""

    sft_checkpoint: Path
    sft_hash: str
    manifest: Manifest
    results: dict[str, ArmResult]
    sources: dict[str, dict[str, Any]]
    report: gates.GateReport


def selection_gates(cfg: SelectionConfig, paths: RunPaths, arms: list[str]) -> SelectionInputs:
    """Every input of the selection re-checked, in order, before torch is imported."""
    report = gates.GateReport()
    gate = report.run(
        "sft_gate",
        gates.sft_gate,
        paths,
        figures=lambda policy: {"checkpoint": paths.recorded(policy.checkpoint)},
    )
    sft_hash = report.run(
        "sft_weights",
        gates.trusted_checkpoint_hash,
        gate,
        figures=lambda found: {"weights": found[:12]},
    )
    manifest = report.run(
        "manifest", sel.manifest_gate, paths, arms, figures=lambda m: {"arms": len(m.arms)}
    )
    results = {
        arm: report.run(
            f"arm_result:{arm}",
            sel.arm_result_gate,
            paths,
            arm,
            gate.checkpoint,
            figures=lambda r: {"status": r.status},
        )
        for arm in arms
    }
    sources = report.run(
        "eval_set",
        sel.eval_set_sources,
        cfg.paired.eval_set,
        manifest,
        arms,
        figures=lambda found: {"sources": ", ".join(sorted(found))},
    )
    return SelectionInputs(gate.checkpoint, sft_hash, manifest, results, sources, report)


def scored_arms(passed: SelectionInputs, standings: dict[str, dict[str, Any]]) -> list[str]:
    """Measured arms with a policy: scored even when not eligible, so a badly measured arm
    is still seen beside the others; only the decision skips it."""
    return [
        arm
        for arm, result in passed.results.items()
        if standings[arm]["measured"] and result.policy
    ]


def policies_to_score(
    paths: RunPaths, passed: SelectionInputs, scored: list[str]
) -> dict[str, str]:
    """Arms first, so each comparison with the SFT policy reads "arm - sft"."""
    arms = {
        arm: str(paths.resolve(passed.results[arm].policy, "arm_result", paths.arm(arm).arm_result))
        for arm in scored
    }
    return {**arms, sel.SFT: str(passed.sft_checkpoint)}


def selection_projection(
    cfg: SelectionConfig,
    passed: SelectionInputs,
    policies: dict[str, str],
    arm_cfgs: list[ArmConfig],
) -> dict[str, Any]:
    """One policy is loaded at a time: the largest one's projection is the job's."""
    shards = {name: src["path"] for name, src in passed.sources.items()}
    seq_len = selection_seq_len(arm_cfgs)
    return max(
        (
            check_stage_rss("select_arms", cfg, checkpoint, shards, seq_len=seq_len)
            for checkpoint in policies.values()
        ),
        key=lambda p: p["total_mb"],
    )


def selection_inputs(paths: RunPaths, passed: SelectionInputs, scored: list[str]) -> dict[str, str]:
    """The hashes of everything the selection read, by recorded path."""
    recorded = paths.recorded
    results = passed.results
    return {
        recorded(paths.sft_gate): hash_file(paths.sft_gate),
        recorded(passed.sft_checkpoint): passed.sft_hash,
        recorded(paths.manifest): hash_file(paths.manifest),
        **{recorded(src["path"]): src["hash"] for src in passed.sources.values()},
        **{
            recorded(paths.arm(arm).arm_result): hash_file(paths.arm(arm).arm_result)
            for arm in results
        },
        **{results[arm].policy: results[arm].policy_hash for arm in scored},
    }


def the_rule(cfg: SelectionConfig) -> dict[str, Any]:
    return {
        "name": cfg.rule,
        "default_arm": cfg.default_arm,
        "paired": to_dict(cfg.paired),
        "generation_check": to_dict(cfg.generation_check),
        "generation_band": to_dict(cfg.generation_band),
        "forward_path": to_dict(cfg.model),
    }


def run_select_arms(argv: list[str]) -> None:
    """The stage: gates on every input, each policy scored, the rule's decision, the receipt."""
    args = parse_stage_args(argv, n_configs=None)
    selection_toml, *arm_tomls = args.configs
    loaded = load_config(selection_toml, SelectionConfig, args.overrides)
    cfg, paths = loaded.cfg, RunPaths.of_config(loaded.cfg)
    arm_cfgs = [load_config(path, ArmConfig).cfg for path in arm_tomls]
    arms = [arm.arm for arm in arm_cfgs]
    sel.check_selection_config(cfg, arms, str(selection_toml))
    stage = Stage("select_arms")
    passed = selection_gates(cfg, paths, arms)
    standings = {arm: sel.arm_standing(passed.results[arm]) for arm in arms}
    scored = scored_arms(passed, standings)
    policies = policies_to_score(paths, passed, scored)
    configure_cpu(cfg.run)
    projection = selection_projection(cfg, passed, policies, arm_cfgs)
    from align.utils.dist import destroy_distributed

    pins = passed.manifest.pins
    figures = score_everything(cfg, paths, passed.sources, pins, policies, projection)
    phases = figures.pop("phases")
    band = sel.generation_band(cfg.generation_band, figures)
    standings = sel.judge_generations(standings, figures["policies"], band)
    figures["generation_band"] = band.as_dict()
    decision = sel.decide(cfg.rule, cfg.default_arm, standings, figures["comparisons"])
    receipt = stage.receipt(
        loaded,
        PASSED if decision["selected"] else FAILED,
        inputs=selection_inputs(paths, passed, scored),
        outputs={figures["eval_set"]["path"]: figures["eval_set"]["hash"]},
        figures=figures,
        phases=phases,
        projection=projection,
        rule=the_rule(cfg),
        arms=standings,
        decision=decision,
        gates=passed.report.recorded(),
    )
    stage.write(paths.selection, receipt)
    LOG.info(f"selected {decision['selected']} ({decision['branch']}): {decision['reason']}")
    destroy_distributed()
