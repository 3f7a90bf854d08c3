"""The DPO stage's training and held-out evaluation of one arm.

Trains the policy from the SFT checkpoint against the cached reference log-probs,
and scores the SFT and final policies on the held-out pairs the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from align.config import ArmConfig
from align.data.loader import PairShard, step_rows
from align.eval.preference import implicit_reward_preference, policy_preference, score_pairs
from align.model.checkpoint import save_hf_checkpoint
from align.paths import ArmPaths
from align.train.adapters import DpoAdapter
from align.train.optim import build_optimizer, build_scheduler, training_horizon
from align.train.ref_cache import load_ref_cache
from align.train.sft_stage import load_policy
from align.train.trainer import Trainer


def _ref(path: Path, key: dict[str, str], shard: PairShard) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = load_ref_cache(path, key, shard.pair_ids)
    return torch.from_numpy(chosen), torch.from_numpy(rejected)


def run_dpo(
    cfg: ArmConfig,
    checkpoint: str,
    shards: dict[str, str],
    caches: dict[str, tuple[Path, dict]],
    paths: ArmPaths,
) -> dict[str, Any]:
    torch.manual_seed(cfg.batch.seed)
    train, held = PairShard(shards["train"]), PairShard(shards["held"])
    ref_train = _ref(*caches["train"], train)
    ref_held = _ref(*caches["held"], held)
    model = load_policy(checkpoint, cfg.model, cfg.run.device)
    eval_bs = cfg.eval.batch_size

    sft_c, sft_r = score_pairs(model, held, eval_bs, desc="eval sft")
    optimizer = build_optimizer(model, cfg.optimizer)
    horizon = training_horizon(len(train), cfg.batch)
    trainer = Trainer(
        model,
        DpoAdapter(cfg.dpo.beta, cfg.dpo.loss, *ref_train),
        optimizer,
        build_scheduler(optimizer, cfg.optimizer, horizon),
        cfg.optimizer.grad_clip,
        paths.metrics,
    )
    b = cfg.batch
    batches = (
        [train.collate(rows) for rows in step]
        for step in step_rows(len(train), b.seed, b.epochs, b.global_batch, b.micro_batch)
    )
    summary = trainer.fit(batches, horizon)
    pol_c, pol_r = score_pairs(model, held, eval_bs, desc="eval policy")
    save_hf_checkpoint(model, paths.policy_dir, tokenizer_dir=checkpoint)
    ref_c, ref_r = (t.numpy() for t in ref_held)
    return {
        "horizon_steps": horizon,
        "training": summary,
        "held_out": {
            "sft": policy_preference(sft_c, sft_r),
            "policy": policy_preference(pol_c, pol_r),
            "policy_implicit_reward": implicit_reward_preference(pol_c, pol_r, ref_c, ref_r),
            "mean_chosen_logp_change": float((pol_c - sft_c).mean()),
        },
    }
