"""The image's root filesystem, built here from containers/align.def's own recipe
(containers/build_rootfs.sh: debootstrap, then containers/post.sh by chroot): its %test,
`pip check`, and the embedded default's whole chain run inside it, with the working
directory bound in as `apptainer exec --bind` binds it, ending in the same bytes as the
chain run on this host."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from conftest import REPO

RUN_IN_ROOTFS = REPO / "containers" / "run_in_rootfs.sh"


def in_image(rootfs: Path, *command: str, cwd: Path = REPO, timeout: int = 600):
    """`command` inside the image, the checkout bound read-only at its own path."""
    return subprocess.run(
        [str(RUN_IN_ROOTFS), str(rootfs), "--bind", f"{REPO}:{REPO}:ro", "--", *command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def receipt_outputs(results: Path) -> dict[str, dict[str, str]]:
    """Every receipt's output hashes (policies, checkpoints, shards, caches), by receipt."""
    found = {}
    for path in sorted(results.rglob("*.json")):
        receipt = json.loads(path.read_text())
        if isinstance(receipt, dict) and receipt.get("outputs"):
            found[str(path.relative_to(results))] = receipt["outputs"]
    return found


def test_the_image_passes_its_own_test(image_rootfs):
    done = in_image(image_rootfs, "/bin/sh", "-eu", "/.singularity.d/test")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "align 0.1.0 torch 2.13.0+cpu" in done.stdout, done.stdout


def test_the_images_requirements_are_consistent(image_rootfs):
    done = in_image(image_rootfs, "python", "-m", "pip", "check")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "No broken requirements found" in done.stdout


def test_the_tiny_chain_in_the_image_ends_in_the_hosts_bytes(
    image_rootfs, finished_workflow, tmp_path
):
    """`snakemake --cores 2 arms` with the image's Python, Snakemake and installed align."""
    work = tmp_path / "work"
    work.mkdir()
    chain = ["snakemake", "-s", str(REPO / "Snakefile"), "--cores", "2", "arms"]
    done = in_image(image_rootfs, *chain, cwd=work, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    inside = receipt_outputs(work / "results")
    assert {"argilla/arm_result.json", "steppairs/arm_result.json"} <= inside.keys()
    assert inside == receipt_outputs(finished_workflow / "results")
    # The stages ran in the image's environment, whose align is an installed copy.
    sft = json.loads((work / "results" / "sft" / "sft.json").read_text())
    assert sft["command"].startswith("/opt/align/venv/bin/python "), sft["command"]
