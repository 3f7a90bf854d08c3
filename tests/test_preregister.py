"""Writing the expected counts into a pre-registration in place (align.data.preregister)."""

from __future__ import annotations

import tomllib

import pytest

from align.data.preregister import PROVENANCE_PREFIX, write_expected_counts
from align.exit_codes import ConfigError

NOTES = ["counted on 2026-01-01", "data/a.jsonl sha256 abc"]


def written(tmp_path, text: str, train: int = 10, held: int = 3) -> str:
    path = tmp_path / "arm.toml"
    path.write_text(text)
    write_expected_counts(path, {"train": train, "held": held}, NOTES)
    return path.read_text()


def test_counts_go_where_the_old_ones_were_and_nothing_else_moves(tmp_path):
    text = (
        'arm = "a"\n\n[data]\nformat = "pairs"\n# why these counts\n'
        "expected_train_pairs = 1\nexpected_held_pairs = 2\nseq_len = 64\n\n[batch]\nepochs = 1\n"
    )
    result = written(tmp_path, text)
    assert result == (
        'arm = "a"\n\n[data]\nformat = "pairs"\n# why these counts\n'
        f"{PROVENANCE_PREFIX}counted on 2026-01-01\n{PROVENANCE_PREFIX}data/a.jsonl sha256 abc\n"
        "expected_train_pairs = 10\nexpected_held_pairs = 3\nseq_len = 64\n\n[batch]\nepochs = 1\n"
    )
    (tmp_path / "arm.toml").write_text(result)
    write_expected_counts(tmp_path / "arm.toml", {"train": 11, "held": 4}, NOTES)
    again = (tmp_path / "arm.toml").read_text()
    assert again == result.replace("= 10\n", "= 11\n").replace("= 3\n", "= 4\n")


def test_counts_are_appended_to_a_data_table_without_them(tmp_path):
    text = '[data] # the source\nfiles = [\n  "a.jsonl",\n  "b.jsonl",\n]\n\n\n[data.filters]\nexclude_status = []\n'
    result = written(tmp_path, text)
    parsed = tomllib.loads(result)
    assert parsed["data"]["expected_train_pairs"] == 10
    assert parsed["data"]["files"] == ["a.jsonl", "b.jsonl"]
    assert result.index("expected_held_pairs") < result.index("[data.filters]")
    assert "]\nexpected_train_pairs" not in result and "]\n# preregister:" in result


def test_a_last_line_without_newline_stays_a_line_of_its_own(tmp_path):
    result = written(tmp_path, '[data]\nformat = "pairs"')
    assert tomllib.loads(result)["data"] == {
        "format": "pairs",
        "expected_train_pairs": 10,
        "expected_held_pairs": 3,
    }


def test_a_file_without_a_data_table_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"arm.toml: no \[data\] table"):
        written(tmp_path, 'arm = "a"\n[batch]\nepochs = 1\n')


def test_an_edit_that_would_change_anything_but_the_counts_is_refused(tmp_path):
    text = '[data]\nnote = """\nexpected_train_pairs = 1\n"""\n'
    with pytest.raises(ConfigError, match="would change more than the counts"):
        written(tmp_path, text)
    assert (tmp_path / "arm.toml").read_text() == text
