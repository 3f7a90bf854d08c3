"""Reading, filtering, splitting, truncating and sharding preference pairs (align.data)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from align.config import ArmConfig, FilterConfig, load_config
from align.data.build import build_arm
from align.data.filters import REASONS, FilterCounts, apply_filters, remove
from align.data.formats import PreferenceRecord, expand_files, iter_records
from align.data.shards import read_shard
from align.data.split import normalize_prompt, pair_id, split_of
from align.data.synthetic import default_texts, write_default_data
from align.data.tokenize import truncate_pair
from align.exit_codes import BAD_INPUT, BadInputData
from align.model.tokenizer import load_tokenizer, train_bpe_tokenizer
from align.paths import SPLITS, ArmPaths
from align.receipts import DESCOPED, PASSED, hash_file, read_json

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


def test_argilla_reader_treats_absent_optional_columns_as_none(tmp_path):
    rows = [{"input": "q", "chosen": "a", "rejected": "b"}]
    (record,) = read_all(tmp_path, "argilla", rows, "jsonl")
    assert record.prompt == "q"
    assert record.meta == {"status": None, "chosen_score": None, "in_gsm8k_train": None}


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


@pytest.mark.parametrize(
    ("record", "reason"),
    [
        (rec(**{**GOOD_META, "status": "tie"}), "status_excluded"),
        (rec(**{**GOOD_META, "chosen_score": 7.9}), "chosen_score_below_min"),
        (rec(**{**GOOD_META, "chosen_score": None}), "chosen_score_below_min"),
        (rec(**{**GOOD_META, "in_gsm8k_train": True}), "in_gsm8k_train"),
        (rec(chosen=" \n", **GOOD_META), "empty_response"),
        (rec(rejected="", **GOOD_META), "empty_response"),
        (rec(chosen="same", rejected="same", **GOOD_META), "chosen_equals_rejected"),
    ],
)
def test_each_filter_removes_what_it_names(record, reason):
    counts = FilterCounts()
    kept = list(apply_filters([record, rec(prompt="keep", **GOOD_META)], STRICT, counts))
    assert [r.prompt for r in kept] == ["keep"]
    assert counts.as_dict() == {"read": 2, "kept": 1, "removed": {reason: 1}}
    counts.check_reconciles()


def test_score_at_the_minimum_is_kept():
    counts = FilterCounts()
    assert (
        len(list(apply_filters([rec(**{**GOOD_META, "chosen_score": 8.0})], STRICT, counts))) == 1
    )


def test_default_filters_keep_what_strict_ones_remove():
    records = [
        rec(prompt="a", status="tie"),
        rec(prompt="b", chosen_score=1.0),
        rec(prompt="c", in_gsm8k_train=True),
    ]
    counts = FilterCounts()
    assert len(list(apply_filters(records, FilterConfig(), counts))) == 3
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
    kept = list(apply_filters(records, STRICT, counts))
    assert [(r.prompt, r.chosen) for r in kept] == [("a", "c"), ("a", "other")]
    assert counts.as_dict() == {
        "read": 7,
        "kept": 2,
        "removed": {"duplicate_pair": 2, "empty_response": 1, "status_excluded": 2},
    }
    assert counts.read == counts.kept + sum(counts.removed.values())
    counts.check_reconciles()
    assert set(counts.removed) <= set(REASONS)


def test_moving_a_row_to_a_later_reason_still_reconciles():
    counts = FilterCounts()
    list(apply_filters([rec(prompt="a"), rec(prompt="b")], FilterConfig(), counts))
    remove(counts, "empty_response")
    assert (counts.kept, counts.removed["empty_response"]) == (1, 1)
    counts.check_reconciles()


def test_counts_that_do_not_reconcile_are_caught():
    counts = FilterCounts()
    list(apply_filters([rec()], FilterConfig(), counts))
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
        assert entry["shards"][split]["path"] == str(paths.shard(split))
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
