"""Reading, filtering, splitting, truncating and sharding preference pairs (align.data)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from align.config import ArmConfig, FilterConfig, TinyConfig, load_config
from align.data.build import build_arm, prepare_arm, write_arms
from align.data.chat_template import ChatTemplate, ChatTemplateError
from align.data.filters import REASONS, FilterCounts, active_reasons, classify
from align.data.formats import PreferenceRecord, expand_files, iter_records
from align.data.shards import (
    PAIR_FORMAT,
    GrowingArray,
    PairShardBuilder,
    pair_arrays,
    read_metadata,
    read_shard,
    write_shard,
)
from align.data.split import normalize_prompt, pair_id, split_of
from align.data.synthetic import default_texts, write_default_data
from align.data.tokenize import (
    PromptRenderer,
    TokenizedPair,
    render_prompt,
    tokenize_pairs,
    tokenize_sft,
    truncate_pair,
)
from align.exit_codes import BAD_INPUT, GATE_REFUSED, BadInputData, ConfigError, GateRefused
from align.model.tokenizer import (
    PAD_FROM_CONFIG,
    AlignTokenizer,
    default_tokenizer_config,
    load_tokenizer,
    tokenizer_hash,
    train_bpe_tokenizer,
)
from align.paths import SPLITS, ArmPaths, RunPaths
from align.receipts import (
    DESCOPED,
    PASSED,
    hash_file,
    make_receipt,
    read_json,
    write_json_atomic,
)
from align.stages import gates

ARMS = Path(__file__).resolve().parents[1] / "config" / "arms"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pd.DataFrame(rows).to_parquet(path, index=False)
    return path


WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet}


def read_all(tmp_path: Path, fmt: str, rows: list[dict], kind: str) -> list[PreferenceRecord]:
    path = WRITERS[kind](tmp_path / f"{fmt}.{kind}", rows)
    return list(iter_records([path], fmt))


# --- readers -----------------------------------------------------------------------------

ARGILLA_ROWS = [
    {
        "system": "Answer briefly.",
        "input": "What is 2 + 2?",
        "chosen": "4",
        "rejected": "5",
        "status": "unchanged",
        "chosen_score": 9.0,
        "in_gsm8k_train": False,
    },
    {
        "system": "  ",
        "input": "What is 3 - 1?",
        "chosen": "2",
        "rejected": "1",
        "status": "tie",
        "chosen_score": 7.5,
        "in_gsm8k_train": True,
    },
]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_argilla_reader_joins_system_and_input_and_keeps_meta(tmp_path, kind):
    first, second = read_all(tmp_path, "argilla", ARGILLA_ROWS, kind)
    assert (first.prompt, first.chosen, first.rejected) == (
        "Answer briefly.\nWhat is 2 + 2?",
        "4",
        "5",
    )
    assert first.meta == {"status": "unchanged", "chosen_score": 9.0, "in_gsm8k_train": False}
    # A blank system prompt adds nothing to the prompt.
    assert second.prompt == "What is 3 - 1?"
    assert second.meta == {"status": "tie", "chosen_score": 7.5, "in_gsm8k_train": True}
    assert (first.row, second.row) == (1, 2)
    assert first.source == str(tmp_path / f"argilla.{kind}")


def test_argilla_reader_leaves_absent_filter_columns_out_of_meta(tmp_path):
    # Absent and null differ: a declared filter refuses the first and judges the second.
    rows = [{"input": "q", "chosen": "a", "rejected": "b", "chosen_score": None}]
    (record,) = read_all(tmp_path, "argilla", rows, "jsonl")
    assert record.prompt == "q"
    assert record.meta == {"chosen_score": None}
    assert record.prompt_messages() == (("user", "q"),)


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_steppairs_reader_appends_the_initial_steps_to_the_prompt(tmp_path, kind):
    rows = [
        {
            "prompt": "1 + 2 + 3 = ?  ",
            "initial_reason_steps": "Step 1: 1 + 2 = 3.\n",
            "chosen": "Step 2: 3 + 3 = 6.",
            "rejected": "Step 2: 3 + 3 = 7.",
        }
    ]
    (record,) = read_all(tmp_path, "steppairs", rows, kind)
    assert record.prompt == "1 + 2 + 3 = ?\nStep 1: 1 + 2 = 3."
    assert (record.chosen, record.rejected) == ("Step 2: 3 + 3 = 6.", "Step 2: 3 + 3 = 7.")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_pairs_reader_reads_the_three_columns(tmp_path, kind):
    rows = [
        {"prompt": "p1", "chosen": "c1", "rejected": "r1", "extra": 1},
        {"prompt": "p2", "chosen": "c2", "rejected": "r2", "extra": 2},
    ]
    records = read_all(tmp_path, "pairs", rows, kind)
    assert [(r.prompt, r.chosen, r.rejected, r.row) for r in records] == [
        ("p1", "c1", "r1", 1),
        ("p2", "c2", "r2", 2),
    ]


def conversation(answer: str, system: str | None = None) -> list[dict]:
    turns = [{"role": "system", "content": system}] if system else []
    return [*turns, {"role": "user", "content": "Hi?"}, {"role": "assistant", "content": answer}]


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_ultrafeedback_reader_with_a_prompt_column(tmp_path, kind):
    rows = [
        {"prompt": "Say hi.", "chosen": conversation("Hello!"), "rejected": conversation("No.")}
    ]
    (record,) = read_all(tmp_path, "ultrafeedback", rows, kind)
    assert (record.prompt, record.chosen, record.rejected) == ("Say hi.", "Hello!", "No.")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_ultrafeedback_reader_without_prompt_joins_the_earlier_turns(tmp_path, kind):
    rows = [
        {"chosen": conversation("Hello!", "Be kind."), "rejected": conversation("No.", "Be kind.")}
    ]
    (record,) = read_all(tmp_path, "ultrafeedback", rows, kind)
    assert (record.prompt, record.chosen, record.rejected) == ("Be kind.\nHi?", "Hello!", "No.")


def test_records_come_in_file_then_row_order(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a1", "chosen": "x", "rejected": "y"}])
    b = write_jsonl(
        tmp_path / "b.jsonl", [{"prompt": f"b{i}", "chosen": "x", "rejected": "y"} for i in (1, 2)]
    )
    assert [r.prompt for r in iter_records([a, b], "pairs")] == ["a1", "b1", "b2"]


def test_expand_files_sorts_glob_matches(tmp_path):
    for name in ("c.jsonl", "a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("{}\n")
    assert [p.name for p in expand_files([str(tmp_path / "*.jsonl")])] == [
        "a.jsonl",
        "b.jsonl",
        "c.jsonl",
    ]


# --- bad input ---------------------------------------------------------------------------


def bad_input(files: list[Path], fmt: str = "pairs") -> str:
    with pytest.raises(BadInputData) as err:
        list(iter_records(files, fmt))
    assert err.value.exit_code == BAD_INPUT == 4
    return str(err.value)


GOOD = {"prompt": "p", "chosen": "c", "rejected": "r"}


def test_missing_column_names_file_line_and_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, {"prompt": "p", "chosen": "c"}])
    message = bad_input([path])
    assert f"{path} line 2" in message
    assert "missing column 'rejected'" in message
    assert "chosen, prompt" in message


def test_wrong_type_names_expected_and_found(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD, {**GOOD, "chosen": 5}])
    message = bad_input([path])
    assert f"{path} line 3" in message
    assert "'chosen' expected str, found int 5" in message


def test_bool_where_a_score_belongs_is_refused(tmp_path):
    # true is not a score: letting it through would compare True (== 1) against min_chosen_score.
    row = {"input": "q", "chosen": "a", "rejected": "b", "chosen_score": True}
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    message = bad_input([path], "argilla")
    assert f"{path} line 1" in message
    assert "'chosen_score'" in message
    assert "found bool" in message


def test_non_utf8_bytes_name_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "\xff\xfe"}\n')
    message = bad_input([path])
    assert f"{path} line 2" in message
    assert "not UTF-8" in message


def test_truncated_json_line_names_the_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + '{"prompt": "p", "cho')
    message = bad_input([path])
    # The blank line still counts, so the number matches what an editor shows.
    assert f"{path} line 3" in message
    assert "not valid JSON" in message


NON_FINITE = [float("nan"), float("inf"), float("-inf")]


def write_arrow_parquet(path: Path, rows: list[dict]) -> Path:
    """Parquet through pyarrow alone: pandas would store a NaN as null."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("value", NON_FINITE, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    ("kind", "unit"), [("jsonl", "line"), ("parquet", "row")], ids=["jsonl", "parquet"]
)
def test_non_finite_score_is_refused_naming_file_row_column_and_value(tmp_path, kind, unit, value):
    # json reads NaN / Infinity literals as floats; min_chosen_score would drop them quietly.
    rows = [ARGILLA_ROWS[0], {**ARGILLA_ROWS[1], "chosen_score": value}]
    writer = write_jsonl if kind == "jsonl" else write_arrow_parquet
    path = writer(tmp_path / f"d.{kind}", rows)
    if kind == "jsonl":
        assert ("NaN" if value != value else "Infinity") in path.read_text()
    message = bad_input([path], "argilla")
    assert f"{path} {unit} 2: column 'chosen_score' expected a finite number, found {value!r}" in (
        message
    )


def test_non_finite_score_stops_the_build_instead_of_failing_the_filter(tmp_path, tokenizer):
    rows = [{**ARGILLA_ROWS[0], "input": f"q{i}"} for i in range(5)]
    rows[3]["chosen_score"] = float("nan")
    path = write_jsonl(tmp_path / "argilla.jsonl", rows)
    cfg = load_config(
        ARMS / "argilla.toml",
        ArmConfig,
        [f"--data.files={json.dumps([str(path)])}", "--min_pairs=1"],
    ).cfg
    with pytest.raises(BadInputData) as err:
        prepare_arm(cfg, tokenizer)
    assert err.value.exit_code == BAD_INPUT
    assert f"{path} line 4: column 'chosen_score'" in str(err.value)


def test_json_line_that_is_not_an_object_is_refused(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('["p", "c", "r"]\n')
    message = bad_input([path])
    assert f"{path} line 1" in message
    assert "expected a JSON object, found list" in message


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["empty", "blank-lines"])
def test_empty_jsonl_file_is_refused(tmp_path, content):
    path = tmp_path / "d.jsonl"
    path.write_text(content)
    message = bad_input([path])
    assert str(path) in message
    assert "empty file" in message


def test_empty_parquet_file_is_refused(tmp_path):
    path = tmp_path / "d.parquet"
    pd.DataFrame({"prompt": pd.Series([], dtype=str)}).to_parquet(path)
    message = bad_input([path])
    assert str(path) in message
    assert "empty" in message


def test_glob_matching_nothing_is_refused_naming_the_pattern(tmp_path):
    pattern = str(tmp_path / "missing-*.jsonl")
    with pytest.raises(BadInputData) as err:
        expand_files([pattern])
    assert err.value.exit_code == BAD_INPUT
    assert pattern in str(err.value)
    assert "matches no file" in str(err.value)


def test_no_files_at_all_is_refused():
    with pytest.raises(BadInputData, match=r"data\.files is empty"):
        expand_files([])


def test_parquet_with_a_wrongly_typed_column_names_the_row(tmp_path):
    rows = [GOOD, {"prompt": "p", "chosen": "c", "rejected": "r"}]
    frame = pd.DataFrame(rows)
    frame["chosen"] = [1, 2]
    path = tmp_path / "d.parquet"
    frame.to_parquet(path, index=False)
    message = bad_input([path])
    assert f"{path} row 1" in message
    assert "'chosen' expected str, found int 1" in message


def test_parquet_missing_a_column_names_the_row(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "p", "response": "c"}])
    message = bad_input([path])
    assert f"{path} row 1" in message
    assert "missing column 'chosen'" in message


def test_unreadable_parquet_is_refused(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"not parquet at all")
    assert str(path) in bad_input([path])


def test_unsupported_file_type_is_refused(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,chosen,rejected\n")
    message = bad_input([path])
    assert "'.csv'" in message


@pytest.mark.parametrize(
    ("chosen", "found"),
    [
        ([{"role": "user", "content": "Hi?"}], "ending with an assistant turn"),
        ([], "ending with an assistant turn"),
        ([{"role": "assistant"}], "message 0"),
        ("Hello", "expected list"),
    ],
)
def test_malformed_message_lists_are_refused(tmp_path, chosen, found):
    path = write_jsonl(tmp_path / "d.jsonl", [{"chosen": chosen, "rejected": conversation("No.")}])
    message = bad_input([path], "ultrafeedback")
    assert f"{path} line 1" in message
    assert found in message


def test_unknown_format_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    assert "'csv'" in bad_input([path], "csv")


# --- filters -----------------------------------------------------------------------------


def rec(prompt="p", chosen="c", rejected="r", **meta) -> PreferenceRecord:
    return PreferenceRecord(prompt, chosen, rejected, "test", 0, meta)


STRICT = FilterConfig(exclude_status=["tie"], min_chosen_score=8.0, exclude_in_gsm8k_train=True)
GOOD_META = {"status": "unchanged", "chosen_score": 9.0, "in_gsm8k_train": False}


def kept_by_filters(records, cfg: FilterConfig, counts: FilterCounts) -> list:
    """The build's text-filter pass: every row classified by the live filters and counted."""
    kept = []
    for record, reason in classify(records, cfg):
        counts.add(reason)
        if reason is None:
            kept.append(record)
    return kept


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (rec(**{**GOOD_META, "status": "tie"}), "status_excluded"),
        (rec(**{**GOOD_META, "chosen_score": 7.9}), "chosen_score_below_min"),
        (rec(**{**GOOD_META, "chosen_score": None}), "chosen_score_below_min"),
        (rec(**{**GOOD_META, "chosen_score": float("nan")}), "chosen_score_below_min"),
        (rec(**{**GOOD_META, "in_gsm8k_train": True}), "in_gsm8k_train"),
        (rec(chosen=" \n", **GOOD_META), "empty_response"),
        (rec(rejected="", **GOOD_META), "empty_response"),
        (rec(chosen="same", rejected="same", **GOOD_META), "chosen_equals_rejected"),
    ],
)
def test_each_filter_removes_what_it_names(record, reason):
    counts = FilterCounts()
    kept = kept_by_filters([record, rec(prompt="keep", **GOOD_META)], STRICT, counts)
    assert [r.prompt for r in kept] == ["keep"]
    assert counts.as_dict() == {"read": 2, "kept": 1, "removed": {reason: 1}}
    counts.check_reconciles()


def test_score_at_the_minimum_is_kept():
    counts = FilterCounts()
    assert len(kept_by_filters([rec(**{**GOOD_META, "chosen_score": 8.0})], STRICT, counts)) == 1


def test_default_filters_keep_what_strict_ones_remove():
    records = [
        rec(prompt="a", status="tie"),
        rec(prompt="b", chosen_score=1.0),
        rec(prompt="c", in_gsm8k_train=True),
    ]
    counts = FilterCounts()
    assert len(kept_by_filters(records, FilterConfig(), counts)) == 3
    assert counts.removed == {}


def test_duplicate_pairs_are_counted_and_counts_reconcile():
    records = [
        rec(prompt="a", **GOOD_META),
        rec(prompt="a", **GOOD_META),
        rec(prompt="a", **GOOD_META),
        rec(prompt="a", chosen="other", **GOOD_META),
        rec(prompt="b", **{**GOOD_META, "status": "tie"}),
        rec(prompt="b", **{**GOOD_META, "status": "tie"}),
        rec(prompt="c", chosen="", **GOOD_META),
    ]
    counts = FilterCounts()
    kept = kept_by_filters(records, STRICT, counts)
    assert [(r.prompt, r.chosen) for r in kept] == [("a", "c"), ("a", "other")]
    assert counts.as_dict() == {
        "read": 7,
        "kept": 2,
        "removed": {"duplicate_pair": 2, "empty_response": 1, "status_excluded": 2},
    }
    assert counts.read == counts.kept + sum(counts.removed.values())
    counts.check_reconciles()
    assert set(counts.removed) <= set(REASONS)


def test_counts_that_do_not_reconcile_are_caught():
    counts = FilterCounts()
    kept_by_filters([rec()], FilterConfig(), counts)
    counts.read += 1
    with pytest.raises(AssertionError, match="reconcile"):
        counts.check_reconciles()


# --- split -------------------------------------------------------------------------------

WORDS = st.text(alphabet="abcXYZ 19?", min_size=1, max_size=20)


def spelling_variants(prompt: str) -> list[str]:
    """Spellings of one prompt that normalize to the same text."""
    return [prompt, prompt.upper(), prompt.lower(), f"  {prompt}\n", prompt.replace(" ", " \t ")]


@settings(max_examples=50, deadline=None)
@given(
    prompts=st.lists(WORDS, min_size=1, max_size=20),
    held_fraction=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31),
)
def test_no_normalized_prompt_lands_in_two_splits(prompts, held_fraction, seed):
    split_by_prompt: dict[str, set[str]] = {}
    for prompt in prompts:
        for variant in spelling_variants(prompt):
            split = split_of(variant, held_fraction, seed)
            assert split in SPLITS
            assert split == split_of(variant, held_fraction, seed)
            split_by_prompt.setdefault(normalize_prompt(variant), set()).add(split)
    assert all(len(splits) == 1 for splits in split_by_prompt.values()), split_by_prompt


def test_split_is_stable_across_processes():
    # Python's str hash is salted per process; a split must not depend on it.
    prompts = [f"question {i}?" for i in range(40)]
    here = [split_of(p, 0.3, 7) for p in prompts]
    code = (
        "import json, sys; from align.data.split import split_of; "
        f"print(json.dumps([split_of(p, 0.3, 7) for p in {prompts!r}]))"
    )
    there = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert here == there


def test_held_fraction_extremes_and_seed_dependence():
    prompts = [f"question {i}?" for i in range(200)]
    assert {split_of(p, 0.0, 1) for p in prompts} == {"train"}
    assert {split_of(p, 1.0, 1) for p in prompts} == {"held"}
    held = sum(split_of(p, 0.25, 1) == "held" for p in prompts)
    assert 25 <= held <= 75
    assert [split_of(p, 0.5, 1) for p in prompts] != [split_of(p, 0.5, 2) for p in prompts]


def test_pair_id_is_stable_and_content_sensitive():
    assert pair_id("p", "c", "r") == pair_id("p", "c", "r")
    assert pair_id("p", "c", "r") != pair_id("p", "r", "c")
    assert 0 <= pair_id("p", "c", "r") < 2**63


# --- truncation --------------------------------------------------------------------------

BOS = 1


def test_pair_that_fits_is_unchanged():
    prompt, chosen, rejected = [BOS, 10, 11], [20, 21, 2], [30, 2]
    assert truncate_pair(prompt, chosen, rejected, 6) == (prompt, chosen, rejected, False)


def test_long_prompt_loses_tokens_from_the_left_keeping_bos():
    prompt = [BOS, *range(100, 120)]
    p, c, r, truncated = truncate_pair(prompt, [20, 21, 2], [30, 2], 10)
    assert truncated
    assert p == [BOS, *range(114, 120)]
    assert (c, r) == ([20, 21, 2], [30, 2])


def test_long_response_is_cut_from_the_right():
    p, c, r, truncated = truncate_pair([BOS, 10, 11], [*range(200, 220), 2], [30, 2], 12)
    assert truncated
    # The prompt keeps at least half of seq_len, so it is not cut here.
    assert p == [BOS, 10, 11]
    assert c == list(range(200, 209))
    assert r == [30, 2]


def test_prompt_keeps_half_of_seq_len_when_both_are_long():
    p, c, _, truncated = truncate_pair([BOS, *range(100, 130)], [*range(200, 230)], [30], 16)
    assert truncated
    assert p == [BOS, *range(123, 130)]
    assert c == list(range(200, 208))


@settings(max_examples=50, deadline=None)
@given(
    prompt_len=st.integers(1, 60),
    chosen_len=st.integers(1, 60),
    rejected_len=st.integers(1, 60),
    seq_len=st.integers(2, 80),
)
def test_truncation_never_exceeds_seq_len(prompt_len, chosen_len, rejected_len, seq_len):
    prompt = [BOS, *range(100, 100 + prompt_len - 1)]
    chosen, rejected = list(range(200, 200 + chosen_len)), list(range(300, 300 + rejected_len))
    p, c, r, truncated = truncate_pair(prompt, chosen, rejected, seq_len)
    assert len(p) + len(c) <= seq_len
    assert len(p) + len(r) <= seq_len
    assert p[0] == BOS
    kept_prompt_tail = prompt[len(prompt) - (len(p) - 1) :] if len(p) > 1 else []
    assert p[1:] == kept_prompt_tail
    assert c == chosen[: len(c)]
    assert r == rejected[: len(r)]
    assert len(p) >= min(prompt_len, seq_len // 2)
    assert truncated == ((p, c, r) != (prompt, chosen, rejected))


# --- build_arm ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def raw_data(tmp_path_factory) -> dict[str, Path]:
    return write_default_data(
        tmp_path_factory.mktemp("raw"), seed=0, n_argilla=120, n_steppairs=60, n_sft=20
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, raw_data):
    directory = train_bpe_tokenizer(
        list(default_texts(raw_data)), 300, tmp_path_factory.mktemp("tok")
    )
    return load_tokenizer(directory)


def arm_config(arm: str, raw_data: dict[str, Path], *overrides: str) -> ArmConfig:
    files = json.dumps([str(raw_data[arm])])
    return load_config(
        ARMS / f"{arm}.toml", ArmConfig, [f"--data.files={files}", "--min_pairs=1", *overrides]
    ).cfg


@pytest.mark.parametrize("arm", ["argilla", "steppairs"])
def test_build_arm_writes_shards_and_receipts_whose_counts_match(
    tmp_path, raw_data, tokenizer, arm
):
    cfg = arm_config(arm, raw_data)
    paths = ArmPaths(tmp_path / "results", arm)
    entry = build_arm(cfg, tokenizer, paths)
    assert entry["status"] == PASSED
    counts = entry["counts"]
    lines = len(raw_data[arm].read_text().splitlines())
    assert counts["read"] == lines
    assert counts["read"] == counts["kept"] + sum(counts["removed"].values())
    assert counts["kept"] == counts["train"] + counts["held"]
    assert counts["train"] > 0 and counts["held"] > 0
    assert entry["sources"] == {str(raw_data[arm]): hash_file(raw_data[arm])}
    for split in SPLITS:
        shard = read_shard(paths.shard(split))
        n = len(shard["pair_id"])
        assert n == counts[split] == entry["shards"][split]["pairs"]
        # Named relative to the results directory, so a moved run finds its own shards.
        assert entry["shards"][split]["path"] == f"data/{arm}/{split}/pairs.safetensors"
        assert entry["shards"][split]["hash"] == hash_file(paths.shard(split))
        assert read_json(paths.shard_receipt(split)) == {
            "arm": arm,
            "split": split,
            **entry["shards"][split],
        }
        assert shard["chosen_ids"].shape[0] == shard["rejected_ids"].shape[0] == n
        assert int(shard["chosen_len"].max()) <= cfg.data.seq_len
        assert int(shard["rejected_len"].max()) <= cfg.data.seq_len
        assert (shard["prompt_len"] < shard["chosen_len"]).all()
        assert (shard["chosen_ids"][:, 0] == tokenizer.bos_id).all()
        assert entry["shards"][split]["chosen_tokens"] == int(
            (shard["chosen_len"] - shard["prompt_len"]).sum()
        )
    train_ids = set(read_shard(paths.shard("train"))["pair_id"].tolist())
    held_ids = set(read_shard(paths.shard("held"))["pair_id"].tolist())
    assert not train_ids & held_ids


def test_argilla_build_applies_the_preregistered_filters(tmp_path, raw_data, tokenizer):
    entry = build_arm(arm_config("argilla", raw_data), tokenizer, ArmPaths(tmp_path, "argilla"))
    rows = [json.loads(line) for line in raw_data["argilla"].read_text().splitlines()]
    ties = sum(r["status"] == "tie" for r in rows)
    assert entry["counts"]["removed"]["status_excluded"] == ties > 0


def test_build_arm_is_descoped_when_min_pairs_exceeds_kept(tmp_path, raw_data, tokenizer):
    kept = build_arm(
        arm_config("steppairs", raw_data), tokenizer, ArmPaths(tmp_path / "a", "steppairs")
    )["counts"]["kept"]
    at_minimum = build_arm(
        arm_config("steppairs", raw_data, f"--min_pairs={kept}"),
        tokenizer,
        ArmPaths(tmp_path / "b", "steppairs"),
    )
    assert at_minimum["status"] == PASSED
    above = build_arm(
        arm_config("steppairs", raw_data, f"--min_pairs={kept + 1}"),
        tokenizer,
        ArmPaths(tmp_path / "c", "steppairs"),
    )
    assert above["status"] == DESCOPED
    assert f"kept {kept} pairs" in above["reason"]
    assert f"data.min_pairs={kept + 1}" in above["reason"]


def test_building_twice_gives_byte_identical_shards(tmp_path, raw_data, tokenizer):
    # The reference cache is keyed by the shard's hash: a rebuild must not invalidate it.
    cfg = arm_config("argilla", raw_data)
    builds = [ArmPaths(tmp_path / f"build{i}", "argilla") for i in range(3)]
    entries = [build_arm(cfg, tokenizer, paths) for paths in builds]
    for split in SPLITS:
        first = builds[0].shard(split).read_bytes()
        for paths in builds[1:]:
            assert paths.shard(split).read_bytes() == first, f"{split} shard differs between builds"
        assert len({e["shards"][split]["hash"] for e in entries}) == 1


def test_build_arm_reports_truncated_pairs(tmp_path, raw_data, tokenizer):
    entry = build_arm(
        arm_config("steppairs", raw_data, "--seq_len=12"),
        tokenizer,
        ArmPaths(tmp_path, "steppairs"),
    )
    assert (
        entry["truncated_pairs"]["train"] + entry["truncated_pairs"]["held"]
        == entry["counts"]["kept"]
    )
    for split in SPLITS:
        assert (
            int(read_shard(ArmPaths(tmp_path, "steppairs").shard(split))["chosen_len"].max()) <= 12
        )


def test_build_arm_refuses_bad_input_with_exit_4(tmp_path, raw_data, tokenizer):
    bad = tmp_path / "bad.jsonl"
    lines = raw_data["steppairs"].read_text().splitlines()
    bad.write_text("\n".join([*lines[:5], lines[5][:-10], *lines[6:]]) + "\n")
    cfg = load_config(
        ARMS / "steppairs.toml", ArmConfig, [f"--data.files={json.dumps([str(bad)])}"]
    ).cfg
    with pytest.raises(BadInputData) as err:
        build_arm(cfg, tokenizer, ArmPaths(tmp_path / "results", "steppairs"))
    assert err.value.exit_code == BAD_INPUT
    assert f"{bad} line 6" in str(err.value)
    assert not (tmp_path / "results").exists()


# --- readers: prompt turns for the chat template -----------------------------------------


def test_argilla_reader_gives_the_system_and_user_turns(tmp_path):
    first, second = read_all(tmp_path, "argilla", ARGILLA_ROWS, "jsonl")
    assert first.prompt_messages() == (
        ("system", "Answer briefly."),
        ("user", "What is 2 + 2?"),
    )
    assert second.prompt_messages() == (("user", "What is 3 - 1?"),)


def test_steppairs_reader_puts_the_steps_after_the_user_turn(tmp_path):
    rows = [
        {
            "prompt": "1 + 2 + 3 = ?",
            "initial_reason_steps": "Step 1: 1 + 2 = 3.\n",
            "chosen": "Step 2: 3 + 3 = 6.",
            "rejected": "Step 2: 3 + 3 = 7.",
        }
    ]
    (record,) = read_all(tmp_path, "steppairs", rows, "jsonl")
    assert record.prompt_messages() == (("user", "1 + 2 + 3 = ?"),)
    assert record.response_prefix == "Step 1: 1 + 2 = 3.\n"


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_ultrafeedback_reader_gives_the_earlier_turns(tmp_path, kind):
    rows = [
        {"chosen": conversation("Hello!", "Be kind."), "rejected": conversation("No.", "Be kind.")}
    ]
    (record,) = read_all(tmp_path, "ultrafeedback", rows, kind)
    assert record.prompt_messages() == (("system", "Be kind."), ("user", "Hi?"))


def test_ultrafeedback_turns_that_differ_between_chosen_and_rejected_are_refused(tmp_path):
    rejected = [{"role": "user", "content": "Bye?"}, {"role": "assistant", "content": "No."}]
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"chosen": conversation("Hi!"), "rejected": rejected}]
    )
    message = bad_input([path], "ultrafeedback")
    assert f"{path} line 1" in message
    assert "the same turns before the final assistant turn" in message


def test_ultrafeedback_without_any_prompt_is_refused(tmp_path):
    only_answer = [{"role": "assistant", "content": "Hello!"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"chosen": only_answer, "rejected": only_answer}])
    assert "no prompt" in bad_input([path], "ultrafeedback")


def test_ultrafeedback_parquet_with_strings_for_message_lists_is_refused(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", [{"prompt": "p", "chosen": "c", "rejected": "r"}])
    message = bad_input([path], "ultrafeedback")
    assert f"{path} row 1" in message
    assert "'chosen' expected list, found str" in message


def test_parquet_null_in_a_text_column_names_the_row(tmp_path):
    path = write_parquet(
        tmp_path / "d.parquet", [GOOD, GOOD, {"prompt": "p", "chosen": None, "rejected": "r"}]
    )
    message = bad_input([path])
    assert f"{path} row 3" in message
    assert "'chosen' expected str, found NoneType" in message


def test_a_file_named_twice_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [GOOD])
    with pytest.raises(BadInputData, match="named twice"):
        expand_files([str(path), str(tmp_path / "*.jsonl")])


def test_glob_over_jsonl_and_parquet_reads_both_in_name_order(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", [{"prompt": "a", "chosen": "x", "rejected": "y"}])
    write_parquet(tmp_path / "b.parquet", [{"prompt": "b", "chosen": "x", "rejected": "y"}])
    files = expand_files([str(tmp_path / "*")])
    assert [r.prompt for r in iter_records(files, "pairs")] == ["a", "b"]


# --- filters: declared columns, active reasons --------------------------------------------


@pytest.mark.parametrize(
    ("column", "key"),
    [
        ("status", "exclude_status"),
        ("chosen_score", "min_chosen_score"),
        ("in_gsm8k_train", "exclude_in_gsm8k_train"),
    ],
)
def test_a_declared_filter_refuses_a_row_without_its_column(column, key):
    meta = {k: v for k, v in GOOD_META.items() if k != column}
    record = PreferenceRecord("p", "c", "r", "d.jsonl", 7, meta)
    with pytest.raises(BadInputData) as err:
        kept_by_filters([record], STRICT, FilterCounts())
    assert err.value.exit_code == BAD_INPUT
    assert "d.jsonl line 7" in str(err.value)
    assert f"data.filters.{key}" in str(err.value)
    assert repr(column) in str(err.value)


def test_every_active_filter_is_reported_even_when_it_removes_nothing():
    argilla = load_config(ARMS / "argilla.toml", ArmConfig).cfg.data
    steppairs = load_config(ARMS / "steppairs.toml", ArmConfig).cfg.data
    assert active_reasons(argilla) == REASONS
    assert set(active_reasons(steppairs)) == {
        "empty_response",
        "chosen_equals_rejected",
        "duplicate_pair",
        "row_over_length",
        "prompt_over_budget",
    }
    counts = FilterCounts(active_reasons(steppairs))
    kept_by_filters([rec()], steppairs.filters, counts)
    assert counts.as_dict()["removed"] == dict.fromkeys(sorted(active_reasons(steppairs)), 0)


def test_counts_reconcile_per_source_and_per_split():
    counts = FilterCounts(("empty_response",))
    counts.add(None, "a", "train")
    counts.add("empty_response", "a", "held")
    counts.add("empty_response", "b", "held")
    counts.check_reconciles()
    assert counts.by_source["b"].as_dict() == {
        "read": 1,
        "kept": 0,
        "removed": {"empty_response": 1},
    }
    assert counts.by_split["held"].as_dict() == {
        "read": 2,
        "kept": 0,
        "removed": {"empty_response": 2},
    }
    counts.by_split["train"].read += 1
    with pytest.raises(AssertionError, match="split train"):
        counts.check_reconciles()


@pytest.mark.parametrize("token", ["--max_prompt_tokens=0", "--max_prompt_tokens=-3"])
def test_max_prompt_tokens_must_be_positive(token):
    with pytest.raises(ConfigError) as err:
        load_config(ARMS / "steppairs.toml", ArmConfig, [token])
    assert "'data.max_prompt_tokens'" in str(err.value)
    assert f"found {token.split('=')[1]}" in str(err.value)


# --- chat template -------------------------------------------------------------------------

# Mistral-7B-Instruct-v0.1's template: alternating user/assistant turns, no system turn.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)
# A Mistral template that folds the system turn into the last user turn (v0.3 style).
MISTRAL_SYSTEM_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message['role'] == 'user' %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token }}
    {%- endif %}
{%- endfor %}
"""
# Block tags on lines of their own: they vanish only with trim_blocks and lstrip_blocks.
TRIM_TEMPLATE = """{% for message in messages %}
    {% if message['role'] == 'user' %}
[U]{{ message['content'] }}
    {% endif %}
{% endfor %}
"""
# ChatML without a bos, with the generation block and the tojson filter.
CHATML_TEMPLATE = (
    "{% for message in messages %}{% if loop.index0 > 8 %}{% break %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    "{{ '' if tools is none else tools | tojson }}"
)
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}
TEMPLATES = {
    "mistral": MISTRAL_TEMPLATE,
    "system": MISTRAL_SYSTEM_TEMPLATE,
    "chatml": CHATML_TEMPLATE,
}


def with_template(tokenizer, template: str | None) -> AlignTokenizer:
    return AlignTokenizer(tokenizer.backend, default_tokenizer_config(), chat_template=template)


def test_mistral_template_renders_like_transformers_documents_it():
    template = ChatTemplate(MISTRAL_TEMPLATE, SPECIAL, "test")
    assert template.render([{"role": "user", "content": "What is 2 + 2?"}]) == (
        "<s>[INST] What is 2 + 2? [/INST]"
    )
    turns = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    assert template.render(turns) == "<s>[INST] Hi [/INST]Hello</s>[INST] Bye [/INST]"


def test_system_turn_folds_into_the_user_turn_where_the_template_says_so():
    template = ChatTemplate(MISTRAL_SYSTEM_TEMPLATE, SPECIAL, "test")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert template.render(messages) == "<s>[INST] Be brief.\n\nHi[/INST]"


def test_block_tags_on_their_own_lines_leave_no_whitespace():
    template = ChatTemplate(TRIM_TEMPLATE, SPECIAL, "test")
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert template.render(turns) == "[U]Hi\n"


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendering_matches_transformers(name, generation_prompt):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    conversations = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        [{"role": "user", "content": 'Quote "<b>" & \\n'}],
    ]
    ours = ChatTemplate(TEMPLATES[name], SPECIAL, "test")
    for messages in conversations:
        (theirs,), _ = chat_utils.render_jinja_template(
            conversations=[messages],
            chat_template=TEMPLATES[name],
            add_generation_prompt=generation_prompt,
            **SPECIAL,
        )
        assert ours.render(messages, add_generation_prompt=generation_prompt) == theirs


def test_template_that_does_not_compile_is_bad_input():
    with pytest.raises(
        BadInputData, match=r"ckpt/tokenizer_config.json: chat template does not compile"
    ):
        ChatTemplate("{% for m in messages %}", SPECIAL, "ckpt/tokenizer_config.json")


def test_template_sandbox_refuses_unsafe_access():
    template = ChatTemplate("{{ messages.__class__.__mro__ }}", SPECIAL, "test")
    with pytest.raises(ChatTemplateError, match=r"SecurityError|UndefinedError"):
        template.render([{"role": "user", "content": "x"}])


def mistral_record(prompt="What is 2 + 2?", chosen="4", rejected="5", **kwargs):
    return PreferenceRecord(prompt, chosen, rejected, "d.jsonl", 1, **kwargs)


def test_template_prompt_has_one_bos_and_labels_cover_the_response_only(tokenizer):
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    (pair,) = tokenize_pairs([mistral_record()], tok, 64, PromptRenderer(tok))
    assert pair.prompt == [tok.bos_id, *tok.encode("[INST] What is 2 + 2? [/INST]")]
    assert pair.prompt.count(tok.bos_id) == 1
    assert pair.chosen == [*tok.encode("4"), tok.eos_id]
    assert pair.rejected == [*tok.encode("5"), tok.eos_id]
    arrays = pair_arrays([7], [pair], tok.pad_id)
    batch_rows = arrays["chosen_ids"][0, : arrays["chosen_len"][0]].tolist()
    assert batch_rows[arrays["prompt_len"][0] :] == pair.chosen


def test_template_without_bos_gets_one_added(tokenizer):
    tok = with_template(tokenizer, CHATML_TEMPLATE)
    (ids,) = PromptRenderer(tok).ids([mistral_record(prompt="Hi")])
    assert ids == [
        tok.bos_id,
        *tok.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ]


def test_steps_follow_the_generation_prompt(tokenizer):
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    record = mistral_record(
        prompt="1 + 2 + 3 = ?\nStep 1: 1 + 2 = 3.",
        messages=(("user", "1 + 2 + 3 = ?"),),
        response_prefix="Step 1: 1 + 2 = 3.\n",
    )
    assert PromptRenderer(tok).text(record) == "<s>[INST] 1 + 2 + 3 = ? [/INST]Step 1: 1 + 2 = 3.\n"


def test_template_refusing_a_system_turn_is_bad_input_naming_the_row(tokenizer):
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    record = mistral_record(messages=(("system", "Be brief."), ("user", "Hi")))
    with pytest.raises(BadInputData) as err:
        PromptRenderer(tok).text(record)
    assert err.value.exit_code == BAD_INPUT
    assert "d.jsonl line 1" in str(err.value)
    assert "Conversation roles must alternate" in str(err.value)
    assert "set data.merge_system_into_user = true" in str(err.value)
    merged = PromptRenderer(tok, merge_system_into_user=True).text(record)
    assert merged == "<s>[INST] Be brief.\n\nHi [/INST]"


def test_build_with_a_template_refusing_system_turns_names_file_row_and_setting(
    raw_data, tokenizer
):
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    with pytest.raises(BadInputData) as err:
        prepare_arm(arm_config("argilla", raw_data), tok)
    assert f"{raw_data['argilla']} line 1: " in str(err.value)
    assert "set data.merge_system_into_user = true" in str(err.value)
    merged = prepare_arm(arm_config("argilla", raw_data, "--merge_system_into_user=true"), tok)
    assert merged.counts.kept > 0


def test_a_template_refusal_the_setting_cannot_fix_names_the_setting_as_it_is(tokenizer):
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    record = mistral_record(messages=(("user", "Hi"), ("user", "Again")))
    with pytest.raises(BadInputData) as err:
        PromptRenderer(tok).text(record)
    assert "roles ['user', 'user'] (data.merge_system_into_user = false)" in str(err.value)


def test_without_a_template_the_plain_join_is_used(tokenizer):
    renderer = PromptRenderer(with_template(tokenizer, None))
    assert renderer.kind == "plain"
    record = mistral_record(
        messages=(("system", "Be brief."), ("user", "Hi")), prompt="Be brief.\nHi"
    )
    assert renderer.text(record) == render_prompt("Be brief.\nHi")
    assert renderer.ids([record]) == [[tokenizer.bos_id, *tokenizer.encode("Be brief.\nHi\n")]]


def test_sft_rows_use_the_template_too(tokenizer):
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    ((ids, prompt_len),) = tokenize_sft(["Hi"], ["Hello"], tok, 64)
    assert ids[:prompt_len] == [tok.bos_id, *tok.encode("[INST] Hi [/INST]")]
    assert ids[prompt_len:] == [*tok.encode("Hello"), tok.eos_id]


def test_arm_built_with_a_template_decodes_to_the_rendered_text(tmp_path, raw_data, tokenizer):
    tok = with_template(tokenizer, MISTRAL_TEMPLATE)
    paths = ArmPaths(tmp_path, "steppairs")
    entry = build_arm(arm_config("steppairs", raw_data), tok, paths)
    assert entry["prompt_rendering"] == "chat_template"
    shard = read_shard(paths.shard("train"))
    prompt = shard["chosen_ids"][0, : shard["prompt_len"][0]].tolist()
    assert prompt[0] == tok.bos_id and prompt.count(tok.bos_id) == 1
    assert tok.decode(prompt).startswith("[INST] ")
    assert "[/INST]Step 1:" in tok.decode(prompt)


# --- shards --------------------------------------------------------------------------------


def random_pairs(n: int, seed: int = 0) -> list[TokenizedPair]:
    rng = np.random.default_rng(seed)

    def ids(low: int, high: int) -> list[int]:
        return [int(x) for x in rng.integers(4, 300, rng.integers(low, high))]

    return [
        TokenizedPair([BOS, *ids(0, 9)], [*ids(0, 9), 2], [*ids(0, 9), 2], False) for _ in range(n)
    ]


@pytest.mark.parametrize("n", [0, 1, 4097])
def test_streamed_shard_is_byte_identical_to_the_library_writer(tmp_path, n):
    pairs, ids = random_pairs(n), list(range(10, 10 + n))
    write_shard(tmp_path / "lib.safetensors", pair_arrays(ids, pairs, 3), PAIR_FORMAT, split="x")
    builder = PairShardBuilder()
    for pid, pair in zip(ids, pairs, strict=True):
        builder.add(pid, pair)
    tokens_hash = builder.write(tmp_path / "streamed.safetensors", 3, split="x")
    data = (tmp_path / "streamed.safetensors").read_bytes()
    assert data == (tmp_path / "lib.safetensors").read_bytes()
    header = int.from_bytes(data[:8], "little")
    assert tokens_hash == hashlib.sha256(data[8 + header :]).hexdigest()
    assert read_metadata(tmp_path / "streamed.safetensors") == {"format": PAIR_FORMAT, "split": "x"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lib.safetensors", "streamed.safetensors"]


def test_growing_array_keeps_everything_appended():
    array = GrowingArray(np.int32, capacity=2)
    array.extend([1, 2, 3])
    array.append(4)
    array.extend([])
    array.extend(list(range(5, 100)))
    assert array.values.tolist() == list(range(1, 100))


# --- build: reconciliation, split, truncation, budget --------------------------------------


def pairs_rows(prompts: list[str], tag: str = "") -> list[dict]:
    return [
        {"prompt": p, "chosen": f"yes {tag}{i}", "rejected": f"no {tag}{i}"}
        for i, p in enumerate(prompts)
    ]


def pairs_config(files: list[Path], *overrides: str) -> ArmConfig:
    return load_config(
        ARMS / "steppairs.toml",
        ArmConfig,
        [
            "--data.format=pairs",
            f"--data.files={json.dumps([str(f) for f in files])}",
            "--min_pairs=1",
            "--expected_train_pairs=none",
            "--expected_held_pairs=none",
            *overrides,
        ],
    ).cfg


def test_counts_reconcile_per_source_file_and_per_split(tmp_path, tokenizer):
    prompts = [f"question {i}?" for i in range(60)]
    a = pairs_rows(prompts[:30], "a")
    a += [a[0], a[1], {**a[2], "chosen": " "}, {**a[3], "rejected": a[3]["chosen"]}]
    b = [*pairs_rows(prompts[30:], "b"), a[0]]
    files = [write_jsonl(tmp_path / "a.jsonl", a), write_parquet(tmp_path / "b.parquet", b)]
    cfg = pairs_config(files, "--held_fraction=0.3")
    paths = ArmPaths(tmp_path / "results", "pairs")
    entry = build_arm(cfg, tokenizer, paths)

    by_source = entry["counts_by_source"]
    assert by_source[str(files[0])]["read"] == len(a)
    assert by_source[str(files[0])]["removed"]["duplicate_pair"] == 2
    assert by_source[str(files[0])]["removed"]["empty_response"] == 1
    assert by_source[str(files[0])]["removed"]["chosen_equals_rejected"] == 1
    # A pair first seen in a.jsonl is a duplicate when b.parquet repeats it.
    assert by_source[str(files[1])]["removed"]["duplicate_pair"] == 1
    levels = [entry["counts"], *by_source.values(), *(entry["shards"][s]["counts"] for s in SPLITS)]
    for level in levels:
        assert level["read"] == level["kept"] + sum(level["removed"].values())
    assert sum(c["read"] for c in by_source.values()) == entry["counts"]["read"] == len(a) + len(b)

    rows_by_split = {s: 0 for s in SPLITS}
    for row in a + b:
        rows_by_split[split_of(row["prompt"], 0.3, cfg.data.split_seed)] += 1
    for split in SPLITS:
        counts = entry["shards"][split]["counts"]
        assert counts["read"] == rows_by_split[split]
        assert (
            counts["kept"]
            == entry["counts"][split]
            == len(read_shard(paths.shard(split))["pair_id"])
        )
        assert read_json(paths.shard_receipt(split))["counts"] == counts


@settings(max_examples=15, deadline=None)
@given(prompts=st.lists(WORDS, min_size=2, max_size=12), seed=st.integers(0, 2**31))
def test_no_prompt_lands_in_both_shards(tokenizer, prompts, seed):
    variants = [v for p in prompts for v in spelling_variants(p)]
    with tempfile.TemporaryDirectory() as tmp:
        source = write_jsonl(Path(tmp) / "d.jsonl", pairs_rows(variants))
        cfg = pairs_config([source], "--held_fraction=0.5", f"--split_seed={seed}")
        paths = ArmPaths(Path(tmp) / "results", "pairs")
        build_arm(cfg, tokenizer, paths)
        prompt_of = {
            pair_id(r["prompt"], r["chosen"], r["rejected"]): r["prompt"]
            for r in pairs_rows(variants)
        }
        normalized = {
            split: {
                normalize_prompt(prompt_of[i])
                for i in read_shard(paths.shard(split))["pair_id"].tolist()
            }
            for split in SPLITS
        }
    assert not normalized["train"] & normalized["held"]
    assert normalized["train"] | normalized["held"] == {normalize_prompt(p) for p in variants}


def test_truncated_pairs_are_counted_per_split(tmp_path, raw_data, tokenizer):
    seq_len = 20
    paths = ArmPaths(tmp_path, "steppairs")
    cfg = arm_config("steppairs", raw_data, f"--seq_len={seq_len}", "--max_prompt_tokens=none")
    entry = build_arm(cfg, tokenizer, paths)
    for split in SPLITS:
        shard = read_shard(paths.shard(split))
        assert int(shard["chosen_len"].max()) <= seq_len
        assert int(shard["rejected_len"].max()) <= seq_len
        assert entry["truncated_pairs"][split] == entry["shards"][split]["truncated_pairs"]
    records = [r for r in iter_records([raw_data["steppairs"]], "steppairs")]
    tokenized = tokenize_pairs(records, tokenizer, 10_000)
    long_pairs = {
        split_of(r.prompt, cfg.data.held_fraction, cfg.data.split_seed)
        for r, t in zip(records, tokenized, strict=True)
        if len(t.prompt) + max(len(t.chosen), len(t.rejected)) > seq_len
    }
    assert long_pairs == set(SPLITS)
    assert (
        0
        < entry["truncated_pairs"]["train"] + entry["truncated_pairs"]["held"]
        <= entry["counts"]["kept"]
    )


def test_prompts_over_the_budget_are_removed_after_tokenization(tmp_path, raw_data, tokenizer):
    records = list(iter_records([raw_data["steppairs"]], "steppairs"))
    lengths = sorted(len(t.prompt) for t in tokenize_pairs(records, tokenizer, 10_000))
    budget = lengths[len(lengths) // 2]
    cfg = arm_config("steppairs", raw_data, f"--max_prompt_tokens={budget}")
    paths = ArmPaths(tmp_path, "steppairs")
    entry = build_arm(cfg, tokenizer, paths)
    removed = entry["counts"]["removed"]["prompt_over_budget"]
    unique = {
        (r.prompt, r.chosen, r.rejected): t
        for r, t in zip(records, tokenize_pairs(records, tokenizer, 10_000), strict=True)
    }
    assert removed == sum(len(t.prompt) > budget for t in unique.values()) > 0
    for split in SPLITS:
        assert int(read_shard(paths.shard(split))["prompt_len"].max()) <= budget
    assert entry["counts"]["read"] == entry["counts"]["kept"] + sum(
        entry["counts"]["removed"].values()
    )


def test_chosen_longer_fraction_is_over_all_kept_pairs_in_tokens(tmp_path, raw_data, tokenizer):
    paths = ArmPaths(tmp_path, "argilla")
    entry = build_arm(arm_config("argilla", raw_data), tokenizer, paths)
    shards = [read_shard(paths.shard(split)) for split in SPLITS]
    longer = sum(int((s["chosen_len"] > s["rejected_len"]).sum()) for s in shards)
    assert entry["chosen_longer_fraction"] == pytest.approx(longer / entry["counts"]["kept"])


def test_an_empty_split_descopes_the_arm(tmp_path, raw_data, tokenizer):
    entry = build_arm(
        arm_config("steppairs", raw_data, "--held_fraction=1e-12"),
        tokenizer,
        ArmPaths(tmp_path, "steppairs"),
    )
    assert entry["counts"]["held"] == 0
    assert entry["status"] == DESCOPED
    assert "split held has no pairs" in entry["reason"]


# --- the stage: refuse-or-write-all, determinism, the manifest gate ------------------------

BUILD_SCRIPT = ARMS.parents[1] / "workflow" / "scripts" / "build_manifest.py"
ARM_TOMLS = [str(ARMS / "argilla.toml"), str(ARMS / "steppairs.toml")]


def stub_sft_gate(results: Path, checkpoint: Path) -> None:
    """A passed SFT gate receipt naming `checkpoint`: all build_manifest reads of it."""
    receipt = make_receipt(
        "sft_gate",
        PASSED,
        config_hash=None,
        overrides=None,
        inputs=None,
        outputs=None,
        started_at="test",
        passed=True,
        checkpoint=str(checkpoint),
    )
    write_json_atomic(RunPaths.of(results).sft_gate, receipt)


def run_build(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # The stub gate's checkpoint lies outside results/: the run must name it.
    sft_checkpoint = "--run.sft_checkpoint=resources/tiny/tokenizer"
    return subprocess.run(
        [sys.executable, str(BUILD_SCRIPT), *args, sft_checkpoint],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def default_workdir(tmp_path_factory) -> Path:
    """The embedded default data and tokenizer, as rule tiny_default writes them."""
    work = tmp_path_factory.mktemp("default")
    tiny = load_config(ARMS.parent / "tiny" / "tiny.toml", TinyConfig).cfg
    files = write_default_data(
        work / "resources" / "tiny" / "data",
        tiny.seed,
        tiny.n_argilla,
        tiny.n_steppairs,
        tiny.n_sft,
    )
    train_bpe_tokenizer(
        default_texts(files), tiny.vocab_size, work / "resources" / "tiny" / "tokenizer"
    )
    stub_sft_gate(work / "results", work / "resources" / "tiny" / "tokenizer")
    return work


def data_outputs(results: Path) -> list[Path]:
    return sorted(p for p in (results / "data").rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def default_build(default_workdir) -> dict:
    run = run_build(default_workdir, *ARM_TOMLS)
    assert run.returncode == 0, run.stderr
    return read_json(RunPaths.of(default_workdir / "results").manifest)


def test_default_build_twice_is_identical_and_matches_the_preregistration(
    default_workdir, default_build
):
    results = default_workdir / "results"
    first = {p: p.read_bytes() for p in data_outputs(results)}
    run = run_build(default_workdir, *ARM_TOMLS)
    assert run.returncode == 0, run.stderr
    second = read_json(RunPaths.of(results).manifest)
    assert second["arms"] == default_build["arms"]
    assert second["pins"] == default_build["pins"]
    for path, data in first.items():
        if path.suffix == ".safetensors" or path.name == "receipt.json":
            assert path.read_bytes() == data, f"{path} differs between builds"
    for arm, entry in second["arms"].items():
        cfg = load_config(ARMS / f"{arm}.toml", ArmConfig).cfg
        assert entry["counts"]["train"] == cfg.data.expected_train_pairs
        assert entry["counts"]["held"] == cfg.data.expected_held_pairs
        assert entry["status"] == PASSED


def test_manifest_records_the_pins(default_workdir, default_build):
    checkpoint = default_workdir / "resources" / "tiny" / "tokenizer"
    tokenizer = load_tokenizer(checkpoint)
    assert default_build["pins"] == {
        "tokenizer_checkpoint": str(checkpoint),
        "tokenizer_hash": tokenizer_hash(checkpoint),
        "chat_template": False,
        "chat_template_hash": None,
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "pad_id": tokenizer.pad_id,
        "pad_source": PAD_FROM_CONFIG,
    }
    for arm, entry in default_build["arms"].items():
        cfg = load_config(ARMS / f"{arm}.toml", ArmConfig).cfg
        assert (entry["seq_len"], entry["truncation"], entry["format"]) == (
            cfg.data.seq_len,
            cfg.data.truncation,
            cfg.data.format,
        )
        source = default_workdir / cfg.data.files[0]
        assert entry["sources"] == {str(source): hash_file(source)}
        assert 0.0 <= entry["chosen_longer_fraction"] <= 1.0
        for split in SPLITS:
            shard = entry["shards"][split]
            assert shard["hash"] == hash_file(default_workdir / "results" / shard["path"])
            assert set(shard) >= {
                "tokens_hash",
                "pairs",
                "chosen_tokens",
                "rejected_tokens",
                "counts",
            }


def gate_entry(workdir: Path, arm: str, *overrides: str, checkpoint: Path | None = None):
    cfg = load_config(ARMS / f"{arm}.toml", ArmConfig, list(overrides)).cfg
    checkpoint = checkpoint or workdir / "resources" / "tiny" / "tokenizer"
    return gates.manifest_entry(RunPaths.of(workdir / "results"), cfg, checkpoint)


def refusal(workdir: Path, *args, **kwargs) -> str:
    with pytest.raises(GateRefused) as err:
        gate_entry(workdir, *args, **kwargs)
    assert err.value.exit_code == GATE_REFUSED
    return str(err.value)


def test_manifest_gate_passes_the_preregistered_build(default_workdir, default_build, monkeypatch):
    monkeypatch.chdir(default_workdir)
    for arm in ("argilla", "steppairs"):
        entry = gate_entry(default_workdir, arm)
        assert entry.counts == default_build["arms"][arm]["counts"]
        assert entry.pins == default_build["pins"]


@pytest.mark.parametrize(
    ("override", "thing", "want", "found"),
    [
        ("--expected_train_pairs=449", "train pairs (data.expected_train_pairs)", "449", "448"),
        ("--expected_held_pairs=101", "held pairs (data.expected_held_pairs)", "101", "102"),
        ("--seq_len=128", "data.seq_len", "128", "96"),
        ("--data.format=pairs", "data.format", "'pairs'", "'argilla'"),
        ("--max_prompt_tokens=50", "data.max_prompt_tokens", "50", "64"),
        ("--min_chosen_score=7.0", "data.filters.min_chosen_score", "7.0", "8.0"),
        ("--split_seed=18", "data.split_seed", "18", "17"),
        ("--held_fraction=0.25", "data.held_fraction", "0.25", "0.2"),
        ("--min_pairs=300", "data.min_pairs", "300", "200"),
    ],
)
def test_manifest_gate_refuses_each_pinned_difference(
    default_workdir, default_build, monkeypatch, override, thing, want, found
):
    monkeypatch.chdir(default_workdir)
    message = refusal(default_workdir, "argilla", override)
    assert "gate manifest" in message and "arm argilla" in message
    assert f"{thing} expected {want}, found {found}" in message


def test_manifest_gate_count_refusal_names_the_command_that_gives_the_counts(
    default_workdir, default_build, monkeypatch
):
    monkeypatch.chdir(default_workdir)
    message = refusal(default_workdir, "argilla", "--expected_train_pairs=449")
    toml = default_build["arms"]["argilla"]["config_source"]
    assert f"`align preregister {toml}` prints the counts this data gives" in message


def test_manifest_gate_refuses_a_preregistration_that_fixes_no_counts(
    default_workdir, default_build, monkeypatch
):
    monkeypatch.chdir(default_workdir)
    message = refusal(default_workdir, "argilla", "--expected_held_pairs=none")
    assert "data.expected_held_pairs is not pre-registered (this build gives 102)" in message
    assert "`align preregister " in message


def preregister(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "align.cli", "preregister", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_preregister_prints_the_counts_the_manifest_build_gives(default_workdir, default_build):
    checkpoint = default_workdir / "resources" / "tiny" / "tokenizer"
    written = {p: p.stat().st_mtime_ns for p in default_workdir.rglob("*") if p.is_file()}
    run = preregister(default_workdir, *ARM_TOMLS, f"--checkpoint={checkpoint}")
    assert run.returncode == 0, run.stderr
    assert {p: p.stat().st_mtime_ns for p in default_workdir.rglob("*") if p.is_file()} == written
    for arm, entry in default_build["arms"].items():
        counts = entry["counts"]
        section = run.stdout.split(f"arm {arm} ")[1].split("align preregister:")[0]
        table = dict(re.findall(r"(?m)^\s+(\w+)\s+(\d+)$", section))
        assert {k: int(table[k]) for k in ("read", "kept", "train", "held")} == {
            k: counts[k] for k in ("read", "kept", "train", "held")
        }
        assert {r: int(table[r]) for r in counts["removed"]} == counts["removed"]
        assert f"data.expected_train_pairs = {counts['train']} (matches)" in section


def test_preregister_write_fixes_counts_the_manifest_gate_then_passes(
    default_workdir, default_build, monkeypatch, tmp_path
):
    monkeypatch.chdir(default_workdir)
    toml = tmp_path / "argilla.toml"
    original = (ARMS / "argilla.toml").read_text()
    toml.write_text(original.replace("expected_held_pairs = 102", "expected_held_pairs = 7"))
    checkpoint = default_workdir / "resources" / "tiny" / "tokenizer"
    run = preregister(default_workdir, str(toml), f"--checkpoint={checkpoint}", "--write")
    assert run.returncode == 0, run.stderr
    assert "data.expected_held_pairs = 7 (DIFFERS)" in run.stdout
    written = toml.read_text()
    assert "expected_train_pairs = 448\nexpected_held_pairs = 102\n" in written
    source = default_workdir / "resources" / "tiny" / "data" / "argilla.jsonl"
    assert f"# preregister: resources/tiny/data/argilla.jsonl sha256 {hash_file(source)}" in written
    assert f"tokenizer of {checkpoint} sha256 {tokenizer_hash(checkpoint)}" in written
    kept = [line for line in original.splitlines() if "expected_" not in line]
    assert [
        line
        for line in written.splitlines()
        if "preregister" not in line and "expected_" not in line
    ] == kept
    cfg = load_config(toml, ArmConfig).cfg
    gates.manifest_entry(RunPaths.of(default_workdir / "results"), cfg, checkpoint)


def test_manifest_gate_refuses_another_truncation_policy(
    default_workdir, default_build, monkeypatch
):
    monkeypatch.chdir(default_workdir)
    manifest_path = RunPaths.of(default_workdir / "results").manifest
    original = manifest_path.read_text()
    manifest = json.loads(original)
    manifest["arms"]["argilla"]["truncation"] = "response_only"
    try:
        manifest_path.write_text(json.dumps(manifest))
        message = refusal(default_workdir, "argilla")
    finally:
        manifest_path.write_text(original)
    assert "data.truncation expected 'prompt_left_response_right', found 'response_only'" in message


def test_manifest_gate_refuses_another_tokenizer(
    default_workdir, default_build, monkeypatch, tmp_path
):
    monkeypatch.chdir(default_workdir)
    other = tmp_path / "other"
    shutil.copytree(default_workdir / "resources" / "tiny" / "tokenizer", other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": MISTRAL_TEMPLATE})
    )
    message = refusal(default_workdir, "argilla", checkpoint=other)
    assert (
        f"tokenizer hash (of the SFT checkpoint {other}) expected '{tokenizer_hash(other)}'"
        in message
    )
    assert default_build["pins"]["tokenizer_hash"] in message


def test_manifest_gate_refuses_a_changed_shard_and_an_absent_arm(
    default_workdir, default_build, monkeypatch
):
    monkeypatch.chdir(default_workdir)
    assert "arm 'other' absent" in refusal(default_workdir, "argilla", "--arm=other")
    shard = (
        default_workdir / "results" / default_build["arms"]["steppairs"]["shards"]["held"]["path"]
    )
    original = shard.read_bytes()
    try:
        shard.write_bytes(original[:-4] + b"\0\0\0\0")
        message = refusal(default_workdir, "steppairs")
    finally:
        shard.write_bytes(original)
    assert str(shard) in message and "content hash expected" in message


def test_bad_input_in_the_second_arm_exits_4_and_writes_nothing(tmp_path, default_workdir):
    shutil.copytree(default_workdir / "resources", tmp_path / "resources")
    stub_sft_gate(tmp_path / "results", tmp_path / "resources" / "tiny" / "tokenizer")
    bad = tmp_path / "resources" / "tiny" / "data" / "steppairs.jsonl"
    lines = bad.read_text().splitlines()
    bad.write_text("\n".join([*lines[:600], lines[600][:-7]]) + "\n")
    run = run_build(tmp_path, *ARM_TOMLS)
    assert run.returncode == BAD_INPUT, run.stderr
    assert "resources/tiny/data/steppairs.jsonl line 601: not valid JSON" in run.stderr
    assert not (tmp_path / "results" / "data").exists()


def test_a_failure_while_writing_removes_every_output(tmp_path, raw_data, tokenizer, monkeypatch):
    run_paths = RunPaths.of(tmp_path / "results")
    write_json_atomic(run_paths.manifest, {"stale": True})
    builds = [prepare_arm(arm_config(arm, raw_data), tokenizer) for arm in ("argilla", "steppairs")]
    real_write = PairShardBuilder.write

    def failing_write(self, path, *args, **kwargs):
        if "steppairs" in str(path) and "held" in str(path):
            raise OSError("disk full")
        return real_write(self, path, *args, **kwargs)

    monkeypatch.setattr(PairShardBuilder, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        write_arms(builds, tokenizer, run_paths, lambda arms: {"arms": arms})
    assert [p for p in (tmp_path / "results").rglob("*") if p.is_file()] == []


def test_write_arms_writes_the_manifest_last(tmp_path, raw_data, tokenizer):
    run_paths = RunPaths.of(tmp_path / "results")
    builds = [prepare_arm(arm_config("steppairs", raw_data), tokenizer)]

    def manifest(arms):
        for split in SPLITS:
            assert run_paths.arm("steppairs").shard(split).is_file()
        assert not run_paths.manifest.exists()
        return {"arms": arms}

    receipt = write_arms(builds, tokenizer, run_paths, manifest)
    assert read_json(run_paths.manifest) == json.loads(json.dumps(receipt))
