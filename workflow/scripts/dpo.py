"""DPO stage: every gate in GATE_ORDER before torch, then the arm's training (rule `dpo`)
or, with --probe, the throughput probe (rule `probe`). --gates-only stops after the gates."""

from __future__ import annotations

import sys

from align.config import ArmConfig, load_config, to_dict
from align.exit_codes import TripwireFired, run_with_exit_codes
from align.paths import FIRST_RUN, RERUN, RunPaths
from align.receipts import DESCOPED, FAILED, PASSED, hash_file
from align.stages.arm_result import TripwireRecord
from align.stages.entry import Stage, is_main_process, parse_stage_args
from align.stages.gates import Descoped, Gated, Probed, run_gates
from align.utils.guard import apply_resource_guards


def main() -> None:
    args = parse_stage_args(sys.argv[1:], flags=("gates-only", "probe"))
    loaded = load_config(args.configs[0], ArmConfig, args.overrides)
    cfg = loaded.cfg
    probe = "probe" in args.flags
    stage = Stage("probe" if probe else "dpo")
    report, gated = run_gates(
        cfg, RunPaths.of_config(cfg), through="preflight" if probe else "probe"
    )
    out = gated.arm.probe if probe else gated.arm.arm_result
    common = {"arm": cfg.arm, "config": to_dict(cfg), "gates": report.recorded()}
    if is_main_process():
        stage.log.info(f"gates for arm {cfg.arm}\n{report.table()}")
    if isinstance(gated, Descoped):
        if is_main_process():
            stage.write(
                out,
                stage.receipt(loaded, DESCOPED, descoped=True, reason=gated.entry.reason, **common),
            )
            stage.log.info(f"arm {cfg.arm} DESCOPED: {gated.entry.reason}")
        return
    if "gates-only" in args.flags:
        return
    apply_resource_guards(cfg.run, stage.name, [cfg.run.results_dir])
    from align.utils.dist import destroy_distributed

    if probe:
        write_probe(loaded, gated, stage, out, common)
    else:
        write_arm_result(loaded, gated, stage, out, common)
    destroy_distributed()


def write_probe(loaded, gated: Gated, stage: Stage, out, common: dict) -> None:
    from align.stages.dpo import run_probe

    figures, info = run_probe(loaded.cfg, gated, stage.started)
    phases = figures.pop("phases")
    b = loaded.cfg.batch
    if info.is_main:
        topology = {
            "world_size": info.world_size,
            "micro_batch": b.micro_batch,
            "grad_accum": b.grad_accum,
        }
        receipt = stage.receipt(
            loaded,
            PASSED,
            figures=figures,
            phases=phases,
            topology=topology,
            projection=gated.projection.figures,
            **common,
        )
        stage.write(out, receipt)
        stage.log.info(
            f"arm {loaded.cfg.arm} median step {figures['median_step_s']:.3f} s, "
            f"{figures['tokens_per_s']:.0f} tokens/s, peak RSS {figures['peak_rss_mb']:.0f} MiB "
            f"(projected {gated.projection.total_mb:.0f}), projected wall {figures['projected_wall_s']:.0f} s"
        )


def write_arm_result(loaded, gated: Probed, stage: Stage, out, common: dict) -> None:
    from align.stages.dpo import run_dpo
    from align.utils.weights_hash import weights_hash

    figures, info = run_dpo(loaded.cfg, gated, stage.started)
    tripwire = TripwireRecord.of(figures.pop("tripwire"))
    phases = figures.pop("phases")
    ended = tripwire.ended_by_tripwire
    if info.is_main:
        arm, recorded = gated.arm, gated.paths.recorded
        caches = {split: recorded(cache.path) for split, cache in gated.caches.items()}
        receipt = stage.receipt(
            loaded,
            FAILED if ended else PASSED,
            descoped=False,
            inputs={
                recorded(gated.checkpoint): gated.checkpoint_weights,
                **{recorded(c.path): hash_file(c.path) for c in gated.caches.values()},
            },
            outputs={recorded(arm.policy_dir): weights_hash(arm.policy_dir)},
            figures=figures,
            phases=phases,
            tripwire=tripwire.as_dict(),
            checkpoint=recorded(gated.checkpoint),
            caches=caches,
            policy=recorded(arm.policy_dir),
            path_bias=gated.path_bias.figures,
            projection=gated.projection.figures,
            **common,
        )
        stage.write(out, receipt)
        held = figures["held_out"]
        stage.log.info(
            f"arm {loaded.cfg.arm} held-out preference accuracy sft {held['sft']['accuracy']:.3f} -> "
            f"policy {held['policy']['accuracy']:.3f} [{held['policy']['ci_low']:.3f}, {held['policy']['ci_high']:.3f}]"
            + (
                f"; rerun with {tripwire.response} after {fired(tripwire, FIRST_RUN)}"
                if tripwire.rerun
                else ""
            )
        )
    if ended:
        from align.utils.dist import barrier

        # Every rank exits 5 together, so no rank's exit ends rank 0 before its receipt.
        barrier()
        raise TripwireFired(
            f"arm {loaded.cfg.arm}: tripwire fired again after the pre-registered rerun: "
            f"{fired(tripwire, RERUN)}"
        )


def fired(tripwire: TripwireRecord, run: str) -> str:
    """The alarms of one training run, as the log line names them."""
    from align.train.tripwires import describe_alarm

    return ", ".join(describe_alarm(a) for a in tripwire.alarms_of(run))


if __name__ == "__main__":
    run_with_exit_codes(main, "dpo")
