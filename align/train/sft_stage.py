"""The SFT stage and its section-11 quality gate.

`run_sft` trains the starting policy from the base model with token-mean NLL and
exports it in HF format. `evaluate_sft_gate` measures held-out NLL and greedy
generations of a checkpoint against the pre-registered thresholds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from align.config import SftConfig
from align.data.loader import SftShard, step_rows
from align.data.sft import tokenize_sft_splits
from align.eval.generation import greedy_generate
from align.eval.nll import mean_nll
from align.model import load_pretrained
from align.model.checkpoint import save_hf_checkpoint
from align.model.tokenizer import load_tokenizer
from align.paths import RunPaths
from align.train.adapters import SftAdapter
from align.train.optim import build_optimizer, build_scheduler, training_horizon
from align.train.trainer import Trainer


def load_policy(path: str | Path, model_cfg, device: str):
    return load_pretrained(
        path,
        device=device,
        dtype=getattr(torch, model_cfg.dtype),
        attn_implementation=model_cfg.attn_implementation,
    )


def run_sft(cfg: SftConfig, paths: RunPaths) -> dict[str, Any]:
    torch.manual_seed(cfg.batch.seed)
    tokenizer = load_tokenizer(cfg.run.base_model)
    arrays = tokenize_sft_splits(cfg.data, tokenizer)
    train, held = SftShard(arrays["train"]), SftShard(arrays["held"])
    model = load_policy(cfg.run.base_model, cfg.model, cfg.run.device)
    optimizer = build_optimizer(model, cfg.optimizer)
    horizon = training_horizon(len(train), cfg.batch)
    trainer = Trainer(
        model,
        SftAdapter(),
        optimizer,
        build_scheduler(optimizer, cfg.optimizer, horizon),
        cfg.optimizer.grad_clip,
        paths.sft_run_dir / "metrics.jsonl",
    )
    batches = (
        [train.collate(rows) for rows in step]
        for step in step_rows(
            len(train),
            cfg.batch.seed,
            cfg.batch.epochs,
            cfg.batch.global_batch,
            cfg.batch.micro_batch,
        )
    )
    summary = trainer.fit(batches, horizon)
    save_hf_checkpoint(model, paths.sft_checkpoint, tokenizer_dir=cfg.run.base_model)
    return {
        "train_rows": len(train),
        "held_rows": len(held),
        "horizon_steps": horizon,
        "training": summary,
        "held_nll": mean_nll(model, held, cfg.eval.batch_size),
    }


def evaluate_sft_gate(cfg: SftConfig, checkpoint: Path) -> dict[str, Any]:
    """Held-out NLL and greedy-generation sanity of `checkpoint`, with pass/fail per check."""
    tokenizer = load_tokenizer(checkpoint)
    held = SftShard(tokenize_sft_splits(cfg.data, tokenizer)["held"])
    model = load_policy(checkpoint, cfg.model, cfg.run.device)
    nll = mean_nll(model, held, cfg.eval.batch_size)
    generations = []
    a = held.arrays
    for row in range(min(cfg.gate.generation_prompts, len(held))):
        prompt = a["ids"][row, : a["prompt_len"][row]].tolist()
        new, terminated = greedy_generate(model, prompt, cfg.gate.max_new_tokens, tokenizer.eos_id)
        generations.append(
            {
                "prompt": tokenizer.decode(prompt),
                "text": tokenizer.decode(new),
                "terminated": terminated,
            }
        )
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
    }
