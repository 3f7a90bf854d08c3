"""Shared fixtures: one finished default workflow per test session."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_snakemake(workdir: Path, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "snakemake",
            "-s",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            *args,
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="session")
def finished_workflow(tmp_path_factory) -> Path:
    """A work dir where `snakemake --cores 2 arms` ran to the end on the tiny default."""
    work = tmp_path_factory.mktemp("workflow")
    run = run_snakemake(work, "--cores", "2", "arms")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return work
