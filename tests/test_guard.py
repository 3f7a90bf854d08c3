"""Resource guards: the heavy-job lock, the strict host check, run dirs off the root fs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from align.config import RunConfig
from align.exit_codes import PREFLIGHT_REFUSED, ConfigError, PreflightRefused
from align.utils.guard import (
    acquire_heavy_lock,
    apply_resource_guards,
    assert_expected_host,
    assert_paths_off_root,
    heavy_lock_path,
)


def take_lock_in_child(lock_path, mode: str) -> subprocess.CompletedProcess:
    code = (
        "from align.exit_codes import run_with_exit_codes\n"
        "from align.utils.guard import acquire_heavy_lock\n"
        f"run_with_exit_codes(lambda: acquire_heavy_lock({str(lock_path)!r}, {mode!r}, 'dpo'), 'dpo')\n"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_second_heavy_stage_is_refused_while_the_lock_is_held(tmp_path):
    lock_path = tmp_path / "heavy.lock"
    with FileLock(str(lock_path)):
        child = take_lock_in_child(lock_path, "refuse")
    assert child.returncode == PREFLIGHT_REFUSED
    assert "another heavy stage holds" in child.stderr


def test_heavy_lock_is_free_again_once_its_holder_exits(tmp_path):
    lock_path = tmp_path / "heavy.lock"
    assert take_lock_in_child(lock_path, "refuse").returncode == 0
    assert take_lock_in_child(lock_path, "refuse").returncode == 0


def test_inside_a_slurm_job_no_heavy_lock_is_taken(tmp_path, monkeypatch):
    lock_path = tmp_path / "heavy.lock"
    monkeypatch.setenv("SLURM_JOB_ID", "12345")
    with FileLock(str(lock_path)):
        child = take_lock_in_child(lock_path, "refuse")
    assert child.returncode == 0, child.stderr


def test_the_default_heavy_lock_is_this_users_own():
    path = heavy_lock_path("")
    assert path.name == f"align-heavy-{os.getuid()}.lock"
    assert heavy_lock_path("/somewhere/else.lock") == Path("/somewhere/else.lock")


def test_unknown_lock_mode_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.heavy_lock"):
        acquire_heavy_lock(tmp_path / "l", "sometimes", "dpo")


def test_strict_host_check_refuses_another_host():
    assert_expected_host(socket.gethostname())
    with pytest.raises(PreflightRefused, match="expected_host"):
        assert_expected_host("not-" + socket.gethostname())


def test_paths_on_the_root_filesystem_are_refused_when_required(tmp_path):
    with pytest.raises(PreflightRefused, match="root filesystem"):
        assert_paths_off_root("/var/tmp/align-run-that-does-not-exist")


def test_guards_follow_the_run_config(tmp_path):
    run = RunConfig(threads=1, heavy_lock="off", expected_host="elsewhere")
    with pytest.raises(PreflightRefused):
        apply_resource_guards(run, "dpo", [tmp_path])
