"""The DPO stage of one arm: the throughput probe, or training and held-out evaluation.

Trains the policy from the SFT checkpoint against the reference cache the gates
chose, and scores the SFT and final policies on the held-out pairs the same way.
The probe runs the same set-up for `probe_steps` micro-steps and measures it.
"""

from __future__ import annotations

import copy
import dataclasses
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from align.config import ArmConfig
from align.data.loader import PairShard
from align.eval.preference import implicit_reward_preference, policy_preference, score_pairs
from align.exit_codes import ConfigError
from align.losses.dpo import DPOObjective
from align.paths import SPLITS
from align.train.adapters import DpoAdapter
from align.train.probes import probe_figures
from align.train.ref_cache import load_ref_cache
from align.train.session import build_trainer, export_policy, load_policy, start_session
from align.train.stage_gates import GateContext
from align.train.trainer import peak_rss_bytes
from align.train.tripwires import Alarm, Tripwires
from align.utils.dist import DistInfo, all_gather_floats, all_reduce_sum, any_rank, barrier


def _ref(path: Path, key: dict[str, str], shard: PairShard) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = load_ref_cache(path, key, shard.pair_ids)
    return torch.from_numpy(chosen), torch.from_numpy(rejected)


def dpo_objective_of(dpo) -> DPOObjective:
    return DPOObjective(
        beta=dpo.beta,
        loss=dpo.loss,
        label_smoothing=dpo.label_smoothing,
        rpo_alpha=dpo.rpo_alpha,
        length_normalize=dpo.length_normalize,
        rdpo_alpha=dpo.rdpo_alpha,
    )


def _setup(cfg: ArmConfig, ctx: GateContext, run_dir: Path, trainer_cfg):
    info = start_session(run_dir, cfg.run, cfg.batch)
    shards = {
        split: PairShard(ctx.entry["shards"][split]["path"], cfg.batch.share_prompt)
        for split in SPLITS
    }
    refs = {split: _ref(*ctx.caches[split], shards[split]) for split in SPLITS}
    model = load_policy(ctx.checkpoint, cfg.model, info, trainer_cfg)
    trainer = build_trainer(
        model,
        shards["train"],
        DpoAdapter(dpo_objective_of(cfg.dpo), *refs["train"]),
        optim=cfg.optimizer,
        batch=cfg.batch,
        trainer=trainer_cfg,
        run_dir=run_dir,
        stage="dpo",
        info=info,
    )
    return info, shards, refs, model, trainer


def local_device_peak_mb(info: DistInfo) -> float | None:
    """This rank's device peak (torch.cuda.max_memory_allocated), None off CUDA."""
    if info.device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(info.device) / 2**20


def job_peaks(local_device_mb: float | None) -> tuple[float, list[float]]:
    """Job-wide peak host RSS (the sum over ranks) and every rank's device peak, in MiB."""
    (rss,) = all_reduce_sum([peak_rss_bytes() / 2**20])
    return rss, ([] if local_device_mb is None else all_gather_floats(local_device_mb))


def run_probe(cfg: ArmConfig, ctx: GateContext) -> tuple[dict[str, Any], DistInfo]:
    probe_cfg = dataclasses.replace(
        cfg.trainer, max_micro_steps=cfg.trainer.probe_steps, resume=False, checkpoint_every=0
    )
    info, _, _, model, trainer = _setup(cfg, ctx, ctx.arm.root / "probe_run", probe_cfg)
    tokens_per_s: list[float] = []
    trainer.fit(on_step=lambda m: tokens_per_s.append(m["tokens_per_s"]))
    checkpoint_s = timed_save(trainer)
    rss, device_peaks = job_peaks(local_device_peak_mb(info))
    projected = ctx.projection.get("device", {}).get("allocated_mb")
    figures = probe_figures(
        trainer.state.step_times,
        tokens_per_s,
        trainer.state.micro_step,
        len(trainer.source),
        rss,
        device_peaks,
        projected,
    )
    placed = {"precision": model.precision, "devices": list(info.devices)}
    return {**figures, "checkpoint_s": checkpoint_s, **placed}, info


def timed_save(trainer) -> float:
    """Seconds one real checkpoint of this model and optimizer takes to save; the probe's
    checkpoint is removed after, as nothing resumes from it."""
    started = time.perf_counter()
    checkpoint = trainer.save()
    seconds = time.perf_counter() - started
    barrier()
    if trainer.info.is_main:
        shutil.rmtree(checkpoint.path)
    return seconds


def banner(cfg: ArmConfig, ctx: GateContext, model, info: DistInfo) -> str:
    """What is about to train, read off the running objects rather than the config."""
    counts = ctx.entry["counts"]
    rows = [
        ("arm", cfg.arm),
        ("checkpoint", f"{ctx.checkpoint} ({ctx.checkpoint_weights[:12]})"),
        ("pairs", f"train {counts['train']}, held {counts['held']}"),
        (
            "cache",
            f"{ctx.caches['train'][1]['forward_impl']} shard {ctx.caches['train'][1]['shard'][:12]}",
        ),
        ("path bias", f"ratio {ctx.path_bias['ratio']:.3f} -> {ctx.path_bias['action']}"),
        (
            "RSS projection",
            f"{ctx.projection['total_mb']:.0f} MiB for {ctx.projection['optimizer']}",
        ),
        ("attention", model.attn_implementation),
        (
            "precision",
            f"compute {model.precision['compute']}, master {model.precision['master']}, "
            f"reduce {model.precision['reduce']}, loss head {model.precision['loss']}",
        ),
        ("world size", str(info.world_size)),
        (
            "projected wall",
            f"{ctx.probe['projected_wall_s']:.0f} s (probe median {ctx.probe['median_step_s']:.3f} s/step)",
        ),
    ]
    return "\n".join(f"  {name:<15} {value}" for name, value in rows)


class TripwireAlarm(Exception):
    """Raised on every rank together when an armed tripwire fires."""

    def __init__(self, alarms: list[Alarm]):
        super().__init__(
            ", ".join(f"{a.name} at step {a.step} ({a.value:.4f} outside {a.band})" for a in alarms)
        )
        self.alarms = alarms


def chosen_longer_baseline(shard: PairShard) -> float:
    """Among pairs whose responses differ in length, the fraction where chosen is longer."""
    a = shard.arrays
    chosen, rejected = a["chosen_len"] - a["prompt_len"], a["rejected_len"] - a["prompt_len"]
    unequal = chosen != rejected
    return float((chosen[unequal] > rejected[unequal]).mean()) if unequal.any() else 0.5


def with_response(cfg: ArmConfig) -> tuple[ArmConfig, dict[str, Any]]:
    """The arm's configuration for its one rerun: the pre-registered response applied."""
    response = {
        k: v for k, v in dataclasses.asdict(cfg.tripwires.response).items() if v is not None
    }
    if not response:
        raise ConfigError(
            f"arm {cfg.arm}: a tripwire fired but tripwires.response pre-registers no change"
        )
    rerun = copy.deepcopy(cfg)
    targets = {
        "lr": (rerun.optimizer, "lr"),
        "beta": (rerun.dpo, "beta"),
        "rpo_alpha": (rerun.dpo, "rpo_alpha"),
    }
    for key, value in response.items():
        obj, name = targets[key]
        if not hasattr(obj, name):
            raise ConfigError(
                f"tripwires.response.{key} is not supported by dpo.loss={cfg.dpo.loss!r}"
            )
        setattr(obj, name, value)
    return rerun, response


def _train_once(cfg: ArmConfig, ctx: GateContext, run_dir: Path) -> dict[str, Any]:
    info, shards, refs, model, trainer = _setup(cfg, ctx, run_dir, cfg.trainer)
    tripwires = Tripwires.armed(cfg.tripwires, chosen_longer_baseline(shards["train"]))
    shown: list[str] = []

    def on_step(metrics: dict[str, Any]) -> None:
        tripwires.update(trainer.adapter.pair_stats)
        trainer.adapter.pair_stats.clear()
        alarms = tripwires.check(metrics["step"], any_rank)
        if not shown and trainer.state.micro_step >= cfg.trainer.probe_steps:
            shown.append(banner(cfg, ctx, model, info))
            if info.is_main:
                print(f"align dpo: banner\n{shown[0]}", file=sys.stderr, flush=True)
        if alarms:
            raise TripwireAlarm(alarms)

    run = {
        "info": info,
        "model": model,
        "shards": shards,
        "refs": refs,
        "banner": None,
        "alarms": [],
    }
    try:
        run["summary"] = trainer.fit(on_step=on_step)
    except TripwireAlarm as alarm:
        run["alarms"] = [a.as_dict() for a in alarm.alarms]
        run["summary"] = trainer.summary()
        if info.is_main:
            print(f"align dpo: tripwire fired: {alarm}", file=sys.stderr, flush=True)
    run["banner"] = shown[0] if shown else None
    run["signals"], run["bands"] = tripwires.signals, tripwires.bands()
    return run


def run_dpo(cfg: ArmConfig, ctx: GateContext) -> tuple[dict[str, Any], DistInfo]:
    """Train the arm; on an alarm rerun once from SFT with the pre-registered response."""
    first = _train_once(cfg, ctx, ctx.arm.run_dir)
    final, final_cfg, response = first, cfg, None
    if first["alarms"]:
        final_cfg, response = with_response(cfg)
        final = _train_once(final_cfg, ctx, ctx.arm.run_dir / "rerun")
    info, model, held = final["info"], final["model"], final["shards"]["held"]
    eval_bs = cfg.eval.batch_size
    sft_model = load_policy(ctx.checkpoint, cfg.model, info)
    sft_c, sft_r = score_pairs(sft_model, held, eval_bs, info, desc="eval sft")
    pol_c, pol_r = score_pairs(model, held, eval_bs, info, desc="eval policy")
    export_policy(model, info, ctx.checkpoint, ctx.arm.policy_dir)
    ref_c, ref_r = (t.numpy() for t in final["refs"]["held"])
    figures: dict[str, Any] = {
        "world_size": info.world_size,
        "precision": model.precision,
        "devices": list(info.devices),
        "banner": final["banner"] or first["banner"],
        "training": final["summary"],
        "final_config": {
            "lr": final_cfg.optimizer.lr,
            "beta": final_cfg.dpo.beta,
            "rpo_alpha": final_cfg.dpo.rpo_alpha,
        },
        "held_out": {
            "sft": policy_preference(sft_c, sft_r),
            "policy": policy_preference(pol_c, pol_r),
            "policy_implicit_reward": implicit_reward_preference(pol_c, pol_r, ref_c, ref_r),
            "mean_chosen_logp_change": float((pol_c - sft_c).mean()),
        },
    }
    tripwire = {
        "alarms": first["alarms"],
        "rerun": bool(first["alarms"]),
        "response": response,
        "first_run": first["summary"] if first["alarms"] else None,
        "rerun_alarms": final["alarms"] if first["alarms"] else [],
        "ended_by_tripwire": bool(first["alarms"] and final["alarms"]),
        "signals": final["signals"],
        "bands": final["bands"],
        "first_run_signals": first["signals"] if first["alarms"] else None,
    }
    return {**figures, "tripwire": tripwire}, info
