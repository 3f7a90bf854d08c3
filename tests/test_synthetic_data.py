"""The embedded default datasets (align.data.synthetic)."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from align.data.synthetic import default_texts, write_default_data, wrong_answer

ARGILLA_COLUMNS = {
    "system": str,
    "input": str,
    "chosen": str,
    "rejected": str,
    "generations": list,
    "order": list,
    "labelling_model": str,
    "labelling_prompt": list,
    "raw_labelling_response": str,
    "rating": list,
    "rationale": str,
    "status": str,
    "original_chosen": str,
    "original_rejected": str,
    "chosen_score": float,
    "in_gsm8k_train": bool,
}
STEPPAIRS_COLUMNS = (
    "dataset",
    "prompt",
    "initial_reason_steps",
    "chosen",
    "rejected",
    "full_chosen",
    "full_rejected",
    "answer",
)
ANSWER = re.compile(r"(\d+) (\+|-|plus|minus) (\d+) (?:=|is) (\d+)\. The answer is (\d+)\.$")
FIRST_STEP = re.compile(r"Step 1: (\d) \+ (\d) = (\d+)\.\n")
SECOND_STEP = re.compile(r"Step 2: (\d+) \+ (\d) = (\d+)\. The answer is (\d+)\.$")
COUNT_OR_COPY = re.compile(r"^(Count|List the numbers|Repeat|Copy|Say again)")
NUMBER = re.compile(r"\d+")
STEP_LABEL = re.compile(r"Step \d:")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _numbers(text: str) -> list[int]:
    return [int(n) for n in NUMBER.findall(text)]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    return write_default_data(tmp_path_factory.mktemp("data"), seed=0)


@pytest.fixture(scope="module")
def argilla(paths) -> list[dict]:
    return _read_jsonl(paths["argilla"])


@pytest.fixture(scope="module")
def steppairs(paths) -> list[dict]:
    return _read_jsonl(paths["steppairs"])


@pytest.fixture(scope="module")
def sft(paths) -> list[dict]:
    return _read_jsonl(paths["sft"])


def test_same_seed_gives_identical_bytes_and_another_seed_differs(tmp_path, paths):
    again = write_default_data(tmp_path / "same", seed=0)
    other = write_default_data(tmp_path / "other", seed=1)
    for name, path in paths.items():
        assert again[name].read_bytes() == path.read_bytes()
        assert other[name].read_bytes() != path.read_bytes()


def test_row_counts_follow_the_arguments(tmp_path):
    written = write_default_data(tmp_path, seed=0, n_argilla=30, n_steppairs=20, n_sft=10)
    counts = {name: len(_read_jsonl(path)) for name, path in written.items()}
    assert counts == {"argilla": 30, "steppairs": 20, "sft": 10}


def test_files_hold_sorted_key_json_lines(paths):
    for path in paths.values():
        for line in path.read_text(encoding="utf-8").splitlines():
            assert line == json.dumps(json.loads(line), sort_keys=True, ensure_ascii=False)


def test_argilla_rows_have_every_column_with_its_type(argilla):
    for row in argilla:
        assert set(row) == set(ARGILLA_COLUMNS)
        for column, kind in ARGILLA_COLUMNS.items():
            assert isinstance(row[column], kind), (column, row[column])
        assert row["labelling_model"] == "gpt-4-0613"
        assert [m["role"] for m in row["labelling_prompt"]] == ["system", "user"]
        assert all(isinstance(m["content"], str) for m in row["labelling_prompt"])
        assert all(isinstance(r, float) for r in row["rating"]) and len(row["rating"]) == 2
        assert sorted(row["order"]) == ["chosen", "rejected"]
        assert len(row["generations"]) == 2


def test_argilla_row_kinds_come_in_the_stated_shares(argilla):
    n = len(argilla)
    ties = [r for r in argilla if r["status"] == "tie"]
    low = [r for r in argilla if r["chosen_score"] < 8]
    gsm8k = [r for r in argilla if r["in_gsm8k_train"]]
    assert 0.05 * n <= len(ties) <= 0.11 * n
    assert 0.05 * n <= len(low) <= 0.11 * n
    assert 0.03 * n <= len(gsm8k) <= 0.07 * n
    assert set(Counter(r["status"] for r in argilla)) == {"unchanged", "swapped", "tie"}
    assert all(r["rating"][0] == r["rating"][1] for r in ties)
    rest = [r for r in argilla if r["status"] != "tie" and not r["in_gsm8k_train"] and r not in low]
    assert all(r["chosen_score"] >= 8 for r in rest)


def test_argilla_labels_are_consistent(argilla):
    for row in argilla:
        original = {"chosen": row["original_chosen"], "rejected": row["original_rejected"]}
        assert row["generations"] == [original[name] for name in row["order"]]
        rating_of = dict(zip(row["generations"], row["rating"], strict=True))
        assert row["chosen_score"] == rating_of[row["chosen"]]
        assert 0 <= row["chosen_score"] <= 10
        if row["status"] != "tie":
            assert rating_of[row["chosen"]] > rating_of[row["rejected"]]
        swapped = row["chosen"] == row["original_rejected"]
        assert swapped == (row["status"] == "swapped")
        assert row["raw_labelling_response"].startswith(" ".join(f"{r:g}" for r in row["rating"]))


def _check_answer_pair(question: str, chosen: str, rejected: str) -> None:
    a, op, b, stated, final = ANSWER.search(chosen).groups()
    a, b, stated, final = int(a), int(b), int(stated), int(final)
    right = a + b if op in ("+", "plus") else a - b
    assert stated == final == right, chosen
    assert sorted(_numbers(question)) == sorted([a, b]), question
    wrong_groups = ANSWER.search(rejected).groups()
    assert wrong_groups[:3] == (str(a), op, str(b))
    wrong = int(wrong_groups[3])
    assert wrong == int(wrong_groups[4]) and wrong != right and wrong >= 0
    assert abs(wrong - right) <= 2


def test_argilla_chosen_is_right_and_rejected_wrong(argilla):
    for row in argilla:
        assert row["chosen"] and row["rejected"] and row["chosen"] != row["rejected"]
        assert len(row["chosen"].split()) < 20 and len(row["rejected"].split()) < 20
        _check_answer_pair(row["input"], row["chosen"], row["rejected"])


def test_argilla_system_prompts_are_few_and_sometimes_empty(argilla):
    systems = Counter(row["system"] for row in argilla)
    assert "" in systems and 2 <= len(systems) <= 6


def test_steppairs_rows_are_right_then_right_or_wrong(steppairs):
    for row in steppairs:
        assert set(row) == set(STEPPAIRS_COLUMNS)
        assert all(isinstance(row[c], str) and row[c] for c in STEPPAIRS_COLUMNS)
        assert row["full_chosen"] == row["initial_reason_steps"] + row["chosen"]
        assert row["full_rejected"] == row["initial_reason_steps"] + row["rejected"]
        a, b, first = (int(g) for g in FIRST_STEP.fullmatch(row["initial_reason_steps"]).groups())
        assert first == a + b <= 9
        carried, c, stated, final = (int(g) for g in SECOND_STEP.fullmatch(row["chosen"]).groups())
        assert carried == first and stated == final == first + c == int(row["answer"]) <= 18
        assert sorted(_numbers(row["prompt"])) == sorted([a, b, c])
        w_carried, w_c, wrong, w_final = (
            int(g) for g in SECOND_STEP.fullmatch(row["rejected"]).groups()
        )
        assert (w_carried, w_c) == (first, c)
        assert wrong == w_final != final and wrong >= 0 and abs(wrong - final) <= 2


def test_sft_responses_never_state_a_result(sft):
    for row in sft:
        assert row.keys() == {"prompt", "response"} and row["prompt"] and row["response"]
        if COUNT_OR_COPY.match(row["prompt"]):
            continue
        response = STEP_LABEL.sub("", row["response"])
        assert "=" not in response
        assert not Counter(_numbers(response)) - Counter(_numbers(row["prompt"])), row


def test_sft_covers_both_formats_counting_and_copying(sft):
    responses = [row["response"] for row in sft]
    assert any(r.startswith("We add") for r in responses)
    assert any(r.startswith("We subtract") for r in responses)
    assert any(r.startswith("Step 1:") for r in responses)
    assert any(row["prompt"].startswith("Count") for row in sft)
    assert any(row["prompt"].startswith("Repeat:") for row in sft)
    copies = [row for row in sft if row["prompt"].startswith("Repeat: ")]
    assert all(row["response"] == row["prompt"].removeprefix("Repeat: ") for row in copies)


def test_each_arm_has_many_distinct_prompts(argilla, steppairs, sft):
    assert len({row["input"] for row in argilla}) > 200
    assert len({row["prompt"] for row in steppairs}) > 200
    assert len({row["prompt"] for row in sft}) > 200


def test_default_texts_yield_every_prompt_and_response(paths, argilla, steppairs, sft):
    texts = list(default_texts(paths))
    assert all(isinstance(t, str) and t for t in texts)
    as_set = set(texts)
    assert {r["input"] for r in argilla} <= as_set
    assert {r["rejected"] for r in argilla} <= as_set
    assert {r["full_chosen"] for r in steppairs} <= as_set
    assert {r["response"] for r in sft} <= as_set
    assert list(default_texts(list(paths.values()))) == texts


@given(right=st.integers(min_value=0, max_value=18), seed=st.integers(min_value=0, max_value=2**32))
def test_wrong_answer_is_near_nonnegative_and_never_right(right, seed):
    wrong = wrong_answer(random.Random(seed), right)
    assert wrong >= 0 and wrong != right and abs(wrong - right) <= 2
