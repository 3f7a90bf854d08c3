"""Readers of the raw preference formats users really have, into one `PreferenceRecord`.

Formats (named by the pre-registration's `data.format`, never guessed):

- `argilla`: argilla/distilabel-intel-orca-dpo-pairs (`system`, `input`, `chosen`,
  `rejected`, and `status`, `chosen_score`, `in_gsm8k_train` for the filters);
- `ultrafeedback`: UltraFeedback-binarized style, `chosen` / `rejected` message lists
  [{"role", "content"}] ending with the assistant turn, optional `prompt`;
- `pairs`: plain `prompt`, `chosen`, `rejected` strings;
- `steppairs`: Step-DPO (`prompt`, `initial_reason_steps`, `chosen`, `rejected`).

Files are JSONL or Parquet, local paths or globs. Any malformed row ends the build
with exit 4 and a message naming the file, the row (line number for JSONL), what
was expected and what was found. A NaN or infinite number (JSON's NaN / Infinity
literals, or a Parquet float) is malformed too: no filter may read it as a value.

Memory stays bounded whatever the file holds (align.data.bounds): a JSONL line is read
with a length cap, and one over `RowBounds.line_bytes` is refused without being held; a
Parquet row group is checked in the file's metadata before it is read, and refused when
a column's uncompressed data could not be that many bytes per row, or the group would
take more than `PARQUET_ROW_GROUP_BYTES`.
"""

from __future__ import annotations

import glob
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.data.bounds import PARQUET_ROW_GROUP_BYTES, UNTOKENIZED, RowBounds
from align.exit_codes import BadInputData

Message = tuple[str, str]
PARQUET_BATCH_ROWS = 4096
# The piece a refused line is measured in, so that its length is reported, never held.
SCAN_BYTES = 1 << 20


def location(source: str, row: int) -> str:
    """How a row is named in messages: the line of a JSONL file, the row of any other."""
    unit = "line" if source.endswith(".jsonl") else "row"
    return f"{source} {unit} {row}"


@dataclass(frozen=True)
class PreferenceRecord:
    """One pair: the prompt, the two responses, and where it came from.

    `prompt` is the plain text of the whole prompt: it is what the split hashes, what
    identifies the pair and what the plain join renders. A chat template renders
    `messages` instead (one user turn of `prompt` when empty), then `response_prefix`,
    the start of the assistant turn that belongs to the prompt (Step-DPO's steps).
    """

    prompt: str
    chosen: str
    rejected: str
    source: str
    row: int
    meta: dict[str, Any] = field(default_factory=dict)
    messages: tuple[Message, ...] = ()
    response_prefix: str = ""

    def prompt_messages(self) -> tuple[Message, ...]:
        return self.messages or (("user", self.prompt),)

    def where(self) -> str:
        return location(self.source, self.row)

    def text_chars(self) -> int:
        """Characters of every text the record holds, which is what it costs to keep it."""
        texts = (self.prompt, self.chosen, self.rejected, self.response_prefix)
        return sum(map(len, texts)) + sum(len(content) for _, content in self.messages)


@dataclass(frozen=True)
class RawRow:
    source: str
    row: int
    values: dict[str, Any]

    def where(self) -> str:
        return location(self.source, self.row)

    def has(self, column: str) -> bool:
        return column in self.values

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
        if not _is_kind(value, kind):
            raise BadInputData(
                f"{self.where()}: column {column!r} expected {_kind_name(kind)}, "
                f"found {type(value).__name__} {value!r:.60}"
            )
        if isinstance(value, float) and not math.isfinite(value):
            raise BadInputData(
                f"{self.where()}: column {column!r} expected a finite number, found {value!r}"
            )
        return value


def _is_kind(value: Any, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int to Python, but true is no score and no count.
    if isinstance(value, bool) and bool not in kinds:
        return False
    return isinstance(value, kinds)


def _kind_name(kind: type | tuple[type, ...]) -> str:
    return kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)


def expand_files(patterns: list[str], base: Path | None = None) -> list[Path]:
    """Expand local paths and globs in order; a pattern matching no file, or a file twice, is refused."""
    if not patterns:
        raise BadInputData("data.files is empty: the pre-registration names no input file")
    files: list[Path] = []
    for pattern in patterns:
        full = (
            str(base / pattern) if base is not None and not Path(pattern).is_absolute() else pattern
        )
        matches = [Path(m) for m in sorted(glob.glob(full)) if Path(m).is_file()]
        if not matches:
            raise BadInputData(f"{full}: matches no file")
        for path in matches:
            if path in files:
                raise BadInputData(f"{path}: named twice by data.files (pattern {full!r})")
            files.append(path)
    return files


def iter_raw_rows(path: Path, bounds: RowBounds = UNTOKENIZED) -> Iterator[RawRow]:
    """Rows of one JSONL or Parquet file, numbered from 1, none held beyond `bounds`."""
    if path.suffix == ".jsonl":
        yield from _iter_jsonl(path, bounds)
    elif path.suffix == ".parquet":
        yield from _iter_parquet(path, bounds)
    else:
        raise BadInputData(
            f"{path}: unsupported file type {path.suffix!r} (expected .jsonl or .parquet)"
        )


def _open_binary(path: Path):
    try:
        return open(path, "rb")
    except OSError as err:
        raise BadInputData(f"{path}: cannot be read ({err.strerror})") from err


def _iter_jsonl(path: Path, bounds: RowBounds) -> Iterator[RawRow]:
    empty = True
    cap = bounds.line_bytes
    with _open_binary(path) as fh:
        line_no = 0
        # One byte over the cap tells a line over it from one that just fits.
        while raw := fh.readline(cap + 1):
            line_no += 1
            if len(raw) > cap and not raw.endswith(b"\n"):
                found = len(raw) + _rest_of_line(fh)
                raise BadInputData(
                    f"{path} line {line_no}: expected at most {cap} bytes per line "
                    f"({bounds.line_basis}), found {found} bytes; is a newline missing?"
                )
            values = _parse_json_line(path, line_no, raw)
            if values is None:
                continue
            empty = False
            yield RawRow(str(path), line_no, values)
    if empty:
        raise BadInputData(f"{path}: empty file (expected one JSON object per line)")


def _rest_of_line(fh) -> int:
    """Bytes up to the end of the current line (its newline excluded), read piece by piece."""
    rest = 0
    while piece := fh.readline(SCAN_BYTES):
        if piece.endswith(b"\n"):
            return rest + len(piece) - 1
        rest += len(piece)
    return rest


def _parse_json_line(path: Path, line_no: int, raw: bytes) -> dict[str, Any] | None:
    """The object on one line; None for a blank line."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInputData(
            f"{path} line {line_no}: not UTF-8 ({err.reason} at byte {err.start})"
        ) from err
    if not text.strip():
        return None
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
    return values


def _iter_parquet(path: Path, bounds: RowBounds) -> Iterator[RawRow]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as err:
        raise BadInputData(f"{path}: not a readable parquet file ({err})") from err
    metadata = parquet.metadata
    if metadata.num_rows == 0:
        raise BadInputData(f"{path}: empty file (parquet with 0 rows)")
    row_no = 0
    for group in range(metadata.num_row_groups):
        _check_row_group(path, metadata.row_group(group), group, row_no + 1, bounds)
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=[group]):
            for values in batch.to_pylist():
                row_no += 1
                yield RawRow(str(path), row_no, values)


def _check_row_group(path: Path, meta, group: int, first_row: int, bounds: RowBounds) -> None:
    """Refuse a row group, before it is read, that a reader could not hold within `bounds`."""
    rows = meta.num_rows
    if rows == 0:
        return  # nothing of it is read
    where = f"{path} rows {first_row}-{first_row + rows - 1} (row group {group})"
    for i in range(meta.num_columns):
        column = meta.column(i)
        size = column.total_uncompressed_size
        # More than rows x line_bytes in one column: some row of the group is over the bound.
        if size > rows * bounds.line_bytes:
            raise BadInputData(
                f"{where}: column {column.path_in_schema!r} expected at most {bounds.line_bytes} "
                f"bytes per row ({bounds.line_basis}), found {size} bytes in {rows} rows"
            )
    if meta.total_byte_size > PARQUET_ROW_GROUP_BYTES:
        raise BadInputData(
            f"{where}: expected at most {PARQUET_ROW_GROUP_BYTES} bytes of uncompressed data "
            f"per row group, found {meta.total_byte_size}; write the file with smaller row "
            "groups (pyarrow.parquet.write_table(..., row_group_size=N))"
        )


def _text(row: RawRow, column: str) -> str:
    return row.get(column, str)


ARGILLA_FILTER_COLUMNS: dict[str, type | tuple[type, ...]] = {
    "status": str,
    "chosen_score": (int, float),
    "in_gsm8k_train": bool,
}


def _argilla(row: RawRow) -> PreferenceRecord:
    system = row.get("system", str, optional=True) or ""
    question = _text(row, "input")
    has_system = bool(system.strip())
    prompt = f"{system}\n{question}" if has_system else question
    messages = (("system", system), ("user", question)) if has_system else (("user", question),)
    # Only present columns enter meta, so a filter can tell a missing column from a null.
    meta = {
        column: row.get(column, kind, optional=True)
        for column, kind in ARGILLA_FILTER_COLUMNS.items()
        if row.has(column)
    }
    return PreferenceRecord(
        prompt,
        _text(row, "chosen"),
        _text(row, "rejected"),
        row.source,
        row.row,
        meta,
        messages=messages,
    )


def _steppairs(row: RawRow) -> PreferenceRecord:
    question = _text(row, "prompt")
    steps = _text(row, "initial_reason_steps")
    prompt = f"{question.rstrip()}\n{steps}".rstrip("\n")
    return PreferenceRecord(
        prompt,
        _text(row, "chosen"),
        _text(row, "rejected"),
        row.source,
        row.row,
        messages=(("user", question),),
        response_prefix=steps,
    )


def _pairs(row: RawRow) -> PreferenceRecord:
    return PreferenceRecord(
        _text(row, "prompt"), _text(row, "chosen"), _text(row, "rejected"), row.source, row.row
    )


def _conversation(row: RawRow, column: str) -> tuple[Message, ...]:
    """A message list that ends with the assistant turn, as (role, content) pairs."""
    messages = row.get(column, list)
    turns = []
    for i, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise BadInputData(
                f"{row.where()}: column {column!r} message {i} expected "
                f"{{'role': str, 'content': str}}, found {message!r:.60}"
            )
        turns.append((message["role"], message["content"]))
    if not turns or turns[-1][0] != "assistant":
        last = turns[-1][0] if turns else "no message"
        raise BadInputData(
            f"{row.where()}: column {column!r} expected a message list ending with an "
            f"assistant turn, found {last!r} last"
        )
    return tuple(turns)


def _ultrafeedback(row: RawRow) -> PreferenceRecord:
    chosen = _conversation(row, "chosen")
    rejected = _conversation(row, "rejected")
    turns = chosen[:-1]
    if rejected[:-1] != turns:
        raise BadInputData(
            f"{row.where()}: columns 'chosen' and 'rejected' expected the same turns before "
            f"the final assistant turn, found {len(turns)} and {len(rejected) - 1} turns that differ"
        )
    prompt = row.get("prompt", str, optional=True)
    if prompt is None:
        if not turns:
            raise BadInputData(
                f"{row.where()}: no prompt (expected a 'prompt' column or turns before the "
                "assistant turn in 'chosen')"
            )
        prompt = "\n".join(content for _, content in turns)
    return PreferenceRecord(
        prompt,
        chosen[-1][1],
        rejected[-1][1],
        row.source,
        row.row,
        messages=turns or (("user", prompt),),
    )


READERS: dict[str, Callable[[RawRow], PreferenceRecord]] = {
    "argilla": _argilla,
    "steppairs": _steppairs,
    "pairs": _pairs,
    "ultrafeedback": _ultrafeedback,
}


def iter_records(
    files: list[Path], fmt: str, bounds: RowBounds = UNTOKENIZED
) -> Iterator[PreferenceRecord]:
    """Every pair of `files` in the named format, in file then row order."""
    if fmt not in READERS:
        raise BadInputData(f"unknown data format {fmt!r} (expected one of {', '.join(READERS)})")
    to_record = READERS[fmt]
    for path in files:
        for row in iter_raw_rows(path, bounds):
            yield to_record(row)
