"""A tiny Mistral checkpoint and a shard of random preference pairs, for reference-cache tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tiny_models import TINY_SIZES

from align.data.shards import PAIR_FORMAT, write_shard
from align.model.tiny import make_tiny_model
from align.model.tokenizer import train_bpe_tokenizer


def write_tiny_pairs(work: Path, n_pairs: int, seq_len: int, seed: int = 0) -> None:
    """`work/base/` (checkpoint with tokenizer) and `work/pairs.safetensors`.

    Pair ids are drawn out of row order, so anything that orders by pair id is exercised;
    chosen and rejected share their prompt tokens, so either batch layout reads the shard.
    """
    texts = [f"{a} plus {b} is {a + b}." for a in range(10) for b in range(10)]
    train_bpe_tokenizer(texts, 300, work / "tok")
    make_tiny_model(
        work / "base",
        work / "tok",
        seed=3,
        **TINY_SIZES,
    )
    vocab = json.loads((work / "base" / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(3, 6, n_pairs).astype(np.int32)
    arrays = {
        "pair_id": rng.permutation(10 * n_pairs)[:n_pairs].astype(np.int64),
        "prompt_len": prompt_len,
        "chosen_len": (prompt_len + rng.integers(3, seq_len - 6, n_pairs)).astype(np.int32),
        "rejected_len": (prompt_len + rng.integers(3, seq_len - 6, n_pairs)).astype(np.int32),
        "chosen_ids": rng.integers(4, vocab, (n_pairs, seq_len)).astype(np.int32),
        "rejected_ids": rng.integers(4, vocab, (n_pairs, seq_len)).astype(np.int32),
    }
    # One prompt per pair, as the build writes it.
    prompt = np.arange(seq_len)[None, :] < prompt_len[:, None]
    arrays["rejected_ids"] = np.where(prompt, arrays["chosen_ids"], arrays["rejected_ids"])
    write_shard(work / "pairs.safetensors", arrays, PAIR_FORMAT)
