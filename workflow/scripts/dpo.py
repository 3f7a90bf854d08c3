"""DPO stage: re-check every gate before torch, train the arm, write arm_result.json."""

from __future__ import annotations

import sys
import time

from align.config import ArmConfig, load_config, to_dict
from align.exit_codes import run_with_exit_codes
from align.paths import SPLITS, RunPaths
from align.receipts import DESCOPED, PASSED
from align.stage import Stage, parse_stage_args
from align.train import stage_gates
from align.train.ref_cache import check_key, expected_key, forward_impl_name
from align.utils.guard import cap_threads


class GateReport:
    """Runs gates in order, timing each; the first refusal propagates."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def run(self, name: str, fn, *args):
        started = time.perf_counter()
        result = fn(*args)
        self.rows.append(
            {"gate": name, "status": PASSED, "ms": round(1e3 * (time.perf_counter() - started), 2)}
        )
        return result

    def table(self) -> str:
        return "\n".join(
            f"  {r['gate']:<12} {r['status']:<8} {r['ms']:>8.2f} ms" for r in self.rows
        )


def main() -> None:
    args = parse_stage_args(sys.argv[1:], flags=("gates-only",))
    loaded = load_config(args.configs[0], ArmConfig, args.overrides)
    cfg, paths = loaded.cfg, RunPaths.of(loaded.cfg.run.results_dir)
    arm = paths.arm(cfg.arm)
    stage = Stage("dpo")
    gates = GateReport()
    checkpoint = gates.run("sft_gate", stage_gates.sft_gate, paths)["checkpoint"]
    entry = gates.run("manifest", stage_gates.manifest_entry, paths, cfg)
    common = {"arm": cfg.arm, "config": to_dict(cfg), "gates": gates.rows}
    if entry["status"] == DESCOPED:
        stage.write(
            arm.arm_result,
            stage.receipt(loaded, DESCOPED, descoped=True, reason=entry["reason"], **common),
        )
        print(f"align dpo: arm {cfg.arm} DESCOPED: {entry['reason']}", file=sys.stderr)
        return
    forward_impl = forward_impl_name(cfg.ref.attn_implementation, cfg.ref.dtype, cfg.ref.batch_size)
    caches = {}

    def ref_cache_gate() -> None:
        for split in SPLITS:
            shard = entry["shards"][split]["path"]
            key = expected_key(
                checkpoint,
                shard,
                cfg.data.seq_len,
                cfg.data.truncation,
                cfg.ref.dtype,
                forward_impl,
            )
            check_key(arm.ref_cache(forward_impl, split), key)
            caches[split] = (arm.ref_cache(forward_impl, split), key)

    gates.run("ref_cache", ref_cache_gate)
    print(f"align dpo: gates for arm {cfg.arm}\n{gates.table()}", file=sys.stderr)
    if "gates-only" in args.flags:
        return
    cap_threads(cfg.run.threads)
    from align.model.weights_hash import weights_hash
    from align.train.dpo_stage import run_dpo
    from align.utils.dist import destroy_distributed

    shards = {split: entry["shards"][split]["path"] for split in SPLITS}
    figures, info = run_dpo(cfg, checkpoint, shards, caches, arm)
    if info.is_main:
        receipt = stage.receipt(
            loaded, PASSED, descoped=False,
            inputs={checkpoint: caches["train"][1]["checkpoint_weights"]},
            outputs={str(arm.policy_dir): weights_hash(arm.policy_dir)},
            figures=figures, checkpoint=checkpoint, forward_impl=forward_impl, policy=str(arm.policy_dir),
            **common,
        )
        stage.write(arm.arm_result, receipt)
        held = figures["held_out"]
        print(
            f"align dpo: arm {cfg.arm} held-out preference accuracy sft {held['sft']['accuracy']:.3f} -> "
            f"policy {held['policy']['accuracy']:.3f} "
            f"[{held['policy']['ci_low']:.3f}, {held['policy']['ci_high']:.3f}]",
            file=sys.stderr,
        )
    destroy_distributed()


if __name__ == "__main__":
    run_with_exit_codes(main, "dpo")
