"""Shared fixtures: one finished default workflow per test session."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_snakemake(
    workdir: Path,
    *args: str,
    timeout: int = 1800,
    env: dict[str, str] | None = None,
    path_first: tuple[Path, ...] = (),
) -> subprocess.CompletedProcess:
    """This checkout's workflow in `workdir`; `path_first` directories precede the venv on PATH.

    Snakemake gets SIGTERM at `timeout` (and SIGKILL 20 s later), so it can cancel the
    jobs it submitted before it goes.
    """
    command, env = snakemake_command(
        workdir, *args, timeout=timeout, env=env, path_first=path_first
    )
    return subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout + 60
    )


def snakemake_command(
    workdir: Path,
    *args: str,
    timeout: int,
    env: dict[str, str] | None = None,
    path_first: tuple[Path, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment `run_snakemake` runs (for a run started in the
    background)."""
    search = os.pathsep.join([*map(str, path_first), str(Path(sys.executable).parent)])
    env = {**os.environ, **(env or {}), "PATH": f"{search}{os.pathsep}{os.environ['PATH']}"}
    command = ["timeout", "-k", "20", str(timeout), sys.executable, "-m", "snakemake"]
    command += ["-s", str(REPO / "Snakefile"), "--directory", str(workdir), *args]
    return command, env


APPTAINER = """#!/bin/sh
# Stands in for apptainer: answers the version check, records each call, runs its command.
if [ "$1" = "--version" ]; then echo "apptainer version 1.3.6"; exit 0; fi
printf '%s\\n' "$*" >> "${APPTAINER_CALLS:-/dev/null}"
for last; do :; done
exec bash -c "$last"
"""


def stand_in_apptainer(bin_dir: Path) -> Path:
    """`bin_dir` holding an `apptainer` that runs its command on the host (no image here)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    apptainer = bin_dir / "apptainer"
    apptainer.write_text(APPTAINER)
    apptainer.chmod(0o755)
    return bin_dir


def dry_run_rules(workdir: Path, *args: str) -> list[str]:
    """The rules a dry run of `args` lists, in first-appearance order."""
    run = run_snakemake(workdir, "--dry-run", *args, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    found = re.findall(r"(?m)^(?:local)?(?:rule|checkpoint) (\w+):$", run.stdout + run.stderr)
    return list(dict.fromkeys(found))


@pytest.fixture(scope="session")
def finished_workflow(tmp_path_factory) -> Path:
    """A work dir where `snakemake --cores 2 arms` ran to the end on the tiny default."""
    work = tmp_path_factory.mktemp("workflow")
    run = run_snakemake(work, "--cores", "2", "arms")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return work
