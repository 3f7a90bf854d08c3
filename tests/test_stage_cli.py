"""The DPO stage entry as Snakemake runs it: exit codes and one-line reasons on stderr."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from align.exit_codes import GATE_REFUSED, USAGE

ROOT = Path(__file__).resolve().parents[1]
DPO_SCRIPT = ROOT / "workflow" / "scripts" / "dpo.py"
ARGILLA = ROOT / "config" / "arms" / "argilla.toml"


def run_dpo(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(DPO_SCRIPT), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "argilla.toml"
    shutil.copyfile(ARGILLA, path)
    return path


def test_unknown_config_key_exits_2_naming_it_and_writes_nothing(tmp_path, config):
    config.write_text(config.read_text().replace("lr = 1e-3", "lr = 1e-3\nlrr = 5e-7"))
    result = run_dpo(tmp_path, str(config))
    assert result.returncode == USAGE == 2, result.stderr
    assert "'optimizer.lrr'" in result.stderr
    assert str(config) in result.stderr
    assert not (tmp_path / "results").exists()


def test_two_token_override_exits_2_naming_the_key(tmp_path, config):
    result = run_dpo(tmp_path, str(config), "lr", "5e-7")
    assert result.returncode == USAGE, result.stderr
    assert "'lr'" in result.stderr
    assert not (tmp_path / "results").exists()


def test_no_config_file_is_a_usage_error(tmp_path):
    result = run_dpo(tmp_path, "--lr=5e-7")
    assert result.returncode == USAGE, result.stderr
    assert "usage" in result.stderr


def test_valid_config_without_receipts_exits_3_naming_the_gate_and_file(tmp_path, config):
    result = run_dpo(tmp_path, str(config))
    assert result.returncode == GATE_REFUSED == 3, result.stderr
    assert "gate sft_gate" in result.stderr
    assert str(Path("results") / "sft" / "gate.json") in result.stderr
    assert "receipt missing" in result.stderr
    assert "Traceback" not in result.stderr
