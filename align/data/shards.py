"""Token shards as safetensors files (numpy, no torch), written atomically.

A pair shard holds, for N pairs padded to the longest sequence L of the split:
`pair_id` [N] int64, `prompt_len` [N], `chosen_len` / `rejected_len` [N] (full
lengths, prompt included) and `chosen_ids` / `rejected_ids` [N, L] int32. The
response of row i spans positions [prompt_len[i], *_len[i]).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from align.data.tokenize import TokenizedPair
from align.receipts import atomic_path

PAIR_FORMAT = "align-pairs-v1"
SFT_FORMAT = "align-sft-v1"


def _padded(rows: Sequence[list[int]], width: int, pad_id: int) -> np.ndarray:
    out = np.full((len(rows), width), pad_id, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def pair_arrays(
    ids: Sequence[int], pairs: Sequence[TokenizedPair], pad_id: int
) -> dict[str, np.ndarray]:
    chosen = [p.prompt + p.chosen for p in pairs]
    rejected = [p.prompt + p.rejected for p in pairs]
    width = max([1, *map(len, chosen), *map(len, rejected)])
    return {
        "pair_id": np.asarray(ids, dtype=np.int64),
        "prompt_len": np.asarray([len(p.prompt) for p in pairs], dtype=np.int32),
        "chosen_len": np.asarray([len(c) for c in chosen], dtype=np.int32),
        "rejected_len": np.asarray([len(r) for r in rejected], dtype=np.int32),
        "chosen_ids": _padded(chosen, width, pad_id),
        "rejected_ids": _padded(rejected, width, pad_id),
    }


def sft_arrays(rows: Sequence[tuple[list[int], int]], pad_id: int) -> dict[str, np.ndarray]:
    width = max([1, *(len(ids) for ids, _ in rows)])
    return {
        "ids": _padded([ids for ids, _ in rows], width, pad_id),
        "length": np.asarray([len(ids) for ids, _ in rows], dtype=np.int32),
        "prompt_len": np.asarray([p for _, p in rows], dtype=np.int32),
    }


def write_shard(
    path: str | Path, arrays: dict[str, np.ndarray], fmt: str, **metadata: object
) -> None:
    with atomic_path(path) as tmp:
        save_file(arrays, str(tmp), metadata=single_key_metadata({"format": fmt, **metadata}))


def single_key_metadata(metadata: dict[str, object]) -> dict[str, str]:
    """safetensors writes metadata keys in no fixed order; one key keeps the bytes reproducible."""
    return {"align": json.dumps(metadata, sort_keys=True)}


def read_metadata(path: str | Path) -> dict[str, object]:
    with safe_open(str(path), framework="numpy") as f:
        metadata = f.metadata() or {}
    return json.loads(metadata["align"]) if "align" in metadata else {}


def read_shard(path: str | Path) -> dict[str, np.ndarray]:
    return load_file(str(path))


def response_token_count(arrays: dict[str, np.ndarray], side: str) -> int:
    return int((arrays[f"{side}_len"] - arrays["prompt_len"]).sum())
