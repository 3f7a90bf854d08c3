"""align's one log: the stage and rank prefix, rank 0 by default, and whole lines when ranks
share a log file."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

WRITER = """
import sys
from align.log import stage_logger
log = stage_logger("dpo")
for i in range(int(sys.argv[1])):
    log.info("rank line %d reduces in float32" % i)
log.warning("done")
"""


def run_writer(lines: int, rank: int, level: str | None, stderr) -> subprocess.Popen:
    env = {**os.environ, "RANK": str(rank)}
    env.pop("ALIGN_LOG_LEVEL", None)
    if level:
        env["ALIGN_LOG_LEVEL"] = level
    return subprocess.Popen([sys.executable, "-c", WRITER, str(lines)], env=env, stderr=stderr)


def test_two_ranks_lines_ran_into_one_line(tmp_path):
    log = tmp_path / "stage.log"
    with log.open("w") as shared:
        writers = [run_writer(2000, rank, "DEBUG", shared) for rank in (0, 1)]
        assert [w.wait(timeout=120) for w in writers] == [0, 0]
    lines = log.read_text().splitlines()
    assert len(lines) == 2 * 2001
    for line in lines:
        assert line.startswith(("align dpo: rank line", "align dpo rank 1: rank line")) or (
            line in ("align dpo: done", "align dpo rank 1: done")
        ), line
        assert line.count("align") == 1, line


@pytest.mark.parametrize(
    ("rank", "level", "shown"),
    [(0, None, 3), (1, None, 1), (1, "DEBUG", 3)],
)
def test_rank_zero_logs_by_default_and_every_rank_at_debug(tmp_path, rank, level, shown):
    log = tmp_path / "stage.log"
    with log.open("w") as out:
        assert run_writer(2, rank, level, out).wait(timeout=60) == 0
    assert len(log.read_text().splitlines()) == shown


def test_an_unknown_level_is_refused_naming_the_variable(tmp_path):
    log = tmp_path / "stage.log"
    with log.open("w") as out:
        assert run_writer(1, 0, "LOUD", out).wait(timeout=60) != 0
    assert "ALIGN_LOG_LEVEL='LOUD' is not a logging level" in log.read_text()


def test_a_log_file_keeps_space_reserved_past_its_end_after_each_line(tmp_path):
    """What lets a stage's last line reach a log on a filesystem that has since filled."""
    from align.log import LOG_RESERVE_BYTES, reserve_log_space

    log = tmp_path / "stage.log"
    with log.open("w") as handle:
        reserve_log_space(handle.fileno())
        status = os.fstat(handle.fileno())
    assert status.st_size == 0
    assert status.st_blocks * 512 >= LOG_RESERVE_BYTES


def test_a_base_exception_from_a_library_ends_the_stage_internal_with_its_line(tmp_path):
    """torch.distributed.checkpoint's CheckpointException derives from BaseException: it
    ended a stage with exit 1 and no line of ours."""
    script = (
        "from align.exit_codes import run_with_exit_codes\n"
        "class Gathered(BaseException): pass\n"
        "def main(): raise Gathered('rank 0 failed')\n"
        "run_with_exit_codes(main, 'probe')\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.returncode == 70, run.stderr
    assert run.stderr.splitlines()[-1] == "align probe: internal error (exit 70)"
    assert "Gathered: rank 0 failed" in run.stderr
