"""Reference log-probs from the cache vs from a live reference model, on CPU.

Builds a Mistral a few times larger than the embedded tiny default (by default H=384,
6 layers, ~10M parameters, a BPE vocabulary of at most --vocab tokens trained on the
synthetic default data: 518 with the defaults) and a shard of random pairs, then
measures, on one process:

  precompute  tokens/s of the resumable precompute (align.stages.ref_precompute: slices,
              part files, merge), next to plain scoring of the same rows in one pass
              (align.eval.preference.score_pairs), so the cost of resumability shows
  dpo step    optimizer-step time of the real Trainer (DpoAdapter, AdamW) with the
              reference log-probs from the cache, vs with a live reference: a second,
              frozen copy of the model scored under no_grad on every micro-batch

The two DPO configurations train their own copy of the policy from the same weights,
their steps alternate so that load from other processes falls on both alike, and the
first step of each is a warm-up. Tables show medians of wall time (the Trainer's
step_time_s) and of CPU time (process_time), which is steadier on shared cores.

Run: .venv/bin/python benchmarks/ref_cache.py   (about a minute on two idle cores)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from align.config import (
    BatchConfig,
    ModelConfig,
    OptimizerConfig,
    RefConfig,
    RunConfig,
    TrainerConfig,
)
from align.data.loader import PairShard
from align.data.shards import PAIR_FORMAT, write_shard
from align.data.synthetic import default_texts, write_default_data
from align.eval.logprobs import sequence_logps
from align.eval.preference import score_pairs
from align.losses.dpo import DPOObjective
from align.model.tiny import make_tiny_model
from align.model.tokenizer import train_bpe_tokenizer
from align.stages.ref_precompute import precompute_ref_caches
from align.train.adapters import DpoAdapter
from align.train.ref_cache import expected_key, ref_forward_impl
from align.train.session import build_trainer, load_policy, start_session


class LiveReferenceAdapter(DpoAdapter):
    """DPO against a frozen reference model scored on each micro-batch (no cache)."""

    def __init__(self, objective: DPOObjective, reference, n_pairs: int):
        super().__init__(objective, torch.zeros(n_pairs), torch.zeros(n_pairs))
        self.reference = reference

    def loss(self, model, batch, denominator):
        with torch.no_grad():
            logps = sequence_logps(self.reference, batch)
        rows, b = torch.from_numpy(batch.rows), len(batch.rows)
        self.ref_chosen[rows], self.ref_rejected[rows] = logps[:b], logps[b:]
        return super().loss(model, batch, denominator)


def build_model(root: Path, args) -> Path:
    data = write_default_data(root / "data", seed=0, n_argilla=300, n_steppairs=300, n_sft=300)
    tokenizer = train_bpe_tokenizer(list(default_texts(data)), args.vocab, root / "tok")
    return make_tiny_model(
        root / "model",
        tokenizer,
        seed=0,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
    )


def build_shard(path: Path, n: int, seq_len: int, vocab: int) -> Path:
    """Random pairs: prompts of a quarter to half the length, responses filling up to seq_len."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(seq_len // 4, seq_len // 2, n).astype(np.int32)
    arrays = {
        "pair_id": np.arange(n, dtype=np.int64),
        "prompt_len": prompt,
        "chosen_len": rng.integers(prompt + 8, seq_len + 1).astype(np.int32),
        "rejected_len": rng.integers(prompt + 8, seq_len + 1).astype(np.int32),
        "chosen_ids": rng.integers(4, vocab, (n, seq_len)).astype(np.int32),
        "rejected_ids": rng.integers(4, vocab, (n, seq_len)).astype(np.int32),
    }
    write_shard(path, arrays, PAIR_FORMAT)
    return path


def measure_precompute(checkpoint, shard_path, root, args, reference, info) -> dict:
    ref = RefConfig(batch_size=args.ref_batch, slice_pairs=args.slice_pairs)
    impl = ref_forward_impl(ref)
    key = expected_key(
        checkpoint, shard_path, args.seq_len, "prompt_left_response_right", "float32", impl
    )
    shard = PairShard(shard_path)
    tokens = int(shard.arrays["chosen_len"].sum() + shard.arrays["rejected_len"].sum())
    sliced, plain = [], []
    for repeat in range(args.precompute_repeats):
        out = root / f"cache-{repeat}" / "train.safetensors"
        figures, _ = precompute_ref_caches(
            checkpoint, [(str(shard_path), out, key)], ref, RunConfig(threads=args.threads), root
        )
        sliced.append(figures["train"]["tokens_per_s"])
        started = time.perf_counter()
        score_pairs(reference, shard, ref.batch_size, info, desc="plain")
        plain.append(tokens / (time.perf_counter() - started))
    return {
        "pairs": len(shard),
        "tokens": tokens,
        "slices": figures["train"]["slices"],
        "sliced": statistics.median(sliced),
        "plain": statistics.median(plain),
    }


def measure_dpo(checkpoint, shard_path, root, args, reference, info) -> dict:
    shard = PairShard(shard_path)
    micro = args.micro_batch
    batch = BatchConfig(
        world_size=1, micro_batch=micro, grad_accum=2, global_batch=2 * micro, epochs=1
    )
    objective = DPOObjective(beta=0.1)
    cached_ref = precompute_cache_values(reference, shard, args.ref_batch, info)
    adapters = {
        "cached": DpoAdapter(objective, *cached_ref),
        "live": LiveReferenceAdapter(objective, reference, len(shard)),
    }
    trainers = {
        name: build_trainer(
            load_policy(checkpoint, ModelConfig(), info),
            shard,
            adapter,
            optim=OptimizerConfig(lr=1e-5),
            batch=batch,
            trainer=TrainerConfig(),
            run_dir=root / f"run-{name}",
            stage="dpo",
            info=info,
            stage_started=time.monotonic(),
        )
        for name, adapter in adapters.items()
    }
    walls = {name: [] for name in trainers}
    cpus = {name: [] for name in trainers}
    tokens = {name: [] for name in trainers}
    for step in range(args.steps + 1):
        for name, trainer in trainers.items():
            cpu = time.process_time()
            metrics = trainer.train_step()
            if step == 0:
                continue  # warm-up
            cpus[name].append(time.process_time() - cpu)
            walls[name].append(metrics["step_time_s"])
            tokens[name].append(metrics["tokens_per_s"])
    return {
        name: {
            "wall": statistics.median(walls[name]),
            "cpu": statistics.median(cpus[name]),
            "tokens_per_s": statistics.median(tokens[name]),
        }
        for name in trainers
    }


def precompute_cache_values(reference, shard, batch_size, info) -> tuple[torch.Tensor, ...]:
    chosen, rejected = score_pairs(reference, shard, batch_size, info, desc="cache")
    return torch.from_numpy(chosen), torch.from_numpy(rejected)


def main(args) -> None:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="align-ref-bench-") as tmp:
        root = Path(tmp)
        checkpoint = build_model(root, args)
        info = start_session(root, RunConfig(threads=args.threads), None)
        reference = load_policy(checkpoint, ModelConfig(), info)
        for p in reference.parameters():
            p.requires_grad_(False)
        vocab = reference.config.vocab_size
        params = sum(p.numel() for p in reference.parameters())
        shard_path = build_shard(root / "pairs.safetensors", args.pairs, args.seq_len, vocab)
        print(
            f"Mistral H={args.hidden} I={args.intermediate} L={args.layers} heads={args.heads}/"
            f"{args.kv_heads} V={vocab} ({params / 1e6:.1f}M params), {args.pairs} pairs, "
            f"seq_len {args.seq_len}, float32 CPU, {torch.get_num_threads()} threads"
        )
        pre = measure_precompute(checkpoint, shard_path, root, args, reference, info)
        print(
            f"\nprecompute, batch {args.ref_batch}, {pre['slices']} slices of "
            f"{args.slice_pairs} pairs, {pre['tokens']} tokens, median of {args.precompute_repeats}"
        )
        print(f"  {'path':<34} {'tokens/s':>9}  {'x plain':>7}")
        print(f"  {'plain scoring (score_pairs)':<34} {pre['plain']:9.0f}  {1.0:7.3f}")
        print(
            f"  {'resumable precompute (parts)':<34} {pre['sliced']:9.0f}  {pre['sliced'] / pre['plain']:7.3f}"
        )
        dpo = measure_dpo(checkpoint, shard_path, root, args, reference, info)
        live = dpo["live"]
        print(
            f"\nDPO optimizer step, micro_batch {args.micro_batch} x grad_accum 2, "
            f"median of {args.steps} steps after one warm-up"
        )
        print(
            f"  {'reference':<34} {'wall s':>7} {'x live':>7} {'cpu s':>7} {'x live':>7} {'tokens/s':>9}"
        )
        for name, label in (
            ("live", "live (frozen model, no_grad)"),
            ("cached", "cached (precomputed log-probs)"),
        ):
            r = dpo[name]
            print(
                f"  {label:<34} {r['wall']:7.3f} {r['wall'] / live['wall']:7.3f} "
                f"{r['cpu']:7.3f} {r['cpu'] / live['cpu']:7.3f} {r['tokens_per_s']:9.0f}"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=192)
    parser.add_argument("--pairs", type=int, default=96)
    parser.add_argument("--ref-batch", type=int, default=16)
    parser.add_argument("--slice-pairs", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--precompute-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    main(parser.parse_args())
