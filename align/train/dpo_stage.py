"""The DPO stage's training and held-out evaluation of one arm.

Trains the policy from the SFT checkpoint against the cached reference log-probs,
and scores the SFT and final policies on the held-out pairs the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from align.config import ArmConfig
from align.data.loader import PairShard
from align.eval.preference import implicit_reward_preference, policy_preference, score_pairs
from align.paths import ArmPaths
from align.train.adapters import DpoAdapter
from align.train.ref_cache import load_ref_cache
from align.train.session import build_trainer, export_policy, load_policy, start_session


def _ref(path: Path, key: dict[str, str], shard: PairShard) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = load_ref_cache(path, key, shard.pair_ids)
    return torch.from_numpy(chosen), torch.from_numpy(rejected)


def run_dpo(
    cfg: ArmConfig,
    checkpoint: str,
    shards: dict[str, str],
    caches: dict[str, tuple[Path, dict]],
    paths: ArmPaths,
):
    info = start_session(paths.run_dir, cfg.run, cfg.batch)
    train, held = PairShard(shards["train"]), PairShard(shards["held"])
    ref_train = _ref(*caches["train"], train)
    ref_held = _ref(*caches["held"], held)
    model = load_policy(checkpoint, cfg.model, info, cfg.trainer)
    eval_bs = cfg.eval.batch_size

    sft_c, sft_r = score_pairs(model, held, eval_bs, info, desc="eval sft")
    trainer = build_trainer(
        model,
        train,
        DpoAdapter(cfg.dpo.beta, cfg.dpo.loss, *ref_train),
        optim=cfg.optimizer,
        batch=cfg.batch,
        trainer=cfg.trainer,
        run_dir=paths.run_dir,
        stage="dpo",
        info=info,
    )
    summary = trainer.fit()
    pol_c, pol_r = score_pairs(model, held, eval_bs, info, desc="eval policy")
    export_policy(model, info, checkpoint, paths.policy_dir)
    ref_c, ref_r = (t.numpy() for t in ref_held)
    figures: dict[str, Any] = {
        "world_size": info.world_size,
        "training": summary,
        "held_out": {
            "sft": policy_preference(sft_c, sft_r),
            "policy": policy_preference(pol_c, pol_r),
            "policy_implicit_reward": implicit_reward_preference(pol_c, pol_r, ref_c, ref_r),
            "mean_chosen_logp_change": float((pol_c - sft_c).mean()),
        },
    }
    return figures, info
