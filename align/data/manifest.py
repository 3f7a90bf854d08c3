"""The data manifest (manifest.json) as the gates, the selection and the report read it.

align.data.build writes each arm's entry and workflow/scripts/build_manifest.py the
receipt around them: the arms by name, and the pins every arm shares (the tokenizer's
hash among them). Imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.exit_codes import GateRefused
from align.receipts import read_json


@dataclass(frozen=True)
class ShardRecord:
    """One split's shard as recorded: its path (as the manifest records it) and hash."""

    path: str
    hash: str


@dataclass(frozen=True)
class ManifestArm:
    """One arm's entry: PASSED, or DESCOPED with the reason; its counts (kept pairs by
    split and removed pairs by filter), its shards, and the `[data]` choices that shaped
    them."""

    status: str
    reason: str | None
    counts: dict[str, int]
    shards: dict[str, ShardRecord]
    format: str | None = None
    seq_len: int | None = None
    truncation: str | None = None
    max_prompt_tokens: int | None = None
    data_config: dict[str, Any] = field(default_factory=dict)
    config_source: str | None = None

    @classmethod
    def of(cls, entry: Mapping[str, Any], where: str) -> ManifestArm:
        """`entry` as recorded; one that lacks a key every entry has is refused, naming it."""
        for key in ("status", "counts", "shards"):
            if key not in entry:
                raise GateRefused("manifest", f"{where}: expected key {key!r}, found none")
        return cls(
            status=entry["status"],
            reason=entry.get("reason"),
            counts=dict(entry["counts"]),
            shards={
                split: ShardRecord(shard["path"], shard["hash"])
                for split, shard in entry["shards"].items()
            },
            format=entry.get("format"),
            seq_len=entry.get("seq_len"),
            truncation=entry.get("truncation"),
            max_prompt_tokens=entry.get("max_prompt_tokens"),
            data_config=dict(entry.get("data_config", {})),
            config_source=entry.get("config_source"),
        )


@dataclass(frozen=True)
class Manifest:
    arms: dict[str, ManifestArm]
    pins: dict[str, Any]

    @classmethod
    def of(cls, receipt: Mapping[str, Any], path: str | Path) -> Manifest:
        """The manifest `receipt`, read from `path` (named in a refusal)."""
        arms = {
            name: ManifestArm.of(entry, f"{path}: arm {name}")
            for name, entry in receipt.get("arms", {}).items()
        }
        return cls(arms, dict(receipt.get("pins", {})))

    @classmethod
    def read(cls, path: str | Path) -> Manifest | None:
        """The manifest at `path`, or None while the data is not built."""
        return cls.of(read_json(path), path) if Path(path).is_file() else None
