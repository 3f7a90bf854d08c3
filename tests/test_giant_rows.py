"""Giant rows: a row over the row limit is removed and counted as `row_over_length`, and a
file that could not be read within bounded memory is refused with exit 4, naming the file
and the row, never held (align.data.bounds).

The refusals run through `align preregister` under an address-space limit that a 1 GiB
JSONL line (a sparse file, so no disk is used) could not pass quietly; the rest is
checked at the library functions.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from align.config import ArmConfig, SftDataConfig, load_config
from align.data import formats
from align.data.bounds import (
    DEFAULT_LINE_BYTES,
    ROW_LIMIT_SEQ_LENS,
    RowBounds,
    longest_token_bytes,
)
from align.data.build import build_arm, prepare_arm
from align.data.filters import REASONS, UNIVERSAL_REASONS
from align.data.formats import iter_raw_rows
from align.data.preregister import count_arm, format_counts
from align.data.sft import tokenize_sft_splits
from align.data.synthetic import default_texts, write_default_data
from align.exit_codes import BAD_INPUT, BadInputData
from align.model.tokenizer import load_tokenizer, train_bpe_tokenizer
from align.paths import SPLITS, ArmPaths

REPO = Path(__file__).resolve().parents[1]
STEPPAIRS_TOML = REPO / "config" / "arms" / "steppairs.toml"
# The CLI counting one arm with two tokenizer threads runs in 0.3 GiB of address space
# (measured); a 1 GiB line read whole and decoded could not fit in this.
ADDRESS_SPACE_LIMIT = 2 << 30
# The tokenizer's thread pool, pinned so its stacks and heaps do not grow with the host's cores.
CHILD_ENV = {"RAYON_NUM_THREADS": "2", "MALLOC_ARENA_MAX": "2"}
GIANT_LINE_BYTES = 1 << 30


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory) -> dict[str, Path]:
    return write_default_data(
        tmp_path_factory.mktemp("raw"), seed=0, n_argilla=40, n_steppairs=60, n_sft=40
    )


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, raw_data) -> Path:
    return train_bpe_tokenizer(list(default_texts(raw_data)), 300, tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


def steppairs_config(data: Path, *overrides: str) -> ArmConfig:
    files = json.dumps([str(data)])
    return load_config(
        STEPPAIRS_TOML, ArmConfig, [f"--data.files={files}", "--min_pairs=1", *overrides]
    ).cfg


def default_lines(raw_data) -> list[str]:
    return raw_data["steppairs"].read_text().splitlines(keepends=True)


def steppairs_line(prompt: str, chosen: str = "Step 2: 4.", rejected: str = "Step 2: 5.") -> str:
    row = {"prompt": prompt, "initial_reason_steps": "", "chosen": chosen, "rejected": rejected}
    return json.dumps(row) + "\n"


def with_line(tmp_path: Path, lines: list[str], at: int, line: str) -> Path:
    path = tmp_path / "steppairs.jsonl"
    path.write_text("".join([*lines[:at], line, *lines[at:]]))
    return path


def over_limit_prompt(tokenizer, seq_len: int) -> str:
    """A prompt that takes its pair one character over the row limit, in the plain join."""
    bounds = RowBounds.of(tokenizer, seq_len)
    # The plain join adds one newline; the longer default response here has 10 characters.
    return "x" * (bounds.chars - 10)


# --- the limit ---------------------------------------------------------------------------


def test_the_row_limit_is_16_seq_lens_of_the_longest_token_and_every_build_reports_it(
    tokenizer,
):
    token_bytes = longest_token_bytes(tokenizer)
    vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
    assert token_bytes == max(len(token.encode()) for token in vocab)
    bounds = RowBounds.of(tokenizer, 96)
    assert bounds.chars == ROW_LIMIT_SEQ_LENS * 96 * token_bytes
    assert bounds.line_bytes == 12 * 8 * bounds.chars + (64 << 10)
    assert "row_over_length" in REASONS and "row_over_length" in UNIVERSAL_REASONS


def test_a_text_over_the_limit_has_more_than_16_seq_lens_of_tokens(tokenizer):
    # The text that packs the most characters into each token: the longest token, repeated.
    longest = max(
        tokenizer.backend.get_vocab(with_added_tokens=False),
        key=lambda token: len(token.encode()),
    )
    piece = tokenizer.decode([tokenizer.backend.token_to_id(longest)])
    seq_len = 8
    bounds = RowBounds.of(tokenizer, seq_len)
    text = (piece * (bounds.chars // len(piece) + 2))[: bounds.chars + 1]
    assert len(tokenizer.encode(text)) > ROW_LIMIT_SEQ_LENS * seq_len


# --- (a) a readable row over the limit ---------------------------------------------------


def test_a_row_over_the_limit_is_removed_as_its_reason_and_the_build_is_otherwise_unchanged(
    tmp_path, raw_data, tokenizer
):
    lines = default_lines(raw_data)
    plain = build_arm(
        steppairs_config(raw_data["steppairs"]), tokenizer, ArmPaths(tmp_path / "plain", "s")
    )
    giant = with_line(tmp_path, lines, 7, steppairs_line(over_limit_prompt(tokenizer, 96)))
    paths = ArmPaths(tmp_path / "giant", "s")
    entry = build_arm(steppairs_config(giant), tokenizer, paths)
    counts, before = entry["counts"], plain["counts"]
    assert counts["removed"]["row_over_length"] == 1
    assert before["removed"]["row_over_length"] == 0
    assert counts["read"] == before["read"] + 1
    others = {k: v for k, v in counts["removed"].items() if k != "row_over_length"}
    assert others == {k: v for k, v in before["removed"].items() if k != "row_over_length"}
    assert {k: counts[k] for k in ("kept", *SPLITS)} == {k: before[k] for k in ("kept", *SPLITS)}
    # The same kept rows: the shards are byte for byte those of the build without the row.
    for split in SPLITS:
        assert entry["shards"][split]["hash"] == plain["shards"][split]["hash"]
        assert entry["shards"][split]["tokens_hash"] == plain["shards"][split]["tokens_hash"]
    (source,) = entry["counts_by_source"].values()
    assert source["removed"]["row_over_length"] == 1
    by_split = [entry["shards"][s]["counts"]["removed"]["row_over_length"] for s in SPLITS]
    assert sorted(by_split) == [0, 1]


def test_a_row_at_the_limit_is_kept_and_one_character_more_is_removed(
    tmp_path, raw_data, tokenizer
):
    prompt = over_limit_prompt(tokenizer, 96)
    at_limit = with_line(tmp_path, [], 0, steppairs_line(prompt[:-1]))
    kept = prepare_arm(steppairs_config(at_limit, "--max_prompt_tokens=none"), tokenizer)
    assert (kept.counts.kept, kept.counts.removed["row_over_length"]) == (1, 0)
    over = with_line(tmp_path, [], 0, steppairs_line(prompt))
    removed = prepare_arm(steppairs_config(over, "--max_prompt_tokens=none"), tokenizer)
    assert (removed.counts.kept, removed.counts.removed["row_over_length"]) == (0, 1)


def test_the_limit_is_measured_on_the_rendered_prompt_and_the_longer_response(tmp_path, tokenizer):
    bounds = RowBounds.of(tokenizer, 96)
    response = "y" * (bounds.chars // 2)
    # Each text is under the limit alone; the prompt with either response is over it.
    row = steppairs_line("q" * (bounds.chars // 2), chosen=response, rejected="n")
    build = prepare_arm(steppairs_config(with_line(tmp_path, [], 0, row)), tokenizer)
    assert build.counts.removed["row_over_length"] == 1


def test_preregister_prints_the_limit_and_the_rows_over_it(tmp_path, raw_data, tokenizer):
    giant = with_line(
        tmp_path, default_lines(raw_data), 3, steppairs_line(over_limit_prompt(tokenizer, 96))
    )
    cfg = steppairs_config(giant)
    counts = count_arm(cfg, tokenizer)
    assert counts.removed["row_over_length"] == 1
    table = format_counts(counts, cfg)
    assert re.search(r"(?m)^\s+row_over_length\s+1$", table)
    bounds = RowBounds.of(tokenizer, 96)
    assert f"row limit {bounds.chars} characters (16 x seq_len 96 x " in table


# --- bounded readers, at the library -----------------------------------------------------


def small_bounds(line_bytes: int) -> RowBounds:
    return RowBounds(chars=None, line_bytes=line_bytes, basis="test", line_basis="test bound")


def test_a_jsonl_line_at_the_bound_is_read_and_one_byte_over_is_refused(tmp_path):
    row = steppairs_line("p" * 100).rstrip("\n")
    path = tmp_path / "rows.jsonl"
    path.write_text(f"{steppairs_line('a')}{row}\n")
    assert len(list(iter_raw_rows(path, small_bounds(len(row))))) == 2
    with pytest.raises(BadInputData) as err:
        list(iter_raw_rows(path, small_bounds(len(row) - 1)))
    assert err.value.exit_code == BAD_INPUT
    assert str(err.value) == (
        f"{path} line 2: expected at most {len(row) - 1} bytes per line (test bound), "
        f"found {len(row)} bytes; is a newline missing?"
    )


GIANT_OPEN = b'{"prompt": "'
GIANT_CLOSE = b'", "initial_reason_steps": "", "chosen": "a", "rejected": "b"}'
GIANT_FOUND = len(GIANT_OPEN) + GIANT_LINE_BYTES + len(GIANT_CLOSE)


def sparse_giant_line(path: Path, before: list[str], after: list[str]) -> Path:
    """JSONL whose line len(before)+1 is a row with a 1 GiB prompt of NUL bytes: the file
    is sparse, so the prompt takes no disk."""
    with open(path, "wb") as fh:
        fh.write("".join(before).encode() + GIANT_OPEN)
        fh.truncate(fh.tell() + GIANT_LINE_BYTES)
    with open(path, "ab") as fh:
        fh.write(GIANT_CLOSE + b"\n" + "".join(after).encode())
    return path


def test_readers_that_tokenize_nothing_hold_at_most_their_default_bound(tmp_path, raw_data):
    lines = default_lines(raw_data)
    path = sparse_giant_line(tmp_path / "steppairs.jsonl", lines[:2], lines[2:])
    tracemalloc.start()
    try:
        with pytest.raises(BadInputData) as err:
            list(default_texts([path]))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"{path} line 3: expected at most {DEFAULT_LINE_BYTES} bytes per line" in str(err.value)
    # readline joins the pieces it read: a capped line costs about twice the cap, not 1 GiB.
    assert peak < 3 * DEFAULT_LINE_BYTES < GIANT_LINE_BYTES


def write_parquet(path: Path, rows: list[dict], row_group_size: int) -> Path:
    table = pa.Table.from_pylist(rows)
    pq.write_table(table, path, row_group_size=row_group_size, compression="zstd")
    return path


def step_rows(n: int) -> list[dict]:
    return [
        {"prompt": f"What is {i} + 1?", "initial_reason_steps": "", "chosen": "a", "rejected": "b"}
        for i in range(n)
    ]


def test_a_parquet_row_group_over_the_memory_bound_is_refused_before_it_is_read(
    tmp_path, monkeypatch
):
    path = write_parquet(tmp_path / "rows.parquet", step_rows(6), row_group_size=3)
    monkeypatch.setattr(formats, "PARQUET_ROW_GROUP_BYTES", 1)
    with pytest.raises(BadInputData) as err:
        list(iter_raw_rows(path))
    message = str(err.value)
    assert message.startswith(f"{path} rows 1-3 (row group 0): expected at most 1 bytes")
    assert "row_group_size=N" in message


def test_an_empty_parquet_row_group_is_no_row_over_the_bound(tmp_path):
    # An empty group still holds a few bytes of page headers, and no row to share them.
    path = tmp_path / "rows.parquet"
    table = pa.Table.from_pylist(step_rows(2))
    with pq.ParquetWriter(path, table.schema) as writer:
        writer.write_table(table.slice(0, 0))
        writer.write_table(table)
    assert pq.ParquetFile(path).metadata.row_group(0).num_rows == 0
    rows = list(iter_raw_rows(path, small_bounds(1 << 10)))
    assert [row.row for row in rows] == [1, 2]


# --- SFT rows ------------------------------------------------------------------------------


def test_an_sft_row_over_the_limit_is_removed_as_row_over_length_and_counted(tmp_path, tokenizer):
    bounds = RowBounds.of(tokenizer, 8)
    rows = [{"prompt": f"Say {i}.", "response": f"{i}"} for i in range(20)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    cfg = SftDataConfig(files=[str(path)], seq_len=8, held_fraction=0.3)
    without, none_removed = tokenize_sft_splits(cfg, tokenizer)
    assert none_removed == {"row_over_length": 0}
    # The plain join ends the prompt with one newline: chars - 3 + 1 + 2 = the limit.
    at_limit = {"prompt": "z" * (bounds.chars - 3), "response": "ok"}
    over = {"prompt": "z" * bounds.chars, "response": "ok"}
    path.write_text("".join(json.dumps(row) + "\n" for row in [*rows[:4], over, *rows[4:]]))
    arrays, removed = tokenize_sft_splits(cfg, tokenizer)
    assert removed == {"row_over_length": 1}
    assert {s: a["ids"].tobytes() for s, a in arrays.items()} == {
        s: a["ids"].tobytes() for s, a in without.items()
    }
    path.write_text("".join(json.dumps(row) + "\n" for row in [*rows, at_limit]))
    arrays, removed = tokenize_sft_splits(cfg, tokenizer)
    assert removed == {"row_over_length": 0}
    assert sum(len(split["length"]) for split in arrays.values()) == len(rows) + 1


# --- (b), (c) through `align preregister`, under an address-space limit --------------------


def limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def preregister(data: Path, tokenizer_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    files = json.dumps([str(data)])
    command = [sys.executable, "-m", "align.cli", "preregister", str(STEPPAIRS_TOML)]
    command += [f"--checkpoint={tokenizer_dir}", f"--data.files={files}", *overrides]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=data.parent,
        env={**os.environ, **CHILD_ENV},
        preexec_fn=limit_address_space,
    )


def refusal_line(run: subprocess.CompletedProcess) -> str:
    """The one line `align preregister` refused with; no traceback, nothing counted."""
    assert run.returncode == BAD_INPUT, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith("align preregister: ")
    assert "align preregister: arm" not in run.stdout
    return lines[0]


def test_a_1gib_jsonl_line_is_refused_with_exit_4_naming_the_file_and_line(
    tmp_path, raw_data, tokenizer, tokenizer_dir
):
    lines = default_lines(raw_data)
    over = steppairs_line(over_limit_prompt(tokenizer, 96))
    readable = with_line(tmp_path, lines, 5, over)
    # Under the same limit, the same file with a readable long row in its place is counted.
    control = preregister(readable, tokenizer_dir)
    assert control.returncode == 0, control.stderr[-3000:]
    assert re.search(r"(?m)^\s+row_over_length\s+1$", control.stdout), control.stdout
    giant = sparse_giant_line(tmp_path / "giant.jsonl", lines[:5], lines[5:])
    assert giant.stat().st_blocks * 512 < 1 << 20
    line = refusal_line(preregister(giant, tokenizer_dir))
    bounds = RowBounds.of(tokenizer, 96)
    assert line == (
        f"align preregister: {giant} line 6: expected at most {bounds.line_bytes} bytes per "
        f"line ({bounds.line_basis}), found {GIANT_FOUND} bytes; is a newline missing?"
    )


def test_a_parquet_cell_over_the_row_bound_is_refused_with_exit_4_naming_its_rows(
    tmp_path, tokenizer, tokenizer_dir
):
    seq_len = 8
    bounds = RowBounds.of(tokenizer, seq_len)
    rows = step_rows(9)
    # Row 5 of 9, in the second row group of three: over three rows' worth of the bound.
    rows[4]["prompt"] = "p" * (3 * bounds.line_bytes + 1)
    path = write_parquet(tmp_path / "steppairs.parquet", rows, row_group_size=3)
    control = preregister(
        write_parquet(tmp_path / "control.parquet", step_rows(9), row_group_size=3),
        tokenizer_dir,
        f"--seq_len={seq_len}",
        "--max_prompt_tokens=none",
    )
    assert control.returncode == 0, control.stderr[-3000:]
    line = refusal_line(
        preregister(path, tokenizer_dir, f"--seq_len={seq_len}", "--max_prompt_tokens=none")
    )
    size = pq.ParquetFile(path).metadata.row_group(1).column(0).total_uncompressed_size
    assert line == (
        f"align preregister: {path} rows 4-6 (row group 1): column 'prompt' expected at most "
        f"{bounds.line_bytes} bytes per row ({bounds.line_basis}), found {size} bytes in 3 rows"
    )
