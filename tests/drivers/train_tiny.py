"""Train a tiny DPO policy with the real Trainer, for multi-rank and resume tests.

`python tests/drivers/train_tiny.py WORKDIR [--k=v trainer/batch overrides]` under
torchrun or alone. WORKDIR holds `base/` (an HF checkpoint), `pairs.safetensors`
and `ref.npz`; the trained policy is exported to WORKDIR/out-<tag>/.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import torch

from align.config import ArmConfig, apply_overrides
from align.data.loader import PairShard
from align.exit_codes import run_with_exit_codes
from align.losses.dpo import DPOObjective
from align.receipts import write_json_atomic
from align.train.adapters import DpoAdapter
from align.train.session import build_trainer, export_policy, load_policy, start_session
from align.utils.dist import destroy_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--signal-at-step", type=int, default=0)
    # Who gets the signal at that step: this rank's process, or its launcher (as Slurm
    # signals a job step); which rank sends it; and which signal.
    parser.add_argument("--signal-target", choices=("self", "launcher"), default="self")
    parser.add_argument("--signal-rank", type=int, default=0)
    parser.add_argument("--signal-name", choices=("SIGTERM", "SIGUSR1"), default="SIGTERM")
    parser.add_argument("--kill-in-checkpoint-at", type=int, default=0)
    ns, overrides = parser.parse_known_args()
    torch.set_num_threads(1)
    cfg = ArmConfig(arm="tiny")
    apply_overrides(cfg, overrides, where="driver")
    run_dir = ns.workdir / f"run-{ns.tag}"
    info = start_session(run_dir, cfg.run, cfg.batch)
    shard = PairShard(ns.workdir / "pairs.safetensors")
    ref = np.load(ns.workdir / "ref.npz")
    model = load_policy(ns.workdir / "base", cfg.model, info, cfg.trainer)
    adapter = DpoAdapter(
        DPOObjective.of(cfg.dpo),
        torch.from_numpy(ref["chosen"]),
        torch.from_numpy(ref["rejected"]),
    )
    trainer = build_trainer(
        model,
        shard,
        adapter,
        optim=cfg.optimizer,
        batch=cfg.batch,
        trainer=cfg.trainer,
        run_dir=run_dir,
        stage="dpo",
        info=info,
        stage_started=time.monotonic(),
    )
    if ns.kill_in_checkpoint_at:
        _kill_while_checkpointing(trainer, ns.kill_in_checkpoint_at)

    def on_step(metrics):
        at_step = ns.signal_at_step and trainer.state.step == ns.signal_at_step
        if at_step and info.rank == ns.signal_rank:
            target = os.getpid() if ns.signal_target == "self" else os.getppid()
            os.kill(target, getattr(signal, ns.signal_name))

    if info.is_main:
        write_json_atomic(run_dir / "precision.json", model.precision)
    trainer.fit(on_step=on_step)
    export_policy(model, info, ns.workdir / "base", ns.workdir / f"out-{ns.tag}")
    destroy_distributed()


def _kill_while_checkpointing(trainer, step: int) -> None:
    """SIGKILL this process after the shards are written, before the checkpoint is marked complete."""
    manager = trainer.checkpoints
    original = manager._mark_complete

    def mark_then_maybe_die(partial, final, micro_step):
        if trainer.state.step == step:
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        original(partial, final, micro_step)

    manager._mark_complete = mark_then_maybe_die


if __name__ == "__main__":
    run_with_exit_codes(main, "train_tiny")
