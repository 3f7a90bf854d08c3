"""The build-manifest stage's work: read, filter, tokenize, split and shard each arm.

`prepare_arm` streams an arm's records in batches into per-split numpy token
buffers (no Python token lists beyond one batch; a batch ends at `TOKENIZE_BATCH` rows
or `TOKENIZE_BATCH_CHARS` characters, so its memory is bounded however long the rows),
removes rows over the row limit of align.data.bounds before they are tokenized, and
refuses bad input before anything is written; `write_arms` then writes every arm's
shards and receipts and the manifest, removing them all if any step fails, so a failed
build leaves no shard and no manifest behind.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

from tqdm import tqdm

from align.config import ArmConfig, pinned_data_config
from align.data.bounds import RowBounds
from align.data.filters import (
    FilterCounts,
    Tally,
    active_reasons,
    classify,
    pair_chars,
    prompt_over_budget,
)
from align.data.formats import PreferenceRecord, expand_files, iter_records
from align.data.shards import PairShardBuilder
from align.data.split import pair_id, split_of
from align.data.tokenize import PromptRenderer, TokenizedPair, tokenize_pairs
from align.paths import SPLITS, ArmPaths, RunPaths
from align.receipts import DESCOPED, PASSED, hash_file, write_json_atomic

TOKENIZE_BATCH = 1024
# The tokenizer takes about 16 bytes per character it encodes: this keeps a batch near 256 MiB.
TOKENIZE_BATCH_CHARS = 1 << 24
# Compared by the manifest gate with the counts, not as part of what shapes the shards.


def batched(items: Iterable, size: int) -> Iterator[list]:
    it = iter(items)
    while chunk := list(islice(it, size)):
        yield chunk


def record_batches(
    records: Iterable[tuple[PreferenceRecord, str | None]],
    rows: int = TOKENIZE_BATCH,
    chars: int = TOKENIZE_BATCH_CHARS,
) -> Iterator[list[tuple[PreferenceRecord, str | None]]]:
    """Classified records in order, in batches of at most `rows` rows and, past their
    first row, `chars` characters of text."""
    chunk: list[tuple[PreferenceRecord, str | None]] = []
    held = 0
    for item in records:
        size = item[0].text_chars()
        if chunk and (len(chunk) == rows or held + size > chars):
            yield chunk
            chunk, held = [], 0
        chunk.append(item)
        held += size
    if chunk:
        yield chunk


def progress(desc: str) -> tqdm:
    """Rows read so far, on stderr, only where a person watches it."""
    return tqdm(desc=desc, unit=" rows", file=sys.stderr, disable=not sys.stderr.isatty())


@dataclass
class ArmBuild:
    """One arm read, filtered and tokenized into per-split buffers, not yet written."""

    cfg: ArmConfig
    files: list[Path]
    prompt_rendering: str
    counts: FilterCounts
    bounds: RowBounds
    splits: dict[str, PairShardBuilder] = field(
        default_factory=lambda: {split: PairShardBuilder() for split in SPLITS}
    )
    ids_seen: set[int] = field(default_factory=set)

    def split_of(self, record: PreferenceRecord) -> str:
        return split_of(record.prompt, self.cfg.data.held_fraction, self.cfg.data.split_seed)

    def count_removed(
        self, chunk: list[tuple[PreferenceRecord, str | None]]
    ) -> list[tuple[PreferenceRecord, str]]:
        """Count the rows the text filters removed; return the others with their split."""
        candidates = []
        for record, reason in chunk:
            split = self.split_of(record)
            if reason is None:
                candidates.append((record, split))
            else:
                self.counts.add(reason, record.source, split)
        return candidates

    def within_limit(
        self, candidates: list[tuple[PreferenceRecord, str]], renderer: PromptRenderer
    ) -> tuple[list[tuple[PreferenceRecord, str]], list[str]]:
        """Count the rows over the row limit; return the others with their rendered prompts."""
        kept, texts = [], []
        for record, split in candidates:
            text = renderer.text(record)
            if self.bounds.over(pair_chars(text, record)):
                self.counts.add("row_over_length", record.source, split)
            else:
                kept.append((record, split))
                texts.append(text)
        return kept, texts

    def add_tokenized(self, record: PreferenceRecord, split: str, pair: TokenizedPair) -> None:
        """Keep the pair in its split, unless its prompt alone is over the token budget."""
        if prompt_over_budget(pair.prompt_tokens, self.cfg.data.max_prompt_tokens):
            self.counts.add("prompt_over_budget", record.source, split)
            return
        pid = pair_id(record.prompt, record.chosen, record.rejected)
        if pid in self.ids_seen:
            raise AssertionError(f"{record.where()}: pair id collision {pid}")
        self.ids_seen.add(pid)
        self.counts.add(None, record.source, split)
        self.splits[split].add(pid, pair)

    def check_counts(self) -> None:
        self.counts.check_reconciles(f"arm {self.cfg.arm} filter counts")
        for split in SPLITS:
            if _split_tally(self.counts, split).kept != len(self.splits[split]):
                raise AssertionError(f"arm {self.cfg.arm} split {split}: kept != rows buffered")


def prepare_arm(cfg: ArmConfig, tokenizer, renderer: PromptRenderer | None = None) -> ArmBuild:
    """Read, filter, split and tokenize one arm; bad input raises before anything is written."""
    data = cfg.data
    files = expand_files(data.files)
    renderer = renderer or PromptRenderer(
        tokenizer, merge_system_into_user=data.merge_system_into_user
    )
    bounds = RowBounds.of(tokenizer, data.seq_len)
    build = ArmBuild(cfg, files, renderer.kind, FilterCounts(active_reasons(data)), bounds)
    records = classify(iter_records(files, data.format, bounds), data.filters)
    with progress(f"build_manifest {cfg.arm}") as bar:
        for chunk in record_batches(records):
            candidates, texts = build.within_limit(build.count_removed(chunk), renderer)
            kept = [record for record, _ in candidates]
            tokenized = tokenize_pairs(kept, tokenizer, data.seq_len, renderer, texts)
            for (record, split), pair in zip(candidates, tokenized, strict=True):
                build.add_tokenized(record, split, pair)
            bar.update(len(chunk))
    build.check_counts()
    return build


def _split_tally(counts: FilterCounts, split: str) -> Tally:
    return counts.by_split.get(split) or Tally(counts.reasons)


def descoped_reason(build: ArmBuild) -> str | None:
    data = build.cfg.data
    if build.counts.kept < data.min_pairs:
        return f"kept {build.counts.kept} pairs, under the pre-registered minimum data.min_pairs={data.min_pairs}"
    for split in SPLITS:
        if not build.splits[split]:
            return f"split {split} has no pairs (data.held_fraction={data.held_fraction})"
    return None


def write_split(build: ArmBuild, split: str, pad_id: int, paths: ArmPaths) -> dict[str, Any]:
    """Write one split's shard and receipt; return its manifest entry."""
    data, builder = build.cfg.data, build.splits[split]
    shard = paths.shard(split)
    tokens_hash = builder.write(
        shard,
        pad_id,
        arm=build.cfg.arm,
        split=split,
        seq_len=data.seq_len,
        truncation=data.truncation,
    )
    entry = {
        "path": RunPaths.of(paths.results).recorded(shard),
        "hash": hash_file(shard),
        "tokens_hash": tokens_hash,
        "counts": _split_tally(build.counts, split).as_dict(),
        **builder.summary(),
    }
    write_json_atomic(paths.shard_receipt(split), {"arm": build.cfg.arm, "split": split, **entry})
    return entry


def write_arm(build: ArmBuild, tokenizer, paths: ArmPaths) -> dict[str, Any]:
    """Write both splits of a prepared arm; the result is the arm's manifest entry."""
    data, counts = build.cfg.data, build.counts
    recorded = RunPaths.of(paths.results).recorded
    shards = {split: write_split(build, split, tokenizer.pad_id, paths) for split in SPLITS}
    kept = sum(shards[s]["pairs"] for s in SPLITS)
    by_source = {
        recorded(f): (counts.by_source.get(str(f)) or Tally(counts.reasons)) for f in build.files
    }
    entry: dict[str, Any] = {
        "format": data.format,
        "seq_len": data.seq_len,
        "truncation": data.truncation,
        "max_prompt_tokens": data.max_prompt_tokens,
        "prompt_rendering": build.prompt_rendering,
        "data_config": pinned_data_config(data),
        "sources": {recorded(f): hash_file(f) for f in build.files},
        "counts": {**counts.as_dict(), **{s: shards[s]["pairs"] for s in SPLITS}},
        "counts_by_source": {name: tally.as_dict() for name, tally in by_source.items()},
        "truncated_pairs": {s: shards[s]["truncated_pairs"] for s in SPLITS},
        "chosen_longer_fraction": (
            sum(shards[s]["chosen_longer"] for s in SPLITS) / kept if kept else 0.0
        ),
        "shards": shards,
    }
    reason = descoped_reason(build)
    entry["status"] = PASSED if reason is None else DESCOPED
    if reason is not None:
        entry["reason"] = reason
    return entry


def build_arm(cfg: ArmConfig, tokenizer, paths: ArmPaths) -> dict[str, Any]:
    """Prepare and write one arm; the result is the arm's manifest entry."""
    return write_arm(prepare_arm(cfg, tokenizer), tokenizer, paths)


def _outputs_of(paths: ArmPaths) -> list[Path]:
    return [p for split in SPLITS for p in (paths.shard(split), paths.shard_receipt(split))]


def write_arms(
    builds: list[ArmBuild],
    tokenizer,
    run_paths: RunPaths,
    make_manifest: Callable[[dict[str, dict[str, Any]]], dict[str, Any]],
) -> dict[str, Any]:
    """Write every arm, then the manifest `make_manifest(entries)`; on any failure remove them all.

    Shards of an earlier build are removed too: once a rebuild has begun they no
    longer match any manifest, and a gate must find them missing, not stale.
    """
    outputs = [run_paths.manifest]
    outputs += [p for build in builds for p in _outputs_of(run_paths.arm(build.cfg.arm))]
    try:
        entries = {
            build.cfg.arm: write_arm(build, tokenizer, run_paths.arm(build.cfg.arm))
            for build in builds
        }
        manifest = make_manifest(entries)
        write_json_atomic(run_paths.manifest, manifest)
        return manifest
    except BaseException:
        for path in outputs:
            path.unlink(missing_ok=True)
        raise
