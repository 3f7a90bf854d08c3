"""Select-arms stage (section 13): paired evaluation of every policy, then the pre-registered rule.

`select_arms.py config/selection.toml config/arms/<arm>.toml ... [--k=v ...]`: the
first config is the selection's pre-registration, the others name the arms. Every
input is re-checked before torch is imported; selection.json records the rule, the
hashes of what was read, the paired statistics and the decision with its reason.
A run in which no arm can be selected is a finding, not an error: it writes a
FAILED receipt that says why, so the report can show it.
"""

from __future__ import annotations

import sys

from align.config import ArmConfig, SelectionConfig, load_config, to_dict
from align.exit_codes import run_with_exit_codes
from align.paths import RunPaths, SelectionPaths
from align.receipts import FAILED, PASSED, hash_file
from align.stages import gates
from align.stages import select as sel
from align.stages.entry import Stage, parse_stage_args
from align.train.memory import check_stage_rss, selection_seq_len
from align.utils.guard import configure_cpu


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
    prompts = generation_prompts(arrays, cfg.generation.prompts)
    scores, banner = {}, None
    for name, checkpoint in policies.items():
        scores[name] = paired.score_policy(
            checkpoint,
            cfg.model,
            info,
            shard,
            cfg.eval.batch_size,
            prompts,
            cfg.generation.max_new_tokens,
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
                print(f"align select_arms: banner\n{banner}", file=sys.stderr, flush=True)
    precision = paired.shared_precision(scores)
    figures = paired.policy_figures(scores, cfg.paired, cfg.generation.max_new_tokens)
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


def main() -> None:
    args = parse_stage_args(sys.argv[1:], n_configs=None)
    selection_toml, *arm_tomls = args.configs
    loaded = load_config(selection_toml, SelectionConfig, args.overrides)
    cfg, paths = loaded.cfg, RunPaths.of_config(loaded.cfg)
    arm_cfgs = [load_config(path, ArmConfig).cfg for path in arm_tomls]
    arms = [arm.arm for arm in arm_cfgs]
    sel.check_selection_config(cfg, arms, str(selection_toml))
    stage = Stage("select_arms")
    gate_report = gates.GateReport()
    gate = gate_report.run(
        "sft_gate",
        gates.sft_gate,
        paths,
        figures=lambda policy: {"checkpoint": paths.recorded(policy.checkpoint)},
    )
    sft_hash = gate_report.run(
        "sft_weights",
        gates.trusted_checkpoint_hash,
        gate,
        figures=lambda found: {"weights": found[:12]},
    )
    manifest = gate_report.run(
        "manifest", sel.manifest_gate, paths, arms, figures=lambda m: {"arms": len(m["arms"])}
    )
    results = {
        arm: gate_report.run(
            f"arm_result:{arm}",
            sel.arm_result_gate,
            paths,
            arm,
            gate.checkpoint,
            figures=lambda r: {"status": r["status"]},
        )
        for arm in arms
    }
    sources = gate_report.run(
        "eval_set",
        sel.eval_set_sources,
        cfg.paired.eval_set,
        manifest,
        arms,
        figures=lambda found: {"sources": ", ".join(sorted(found))},
    )
    standings = {arm: sel.arm_standing(results[arm]) for arm in arms}
    # Measured arms with a policy are scored even when not eligible, so a badly
    # measured arm is still seen beside the others; only the decision skips it.
    scored = [arm for arm in arms if standings[arm]["measured"] and results[arm].get("policy")]
    # Arms first, so each comparison with the SFT policy reads "arm - sft".
    policies = {
        **{
            arm: str(paths.resolve(results[arm]["policy"], "arm_result", paths.arm(arm).arm_result))
            for arm in scored
        },
        sel.SFT: str(gate.checkpoint),
    }

    configure_cpu(cfg.run)
    # One policy is loaded at a time: the largest one's projection is the job's.
    projection = max(
        (
            check_stage_rss(
                "select_arms",
                cfg,
                checkpoint,
                [src["path"] for src in sources.values()],
                seq_len=selection_seq_len(arm_cfgs),
            )
            for checkpoint in policies.values()
        ),
        key=lambda p: p["total_mb"],
    )
    from align.utils.dist import destroy_distributed

    figures = score_everything(cfg, paths, sources, manifest["pins"], policies, projection)
    phases = figures.pop("phases")
    band = sel.generation_band(cfg.generation.band, figures)
    standings = sel.judge_generations(standings, figures["policies"], band)
    figures["generation_band"] = band.as_dict()
    decision = sel.decide(cfg.rule, cfg.default_arm, standings, figures["comparisons"])
    recorded = paths.recorded
    inputs = {
        recorded(paths.sft_gate): hash_file(paths.sft_gate),
        recorded(gate.checkpoint): sft_hash,
        recorded(paths.manifest): hash_file(paths.manifest),
        **{recorded(src["path"]): src["hash"] for src in sources.values()},
        **{
            recorded(paths.arm(arm).arm_result): hash_file(paths.arm(arm).arm_result)
            for arm in arms
        },
        **{
            results[arm]["policy"]: results[arm]["outputs"][results[arm]["policy"]]
            for arm in scored
        },
    }
    receipt = stage.receipt(
        loaded,
        PASSED if decision["selected"] else FAILED,
        inputs=inputs,
        outputs={figures["eval_set"]["path"]: figures["eval_set"]["hash"]},
        figures=figures,
        phases=phases,
        projection=projection,
        rule={
            "name": cfg.rule,
            "default_arm": cfg.default_arm,
            "paired": to_dict(cfg.paired),
            "generation": to_dict(cfg.generation),
            "forward_path": to_dict(cfg.model),
        },
        arms=standings,
        decision=decision,
        gates=gate_report.recorded(),
    )
    stage.write(paths.selection, receipt)
    print(
        f"align select_arms: selected {decision['selected']} ({decision['branch']}): "
        f"{decision['reason']}",
        file=sys.stderr,
    )
    destroy_distributed()


if __name__ == "__main__":
    run_with_exit_codes(main, "select_arms")
