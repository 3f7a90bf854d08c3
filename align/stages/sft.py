"""The SFT stage and its section-11 quality gate.

`run_sft` trains the starting policy from the base model with token-mean NLL and
exports it in HF format. `evaluate_sft_gate` measures held-out NLL and greedy
generations of a checkpoint against the pre-registered thresholds.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from align.config import SftConfig
from align.data.loader import SftShard
from align.data.sft import tokenize_sft_splits
from align.eval.generation import greedy_generate_batch
from align.eval.nll import mean_nll
from align.model.tokenizer import load_tokenizer
from align.paths import RunPaths
from align.stages.phase_stops import EVALUATE, EXPORT, PhaseStops, Trained, resume_evaluation
from align.train.adapters import SftAdapter
from align.train.phases import PhaseMeter
from align.train.session import build_trainer, export_policy, load_policy, start_session
from align.utils.dist import barrier
from align.utils.weights_hash import weights_fingerprint


def run_sft(
    cfg: SftConfig,
    paths: RunPaths,
    stage_started: float,
    projection: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train from the base model and export, or on a retry after a stop in export or
    evaluation, reload the export; then the held-out NLL. A stop after training ends at the
    next phase boundary or batch (exit 75)."""
    info = start_session(paths.sft_run_dir, cfg.run, cfg.batch)
    meter = PhaseMeter(info.device.type)
    tokenizer = load_tokenizer(cfg.run.base_model)
    arrays, removed = tokenize_sft_splits(cfg.data, tokenizer)
    train, held = SftShard(arrays["train"]), SftShard(arrays["held"])
    marker, policy = paths.sft_stop_marker, paths.recorded(paths.sft_checkpoint)
    figures: dict[str, Any] = {}
    with PhaseStops("sft", marker, policy) as stops:
        trained = Trained.read_before(paths.sft_run_dir, cfg.trainer.resume)
        if trained is None:
            model, summary = train_and_export(cfg, paths, info, train, meter, stage_started)
            stops.stop_if_requested(EXPORT)
        else:
            summary = trained.training
            figures["evaluation_resumed_after"] = resume_evaluation(
                "sft", paths.sft_checkpoint, trained.policy_fingerprint, marker
            )
            with meter.phase("load"):
                model = load_policy(paths.sft_checkpoint, cfg.model, info)
        between = functools.partial(stops.stop_if_requested, EVALUATE)
        with meter.phase("evaluate"):
            held_nll = mean_nll(model, held, cfg.eval.batch_size, info, between)
    return {
        "world_size": info.world_size,
        "train_rows": len(train),
        "held_rows": len(held),
        "removed_rows": removed,
        "training": summary,
        "held_nll": held_nll,
        "precision": model.precision,
        "devices": list(info.devices),
        **figures,
        "phases": meter.report(projection),
    }, info


def train_and_export(
    cfg: SftConfig, paths: RunPaths, info, train, meter: PhaseMeter, stage_started: float
):
    """The trained policy, exported, and what training recorded beside the export."""
    with meter.phase("load"):
        model = load_policy(cfg.run.base_model, cfg.model, info, cfg.trainer)
    trainer = build_trainer(
        model,
        train,
        SftAdapter(),
        optim=cfg.optimizer,
        batch=cfg.batch,
        trainer=cfg.trainer,
        run_dir=paths.sft_run_dir,
        stage="sft",
        info=info,
        stage_started=stage_started,
    )
    with meter.phase("train"):
        summary = trainer.fit()
    del trainer  # its optimizer state; export and evaluation need only the model
    with meter.phase("export"):
        export_policy(model, info, cfg.run.base_model, paths.sft_checkpoint)
        barrier()  # rank 0 writes the export; its fingerprint is read below
    Trained(summary, weights_fingerprint(paths.sft_checkpoint)).write(paths.sft_run_dir)
    return model, summary


def evaluate_sft_gate(
    cfg: SftConfig, checkpoint: Path, run_dir: Path, projection: dict[str, Any]
) -> dict[str, Any]:
    """Held-out NLL and greedy-generation sanity of `checkpoint`, with pass/fail per check."""
    info = start_session(run_dir, cfg.run, None)
    meter = PhaseMeter(info.device.type)
    tokenizer = load_tokenizer(checkpoint)
    held = SftShard(tokenize_sft_splits(cfg.data, tokenizer)[0]["held"])
    with meter.phase("load"):
        model = load_policy(checkpoint, cfg.model, info)
    a = held.arrays
    prompts = [
        a["ids"][row, : a["prompt_len"][row]].tolist()
        for row in range(min(cfg.gate.generation_check.prompts, len(held)))
    ]
    with meter.phase("evaluate"):
        nll = mean_nll(model, held, cfg.eval.batch_size, info)
        decoded = greedy_generate_batch(
            model,
            prompts,
            cfg.gate.generation_check.max_new_tokens,
            tokenizer.eos_id,
            tokenizer.pad_id,
            info.device,
        )
    generations = [
        {
            "prompt": tokenizer.decode(prompt),
            "text": tokenizer.decode(new),
            "terminated": terminated,
        }
        for prompt, (new, terminated) in zip(prompts, decoded, strict=True)
    ]
    terminated = sum(g["terminated"] for g in generations) / len(generations)
    non_empty = all(g["text"].strip() for g in generations)
    checks = {
        "held_nll": {
            "value": nll,
            "max": cfg.gate.max_held_nll,
            "passed": nll <= cfg.gate.max_held_nll,
        },
        "generations_non_empty": {"value": non_empty, "passed": non_empty},
        "generations_terminated": {
            "value": terminated,
            "min": cfg.gate.min_terminated_fraction,
            "passed": terminated >= cfg.gate.min_terminated_fraction,
        },
    }
    return {
        "checks": checks,
        "generations": generations,
        "passed": all(c["passed"] for c in checks.values()),
        "precision": model.precision,
        "devices": list(info.devices),
        "phases": meter.report(projection),
    }
