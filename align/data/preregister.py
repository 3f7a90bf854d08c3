"""The counts a pre-registration fixes, found by running the data build without writing shards.

`count_arm` reads, filters, splits and tokenizes an arm exactly as build_manifest
does (align.data.build.prepare_arm) and keeps only the counts. `write_expected_counts`
puts `expected_train_pairs` and `expected_held_pairs` into the arm's TOML, in place,
under a comment naming the date and the hashes of the input files and tokenizer they
came from; every other line of the file is kept as it was.
"""

from __future__ import annotations

import datetime as dt
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.config import ArmConfig
from align.data.build import descoped_reason, prepare_arm
from align.exit_codes import ConfigError
from align.paths import SPLITS
from align.receipts import atomic_path, hash_file

PROVENANCE_PREFIX = "# preregister: "
EXPECTED_KEYS = {split: f"expected_{split}_pairs" for split in SPLITS}
_TABLE = re.compile(r"^\s*\[")
_DATA_TABLE = re.compile(r"^\s*\[data\]\s*(#.*)?$")
_EXPECTED_LINE = re.compile(r"^\s*expected_(train|held)_pairs\s*=")


@dataclass(frozen=True)
class ArmCounts:
    """What the build of one arm gives: rows read, kept, removed by reason, train and held."""

    arm: str
    read: int
    kept: int
    removed: dict[str, int]
    splits: dict[str, int]
    descoped: str | None
    sources: dict[str, str]
    # The row limit and line bound the build applied, as one line (align.data.bounds).
    bounds: str = ""

    def expected(self, cfg: ArmConfig) -> dict[str, int | None]:
        """The counts the pre-registration fixes now, by split."""
        return {split: getattr(cfg.data, EXPECTED_KEYS[split]) for split in SPLITS}


def count_arm(cfg: ArmConfig, tokenizer) -> ArmCounts:
    """Run the arm's data build in memory and return its counts; nothing is written."""
    build = prepare_arm(cfg, tokenizer)
    counts = build.counts
    return ArmCounts(
        arm=cfg.arm,
        read=counts.read,
        kept=counts.kept,
        removed={reason: counts.removed[reason] for reason in sorted(counts.removed)},
        splits={split: len(build.splits[split]) for split in SPLITS},
        descoped=descoped_reason(build),
        sources={str(path): hash_file(path) for path in build.files},
        bounds=build.bounds.describe(),
    )


def format_counts(counts: ArmCounts, cfg: ArmConfig) -> str:
    """A terminal table of the counts, and how they compare with the pre-registration."""
    lines = [
        f"  read      {counts.read:>9}",
        f"  kept      {counts.kept:>9}",
        f"  removed   {counts.read - counts.kept:>9}",
        *(f"    {reason:<24}{n:>7}" for reason, n in counts.removed.items()),
        *(f"  {split:<9} {counts.splits[split]:>9}" for split in SPLITS),
    ]
    if counts.bounds:
        lines.append(f"  {counts.bounds}")
    if counts.descoped:
        lines.append(f"  DESCOPED: {counts.descoped}")
    for split, want in counts.expected(cfg).items():
        found = counts.splits[split]
        verdict = "not fixed" if want is None else "matches" if want == found else "DIFFERS"
        lines.append(f"  data.{EXPECTED_KEYS[split]} = {want} ({verdict})")
    return "\n".join(lines)


def provenance(counts: ArmCounts, tokenizer_dir: str | Path, tokenizer_hash: str) -> list[str]:
    """The comment lines above the written counts: when, and from exactly which inputs."""
    today = dt.datetime.now(dt.UTC).date().isoformat()
    return [
        f"counted on {today} by `align preregister` (read {counts.read}, kept {counts.kept})",
        *(f"{path} sha256 {digest}" for path, digest in counts.sources.items()),
        f"tokenizer of {tokenizer_dir} sha256 {tokenizer_hash}",
    ]


def write_expected_counts(toml_path: str | Path, splits: dict[str, int], notes: list[str]) -> None:
    """Set the expected counts in the TOML's [data] table, with `notes` as comments above them.

    The counts and notes of an earlier run are replaced; every other line stays. The
    result is parsed back before it replaces the file, and must differ from the old
    one in the two counts only.
    """
    path = Path(toml_path)
    text = path.read_text(encoding="utf-8")
    block = [f"{PROVENANCE_PREFIX}{note}\n" for note in notes]
    block += [f"{EXPECTED_KEYS[split]} = {splits[split]}\n" for split in SPLITS]
    edited = _replace_in_data_table(text.splitlines(keepends=True), block, path)
    _check_edit(tomllib.loads(text), edited, splits, path)
    with atomic_path(path) as tmp:
        tmp.write_text(edited, encoding="utf-8")


def _replace_in_data_table(lines: list[str], block: list[str], path: Path) -> str:
    start = next((i for i, line in enumerate(lines) if _DATA_TABLE.match(line)), None)
    if start is None:
        raise ConfigError(f"{path}: no [data] table to write the expected counts into")
    end = next((i for i in range(start + 1, len(lines)) if _TABLE.match(lines[i])), len(lines))
    section = lines[start + 1 : end]
    ours = [_is_ours(line) for line in section]
    kept = [line for line, mine in zip(section, ours, strict=True) if not mine]
    if any(ours):
        at = sum(1 for mine in ours[: ours.index(True)] if not mine)
    else:
        at = len(kept)
        while at and not kept[at - 1].strip():
            at -= 1
    if at and not kept[at - 1].endswith("\n"):
        kept[at - 1] += "\n"
    return "".join([*lines[: start + 1], *kept[:at], *block, *kept[at:], *lines[end:]])


def _is_ours(line: str) -> bool:
    """An expected-count line or a provenance comment that an earlier run wrote."""
    return bool(_EXPECTED_LINE.match(line)) or line.startswith(PROVENANCE_PREFIX)


def _check_edit(before: dict[str, Any], edited: str, splits: dict[str, int], path: Path) -> None:
    try:
        after = tomllib.loads(edited)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: the counts cannot be written in place ({err})") from err
    for split in SPLITS:
        before.setdefault("data", {})[EXPECTED_KEYS[split]] = splits[split]
    if after != before:
        raise ConfigError(f"{path}: writing the counts would change more than the counts")
