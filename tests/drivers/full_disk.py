"""One write of each kind a stage makes, into a directory whose filesystem may fill first.

`python tests/drivers/full_disk.py SITE DIR [--fill]` writes SITE's files under DIR the way
its stage does: `receipt` (write_json_atomic), `shard` (write_shard), `cache`
(write_ref_cache), `export` (save_hf_checkpoint) or `checkpoint` (CheckpointManager.save
of an FSDP2 model and its AdamW state; run it under align.launch, as a stage's ranks run).
With --fill it first fills DIR's filesystem to its last byte with FILLER at the
filesystem's root, as another job's writes would. Its main runs under
run_with_exit_codes, as every stage's does. The same SITE writes the same bytes every run.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from align.exit_codes import run_with_exit_codes
from align.receipts import write_json_atomic

FILLER = "filler"
STAGE = "full_disk"


def fill_filesystem(directory: Path) -> None:
    """Write FILLER at the root of `directory`'s filesystem until it holds no free byte."""
    root = directory
    while not os.path.ismount(root):
        root = root.parent
    stats = os.statvfs(root)
    with open(root / FILLER, "ab", buffering=0) as handle:
        try:
            os.posix_fallocate(handle.fileno(), 0, stats.f_bavail * stats.f_frsize)
            while True:
                handle.write(b"\0" * 4096)
        except OSError:
            pass


def write_receipt(directory: Path) -> None:
    write_json_atomic(directory / "receipt.json", {"stage": STAGE, "figures": list(range(30_000))})


def write_shard(directory: Path) -> None:
    from align.data.shards import write_shard

    ids = np.arange(400_000, dtype=np.int64).reshape(1_000, 400)
    write_shard(directory / "train.safetensors", {"input_ids": ids}, fmt="pairs")


def write_cache(directory: Path) -> None:
    from align.train.ref_cache import CacheKey, write_ref_cache

    key = CacheKey(
        checkpoint_weights="w" * 64,
        tokenizer="t" * 64,
        shard="s" * 64,
        seq_len_truncation="96:prompt_left_response_right",
        dtype="float32",
        forward_impl="eager",
    )
    pairs = np.arange(100_000, dtype=np.int64)[::-1].copy()
    logps = np.linspace(-50.0, -1.0, pairs.size, dtype=np.float32)
    write_ref_cache(directory / "train.safetensors", pairs, logps, logps - 1.0, key)


def tiny_model():
    import torch

    from align.model.hf_config import MistralConfig
    from align.model.mistral import NmoMistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return NmoMistralForCausalLM(config)


def write_export(directory: Path) -> None:
    from align.model.checkpoint import save_hf_checkpoint

    save_hf_checkpoint(tiny_model(), directory / "policy")


def write_checkpoint(directory: Path) -> None:
    import torch

    from align.config import OptimizerConfig
    from align.losses.fused import shift_labels
    from align.train.checkpointing import CheckpointManager
    from align.train.fsdp import apply_fsdp
    from align.train.optim import build_optimizer
    from align.utils.dist import destroy_distributed, init_distributed

    torch.set_num_threads(1)
    info = init_distributed(directory, "cpu")
    model = tiny_model()
    apply_fsdp(model)
    optimizer = build_optimizer(model, OptimizerConfig(name="adamw", lr=1e-3))
    ids = torch.arange(1, 33).reshape(2, 16)
    logps, counts = model(ids, labels=shift_labels(ids, torch.ones_like(ids, dtype=torch.bool)))
    (-logps.sum() / counts.sum()).backward()
    optimizer.step()
    manager = CheckpointManager(directory, info, keep=1)
    manager.save(1, model, optimizer, {"world_size": info.world_size, "step": 1})
    destroy_distributed()


SITES = {
    "receipt": write_receipt,
    "shard": write_shard,
    "cache": write_cache,
    "export": write_export,
    "checkpoint": write_checkpoint,
}


def main() -> None:
    site, directory = sys.argv[1], Path(sys.argv[2])
    directory.mkdir(parents=True, exist_ok=True)
    if "--fill" in sys.argv[3:]:
        fill_filesystem(directory)
    SITES[site](directory)


if __name__ == "__main__":
    run_with_exit_codes(main, STAGE)
