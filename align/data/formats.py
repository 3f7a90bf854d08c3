"""Readers of the raw preference formats users really have, into one `PreferenceRecord`.

The format is named by the pre-registration, never guessed. Any malformed row ends
the build with exit 4 and a message naming the file, the row (line number for
JSONL), what was expected and what was found.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.exit_codes import BadInputData


@dataclass(frozen=True)
class PreferenceRecord:
    """One pair: the prompt as plain text, the two responses, and where it came from."""

    prompt: str
    chosen: str
    rejected: str
    source: str
    row: int
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RawRow:
    source: str
    row: int
    values: dict[str, Any]

    def where(self) -> str:
        unit = "line" if self.source.endswith(".jsonl") else "row"
        return f"{self.source} {unit} {self.row}"

    def get(self, column: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
        if column not in self.values:
            if optional:
                return None
            raise BadInputData(
                f"{self.where()}: missing column {column!r} (found columns: {', '.join(sorted(self.values))})"
            )
        value = self.values[column]
        if optional and value is None:
            return None
        numeric = kind in (int, float) or (
            isinstance(kind, tuple) and bool({int, float} & set(kind))
        )
        if not isinstance(value, kind) or (numeric and isinstance(value, bool)):
            expected = (
                kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
            )
            raise BadInputData(
                f"{self.where()}: column {column!r} expected {expected}, found {type(value).__name__} {value!r:.60}"
            )
        return value


def expand_files(patterns: list[str], base: Path | None = None) -> list[Path]:
    """Expand local paths and globs; a pattern that matches nothing is refused."""
    if not patterns:
        raise BadInputData("data.files is empty: the pre-registration names no input file")
    files: list[Path] = []
    for pattern in patterns:
        full = (
            str(base / pattern) if base is not None and not Path(pattern).is_absolute() else pattern
        )
        matches = sorted(glob.glob(full))
        if not matches:
            raise BadInputData(f"{full}: matches no file")
        files.extend(Path(m) for m in matches)
    return files


def iter_raw_rows(path: Path) -> Iterator[RawRow]:
    """Rows of one JSONL or Parquet file, numbered from 1."""
    if path.suffix == ".jsonl":
        yield from _iter_jsonl(path)
    elif path.suffix == ".parquet":
        yield from _iter_parquet(path)
    else:
        raise BadInputData(
            f"{path}: unsupported file type {path.suffix!r} (expected .jsonl or .parquet)"
        )


def _iter_jsonl(path: Path) -> Iterator[RawRow]:
    empty = True
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise BadInputData(
                    f"{path} line {line_no}: not UTF-8 ({err.reason} at byte {err.start})"
                ) from err
            if not text.strip():
                continue
            try:
                values = json.loads(text)
            except json.JSONDecodeError as err:
                raise BadInputData(
                    f"{path} line {line_no}: not valid JSON ({err.msg} at column {err.colno})"
                ) from err
            if not isinstance(values, dict):
                raise BadInputData(
                    f"{path} line {line_no}: expected a JSON object, found {type(values).__name__}"
                )
            empty = False
            yield RawRow(str(path), line_no, values)
    if empty:
        raise BadInputData(f"{path}: empty file (expected one JSON object per line)")


def _iter_parquet(path: Path) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise BadInputData(f"{path}: not a readable parquet file ({err})") from err
    if parquet.metadata.num_rows == 0:
        raise BadInputData(f"{path}: empty file (parquet with 0 rows)")
    row_no = 0
    for batch in parquet.iter_batches(batch_size=4096):
        for values in batch.to_pylist():
            row_no += 1
            yield RawRow(str(path), row_no, values)


def _text(row: RawRow, column: str) -> str:
    return row.get(column, str)


def _argilla(row: RawRow) -> PreferenceRecord:
    system = row.get("system", str, optional=True) or ""
    question = _text(row, "input")
    prompt = f"{system}\n{question}" if system.strip() else question
    meta = {
        "status": row.get("status", str, optional=True),
        "chosen_score": row.get("chosen_score", (int, float), optional=True),
        "in_gsm8k_train": row.get("in_gsm8k_train", bool, optional=True),
    }
    return PreferenceRecord(
        prompt, _text(row, "chosen"), _text(row, "rejected"), row.source, row.row, meta
    )


def _steppairs(row: RawRow) -> PreferenceRecord:
    steps = _text(row, "initial_reason_steps")
    prompt = f"{_text(row, 'prompt').rstrip()}\n{steps}"
    return PreferenceRecord(
        prompt.rstrip("\n"), _text(row, "chosen"), _text(row, "rejected"), row.source, row.row
    )


def _pairs(row: RawRow) -> PreferenceRecord:
    return PreferenceRecord(
        _text(row, "prompt"), _text(row, "chosen"), _text(row, "rejected"), row.source, row.row
    )


def _messages(row: RawRow, column: str) -> list[dict[str, str]]:
    messages = row.get(column, list)
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("content"), str)
            or "role" not in message
        ):
            raise BadInputData(
                f"{row.where()}: column {column!r} message {i} expected {{'role', 'content'}}, found {message!r:.60}"
            )
    if not messages or messages[-1]["role"] != "assistant":
        raise BadInputData(
            f"{row.where()}: column {column!r} expected a message list ending with an assistant turn"
        )
    return messages


def _ultrafeedback(row: RawRow) -> PreferenceRecord:
    chosen = _messages(row, "chosen")
    rejected = _messages(row, "rejected")
    prompt = row.get("prompt", str, optional=True)
    if prompt is None:
        prompt = "\n".join(m["content"] for m in chosen[:-1])
    return PreferenceRecord(
        prompt, chosen[-1]["content"], rejected[-1]["content"], row.source, row.row
    )


READERS: dict[str, Callable[[RawRow], PreferenceRecord]] = {
    "argilla": _argilla,
    "steppairs": _steppairs,
    "pairs": _pairs,
    "ultrafeedback": _ultrafeedback,
}


def iter_records(files: list[Path], fmt: str) -> Iterator[PreferenceRecord]:
    """Every pair of `files` in the named format, in file then row order."""
    if fmt not in READERS:
        raise BadInputData(f"unknown data format {fmt!r} (expected one of {', '.join(READERS)})")
    to_record = READERS[fmt]
    for path in files:
        for row in iter_raw_rows(path):
            yield to_record(row)
