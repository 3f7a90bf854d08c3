"""align's Trainer trains as TRL's DPOTrainer does, step for step, from the same checkpoint.

Both sides start from one tiny random Mistral checkpoint (transformers' MistralForCausalLM
for TRL; align's model, FSDP2 on one gloo rank, loaded from the same files), train in
float32 for STEPS optimizer steps on the same pairs in the same order, two micro-batches of
unequal widths accumulated per step, against the same reference log-probs (TRL's
precomputed ones, handed to align), with the same AdamW, clip and cosine schedule. Each
step's loss, gradient norm, learning rate and the DPO metrics both log, then every final
weight, must agree to float32 summation order. A weight-decay case holds align to
transformers' grouping (norm weights and biases undecayed).

The schedule has no warmup: align's warmup runs step s at (s + 1) / warmup_steps of lr,
transformers' at s / warmup_steps, and no transformers scheduler pairs either with the
cosine's min_lr end; the cosine to MIN_LR_RATIO itself is transformers' cosine_with_min_lr.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset
from tiny_models import TINY_SIZES
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

from align.config import BatchConfig, ModelConfig, OptimizerConfig, TrainerConfig
from align.data.loader import PairShard
from align.data.sampler import StepSampler
from align.data.shards import PAIR_FORMAT, pair_arrays, write_shard
from align.data.tokenize import TokenizedPair
from align.losses.dpo import DPOObjective
from align.model.checkpoint import hf_to_nmo
from align.model.tiny import make_tiny_model
from align.model.tokenizer import train_bpe_tokenizer
from align.train.adapters import DpoAdapter
from align.train.fsdp import gather_full_state
from align.train.session import build_trainer, load_policy

# Matrices of a few dozen rows: thread hand-offs would cost more than the arithmetic.
torch.set_num_threads(1)

STEPS = 10
MICRO, ACCUM = 2, 2
BATCH = BatchConfig(micro_batch=MICRO, grad_accum=ACCUM, global_batch=MICRO * ACCUM, seed=0)
PAIRS = STEPS * BATCH.global_batch
# Large enough that ten steps move every weight far beyond the tolerances below.
LR = 1e-3
BETAS = (0.9, 0.95)
EPS = 1e-8
BETA = 0.1
GRAD_CLIP = 1.0
MIN_LR_RATIO = 0.1
# float32 on both sides; what differs is summation order (padding widths, TRL's fused
# lm_head, foreach AdamW on shards vs on whole tensors), ~1e-7 relative per operation. An
# earlier comparison of these trainers found loss, metrics and lr within 2e-6 and final
# weights within 6e-7 relative L2; here the worst are 5e-7 (loss, grad norm, log-probs)
# and 1e-6 (weights), and the bounds leave 5-20x that. Rewards are beta x (log-prob -
# reference), differences of ~50-nat sums near 0: their rounding is absolute, ~6e-7 at
# worst. Decaying the norm weights moves them ~1e-4 relative, far outside these bounds.
RELATIVE = {"rel": 1e-5, "abs": 0.0}
REWARD_ABSOLUTE = {"rel": 0.0, "abs": 5e-6}
WEIGHT_TOLERANCE = 5e-6  # per tensor: |align - TRL| / |TRL|, L2
# What training must have moved each tensor by (relative L2; the least moved, the norm
# weights, move ~2.6e-3), so agreement is not idle.
MOVED = 1e-3
ROOT = ("embed.weight", "norm.weight", "lm_head.weight")
# Of the DPO metrics both trainers log under the same names, beside the log-probs
# (accuracies are left out: at step 0 policy and reference agree to rounding, so their
# 0/1 comparisons are noise).
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins")

CASES = {
    # name: (loss, weight decay)
    "sigmoid": ("sigmoid", 0.0),
    "ipo": ("ipo", 0.0),
    "sigmoid-weight-decay": ("sigmoid", 0.1),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """`base/` (an HF checkpoint with its tokenizer), the pairs as align's shard and as
    TRL's token-id rows."""
    work = tmp_path_factory.mktemp("parity")
    texts = [f"{a} plus {b} is {a + b}." for a in range(10) for b in range(10)]
    train_bpe_tokenizer(texts, 300, work / "tok")
    make_tiny_model(work / "base", work / "tok", seed=3, **TINY_SIZES)
    config = json.loads((work / "base" / "config.json").read_text())
    special = {config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    words = np.array([i for i in range(config["vocab_size"]) if i not in special])
    rng = np.random.default_rng(0)

    def draw(low: int, high: int) -> list[int]:
        return rng.choice(words, int(rng.integers(low, high))).tolist()

    # Prompts of 2-7 tokens and responses of 1-19: every micro-batch pads, each to its own width.
    pairs = [TokenizedPair(draw(2, 8), draw(1, 20), draw(1, 20), False) for _ in range(PAIRS)]
    write_shard(
        work / "pairs.safetensors",
        pair_arrays(range(PAIRS), pairs, config["pad_token_id"]),
        PAIR_FORMAT,
    )
    rows = [
        {"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected} for p in pairs
    ]
    (work / "pairs.json").write_text(json.dumps(rows))
    return work


def training_order() -> np.ndarray:
    """The rows align's sampler trains on, micro-batch after micro-batch."""
    sampler = StepSampler(PAIRS, BATCH, rank=0, world_size=1)
    return np.concatenate([rows for step in range(STEPS) for rows in sampler.rank_rows(step)])


class PretokenizedDPOTrainer(DPOTrainer):
    """Takes prompt_ids / chosen_ids / rejected_ids as they are: the ids align trains on."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset


def hf_names_as_align(names) -> list[str]:
    return list(hf_to_nmo(dict.fromkeys(names, torch.empty(0))))


def run_trl(work: Path, out: Path, loss: str, weight_decay: float) -> dict:
    """TRL's per-step logs, final weights (align's names), optimizer groups and the
    reference log-probs it precomputed, by align row."""
    order = training_order()
    rows = json.loads((work / "pairs.json").read_text())
    args = DPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        # Micro-batch k is rows 2k, 2k + 1 of the dataset, which is laid out in align's order.
        train_sampling_strategy="sequential",
        learning_rate=LR,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO},
        warmup_steps=0,
        optim="adamw_torch",
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        adam_epsilon=EPS,
        weight_decay=weight_decay,
        max_grad_norm=GRAD_CLIP,
        beta=BETA,
        loss_type=[loss],
        max_length=None,
        # TRL's defaults are bf16 autocast and gradient checkpointing; align runs neither here.
        bf16=False,
        activation_checkpointing=False,
        precompute_ref_log_probs=True,
        precompute_ref_batch_size=MICRO,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(
        work / "base", dtype=torch.float32, attn_implementation="sdpa"
    )
    trainer = PretokenizedDPOTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list([rows[i] for i in order]),
        processing_class=PreTrainedTokenizerFast.from_pretrained(work / "base"),
    )
    # One process, no data parallelism: nothing between the two sides but the trainers.
    assert trainer.accelerator.num_processes == 1
    ref = {}
    for side in ("chosen", "rejected"):
        by_row = torch.empty(PAIRS)
        by_row[order] = torch.tensor(trainer.train_dataset[f"ref_{side}_logps"])
        ref[side] = by_row
    trainer.train()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    groups = [
        {
            "weight_decay": group["weight_decay"],
            "params": set(hf_names_as_align(names[id(p)] for p in group["params"])),
        }
        for group in trainer.optimizer.param_groups
    ]
    steps = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
    final = hf_to_nmo({n: p.detach().clone() for n, p in trainer.model.named_parameters()})
    return {"steps": steps, "final": final, "groups": groups, "ref": ref}


def run_align(work: Path, out: Path, info, loss: str, weight_decay: float, ref) -> dict:
    model = load_policy(
        work / "base", ModelConfig(dtype="float32", attn_implementation="sdpa"), info
    )
    optim = OptimizerConfig(
        lr=LR,
        weight_decay=weight_decay,
        betas=list(BETAS),
        eps=EPS,
        warmup_steps=0,
        min_lr_ratio=MIN_LR_RATIO,
        grad_clip=GRAD_CLIP,
    )
    trainer = build_trainer(
        model,
        PairShard(work / "pairs.safetensors"),
        DpoAdapter(DPOObjective(beta=BETA, loss=loss), ref["chosen"], ref["rejected"]),
        optim=optim,
        batch=BATCH,
        trainer=TrainerConfig(),
        run_dir=out,
        stage="dpo",
        info=info,
        stage_started=time.monotonic(),
    )
    assert np.array_equal(
        np.concatenate([r for s in range(STEPS) for r in trainer.source.sampler.rank_rows(s)]),
        training_order(),
    )
    initial = {n: t.clone() for n, t in gather_full_state(model).items()}
    steps: list[dict] = []
    trainer.fit(on_step=steps.append)
    return {
        "steps": steps,
        "initial": initial,
        "final": gather_full_state(model),
        "summary": trainer.summary(),
    }


def relative_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_align_trains_as_trls_dpo_trainer_step_for_step(case, work, info, tmp_path):
    loss, weight_decay = case
    trl = run_trl(work, tmp_path / "trl", loss, weight_decay)
    mine = run_align(work, tmp_path / "align", info, loss, weight_decay, trl["ref"])

    assert len(trl["steps"]) == len(mine["steps"]) == STEPS
    for step, (theirs, ours) in enumerate(zip(trl["steps"], mine["steps"], strict=True)):
        pairs = [("loss", "loss"), ("grad_norm", "grad_norm"), ("learning_rate", "lr")]
        pairs += [(name, name) for name in ("logps/chosen", "logps/rejected")]
        for trl_name, name in pairs:
            assert ours[name] == pytest.approx(theirs[trl_name], **RELATIVE), (step, name)
        for name in REWARDS:
            assert ours[name] == pytest.approx(theirs[name], **REWARD_ABSOLUTE), (step, name)
    # The cosine reached its floor's side of the horizon; the norm was clipped on some steps.
    assert mine["steps"][-1]["lr"] < 0.2 * LR
    assert max(s["grad_norm"] for s in mine["steps"]) > GRAD_CLIP

    final, initial = mine["final"], mine["initial"]
    assert final.keys() == trl["final"].keys() == initial.keys()
    for name, weight in final.items():
        assert relative_l2(weight, trl["final"][name]) <= WEIGHT_TOLERANCE, name
        # Every tensor trained, the root's (embed, norm, lm_head) among them.
        assert relative_l2(weight, initial[name]) > MOVED, name
    assert set(ROOT) <= final.keys()

    # The summary the stage receipts carry holds TRL's groups, read off the live optimizer.
    recorded = mine["summary"]["optimizer"]["param_groups"]
    assert [{**g, "params": set(g["params"])} for g in recorded] == trl["groups"]
    assert [g["weight_decay"] for g in recorded] == [weight_decay, 0.0]
    undecayed = set(recorded[1]["params"])
    assert undecayed == {n for n in final if n.endswith("norm.weight")}
