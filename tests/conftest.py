"""Shared fixtures: one finished default workflow per test session."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# `make test` (and so CI) brings the services up first: there a missing one is a failure.
SERVICES_REQUIRED = os.environ.get("ALIGN_SERVICES") == "required"
# Where the image's root filesystem is built. containers/build_rootfs.sh keeps it, and its
# debootstrapped base beside it, between runs: a build with nothing changed returns at once.
IMAGE_ROOTFS = Path(os.environ.get("ALIGN_ROOTFS", "/var/tmp/align-rootfs"))


def stand_in_cache_key(forward_impl: str):
    """A reference cache key of stand-in hashes, for tests of the cache's files alone."""
    from align.train.ref_cache import CacheKey

    return CacheKey(
        checkpoint_weights="w" * 64,
        tokenizer="t" * 64,
        shard="s" * 64,
        seq_len_truncation="96:prompt_left_response_right",
        dtype="float32",
        forward_impl=forward_impl,
    )


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    """A one-rank gloo group, as every stage has (left alone if a test already made one)."""
    import torch.distributed as dist

    from align.utils.dist import destroy_distributed, init_distributed

    created = not dist.is_initialized()
    yield init_distributed(tmp_path_factory.mktemp("group"), "cpu")
    if created:
        destroy_distributed()


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


def apptainer_shim(bin_dir: Path) -> Path:
    """`bin_dir` holding an `apptainer` that runs `apptainer exec ROOTFS CMD` in a root
    filesystem of containers/build_rootfs.sh, with the options' binds (containers/apptainer_shim.sh)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    (bin_dir / "apptainer").symlink_to(REPO / "containers" / "apptainer_shim.sh")
    return bin_dir


@pytest.fixture(scope="session")
def image_rootfs() -> Path:
    """The image's root filesystem, built from containers/align.def's own recipe by
    debootstrap and chroot (root and debootstrap: `make services` installs it)."""
    missing = [need for need in ("debootstrap", "unshare") if shutil.which(need) is None]
    if os.geteuid() != 0:
        missing.append("root")
    if missing:
        why = f"building the image's root filesystem needs {', '.join(missing)}"
        if SERVICES_REQUIRED:
            pytest.fail(f"{why}, though make test brought the services up (.ci/services_up.sh)")
        pytest.skip(why)
    build = subprocess.run(
        ["bash", str(REPO / "containers" / "build_rootfs.sh"), str(IMAGE_ROOTFS)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    return IMAGE_ROOTFS


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


# Where the README guide's step 2 puts each dataset, with rows of the embedded default's
# data (the same public schemas).
PRODUCTION_DATA = {
    "argilla.jsonl": "distilabel-intel-orca-dpo-pairs.parquet",
    "steppairs.jsonl": "Math-Step-DPO-10K.parquet",
    "sft.jsonl": "ultrachat_200k-sft.parquet",
}


def production_checkout(work: Path) -> Path:
    """`work` laid out as the README's guide leaves a checkout for the production run:
    config/production/ (a copy, which `align preregister --write` may edit), a
    config-only Mistral-7B-v0.1 as the model store and the data under resources/."""
    import pyarrow.json
    import pyarrow.parquet
    import yaml
    from mistral_7b import write_config_only_checkpoint

    from align.data.synthetic import write_default_data

    production = shutil.copytree(REPO / "config" / "production", work / "config" / "production")
    config = yaml.safe_load((production / "config.yaml").read_text())
    write_config_only_checkpoint(work / config["base_model"])
    raw = work / "raw"
    write_default_data(raw, seed=0, n_argilla=40, n_steppairs=40, n_sft=40)
    (work / "resources" / "data").mkdir(parents=True)
    for source, name in PRODUCTION_DATA.items():
        table = pyarrow.json.read_json(raw / source)
        pyarrow.parquet.write_table(table, work / "resources" / "data" / name)
    return work
