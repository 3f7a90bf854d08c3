"""The build-manifest stage's work: read, filter, tokenize, split and shard each arm.

Streams records in batches so a large source is never held as Python token lists
at once beyond one split's arrays. Returns the manifest entry of each arm.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import islice
from typing import Any

from align.config import ArmConfig
from align.data.filters import FilterCounts, apply_filters
from align.data.formats import expand_files, iter_records
from align.data.shards import PAIR_FORMAT, pair_arrays, response_token_count, write_shard
from align.data.split import pair_id, split_of
from align.data.tokenize import TokenizedPair, tokenize_pairs
from align.paths import SPLITS, ArmPaths
from align.receipts import DESCOPED, PASSED, hash_file, write_json_atomic

TOKENIZE_BATCH = 1024


def batched(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


class _SplitBuffer:
    def __init__(self) -> None:
        self.ids: list[int] = []
        self.pairs: list[TokenizedPair] = []
        self.truncated = 0


def chosen_longer_fraction(arrays: dict) -> float:
    """Fraction of pairs whose chosen response has more tokens than the rejected one."""
    n = len(arrays["pair_id"])
    if n == 0:
        return 0.0
    longer = (arrays["chosen_len"] > arrays["rejected_len"]).sum()
    return float(longer) / n


def build_arm(cfg: ArmConfig, tokenizer, paths: ArmPaths) -> dict[str, Any]:
    """Build both splits of one arm; the result is the arm's manifest entry."""
    data = cfg.data
    files = expand_files(data.files)
    counts = FilterCounts()
    buffers = {split: _SplitBuffer() for split in SPLITS}
    seen_ids: set[int] = set()
    records = apply_filters(iter_records(files, data.format), data.filters, counts)
    for chunk in batched(records, TOKENIZE_BATCH):
        for record, tokens in zip(
            chunk, tokenize_pairs(chunk, tokenizer, data.seq_len), strict=True
        ):
            pid = pair_id(record.prompt, record.chosen, record.rejected)
            if pid in seen_ids:
                raise AssertionError(f"{record.source} row {record.row}: pair id collision {pid}")
            seen_ids.add(pid)
            buf = buffers[split_of(record.prompt, data.held_fraction, data.split_seed)]
            buf.ids.append(pid)
            buf.pairs.append(tokens)
            buf.truncated += tokens.truncated
    counts.check_reconciles()

    entry: dict[str, Any] = {
        "format": data.format,
        "seq_len": data.seq_len,
        "truncation": data.truncation,
        "sources": {str(f): hash_file(f) for f in files},
        "counts": {**counts.as_dict(), **{s: len(buffers[s].ids) for s in SPLITS}},
        "truncated_pairs": {s: buffers[s].truncated for s in SPLITS},
        "shards": {},
    }
    for split in SPLITS:
        arrays = pair_arrays(buffers[split].ids, buffers[split].pairs, tokenizer.pad_id)
        shard = paths.shard(split)
        write_shard(shard, arrays, PAIR_FORMAT, arm=cfg.arm, split=split, seq_len=data.seq_len)
        shard_entry = {
            "path": str(shard),
            "hash": hash_file(shard),
            "pairs": len(buffers[split].ids),
            "chosen_tokens": response_token_count(arrays, "chosen"),
            "rejected_tokens": response_token_count(arrays, "rejected"),
            "chosen_longer_fraction": chosen_longer_fraction(arrays),
        }
        write_json_atomic(
            paths.shard_receipt(split), {"arm": cfg.arm, "split": split, **shard_entry}
        )
        entry["shards"][split] = shard_entry
    entry["chosen_longer_fraction"] = entry["shards"]["train"]["chosen_longer_fraction"]
    if counts.kept < data.min_pairs:
        entry["status"] = DESCOPED
        entry["reason"] = (
            f"kept {counts.kept} pairs, under the pre-registered minimum data.min_pairs={data.min_pairs}"
        )
    else:
        entry["status"] = PASSED
    return entry
