"""The Apptainer image and the Slurm profile agree with the project they run.

containers/align.def pins exactly what pyproject.toml pins (torch: one exact build
inside pyproject's range, the very version CI tests on the CPU); its labels say the
same versions; every rule that runs a command carries the image; and the Slurm
profile's container options reach the `apptainer exec` of a real job. No image is
built here: a stand-in `apptainer` on PATH records its arguments and runs the command.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import run_snakemake, stand_in_apptainer
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
DEF = REPO / "containers" / "align.def"
PROFILE = REPO / "profiles" / "slurm" / "config.yaml"
# Packages the image adds beyond pyproject: the 8-bit optimizer's library.
IMAGE_ONLY = {"bitsandbytes"}
# Test extras the image also carries (the attention kernels' compiler).
IMAGE_TEST_EXTRAS = {"triton"}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def sections(text: str) -> dict[str, str]:
    """The %sections of an Apptainer definition, by name."""
    parts = re.split(r"(?m)^%(\w+)[ \t]*$", text)
    return {name: body for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def image_pins() -> dict[str, str]:
    """Every `name==version` the %post section installs; a name pinned twice fails."""
    pins: dict[str, str] = {}
    post = re.sub(r"(?m)^\s*#.*$", "", sections(DEF.read_text())["post"])
    for name, version in re.findall(
        r"(?m)(?:^|\s)([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s'\"\\]+)", post
    ):
        key = canonicalize_name(name)
        assert key not in pins, f"{name} pinned twice in {DEF.name}"
        pins[key] = version
    return pins


def labels() -> dict[str, str]:
    body = sections(DEF.read_text())["labels"]
    return dict(line.split(None, 1) for line in body.strip().splitlines())


def requirements(entries: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, entries)}


def test_every_dependency_is_pinned_identically_in_the_image():
    pins = image_pins()
    for name, req in requirements(pyproject()["project"]["dependencies"]).items():
        assert name in pins, f"{DEF.name} does not install {req}"
        exact = [spec.version for spec in req.specifier if spec.operator == "=="]
        if exact:
            assert pins[name] == exact[0], f"{name}: pyproject {req}, image =={pins[name]}"
        else:
            assert req.specifier.contains(pins[name]), (
                f"{name}: image =={pins[name]} outside pyproject {req}"
            )


def test_the_image_carries_the_test_extras_it_needs_at_the_same_pins():
    extras = requirements(pyproject()["project"]["optional-dependencies"]["test"])
    pins = image_pins()
    for name in IMAGE_TEST_EXTRAS:
        assert str(extras[name].specifier) == f"=={pins[name]}", (extras[name], pins[name])


def test_the_image_installs_nothing_unpinned_beyond_what_is_declared():
    declared = (
        requirements(pyproject()["project"]["dependencies"]).keys() | IMAGE_TEST_EXTRAS | IMAGE_ONLY
    )
    assert set(image_pins()) == declared


def test_the_image_torch_is_the_one_ci_tests():
    makefile = (REPO / "Makefile").read_text()
    (cpu_torch,) = re.findall(r"torch==([\w.]+)", makefile)
    assert image_pins()["torch"] == cpu_torch


def test_labels_name_the_versions_the_image_installs():
    pins, found = image_pins(), labels()
    assert found["align.version"] == pyproject()["project"]["version"]
    for name in ("torch", "triton", "bitsandbytes"):
        assert found[f"align.{name}"] == pins[name], name
    python = found["align.python"]
    assert f"python{python} " in sections(DEF.read_text())["post"]
    assert SpecifierSet(pyproject()["project"]["requires-python"]).contains(python + ".0")


def test_the_image_is_built_on_cuda_and_tests_itself():
    text = DEF.read_text()
    assert re.search(r"(?m)^From:\s*nvidia/cuda:\S+", text)
    assert labels()["align.cuda"] in re.search(r"(?m)^From:\s*nvidia/cuda:(\S+)", text).group(1)
    test = sections(text)["test"]
    assert "import" in test and "align" in test
    assert "torch.cuda.is_available()" in test
    assert "/opt/align/src" in sections(text)["files"]


def test_every_rule_that_runs_a_command_names_a_container(tmp_path):
    lint = run_snakemake(tmp_path, "--lint", timeout=300)
    out = lint.stdout + lint.stderr
    assert "Specify a conda environment or container" not in out, out[-3000:]


def test_the_profile_submits_to_slurm_in_the_image_and_retries():
    profile = yaml.safe_load(PROFILE.read_text())
    assert profile["executor"] == "slurm"
    assert profile["software-deployment-method"] == "apptainer"
    assert profile["retries"] >= 1
    args = profile["apptainer-args"].split()
    assert args[0] == "--nv"
    binds = [args[i + 1] for i, arg in enumerate(args) if arg == "--bind"]
    assert binds == ["$PWD/results", "$PWD/resources"]


@pytest.mark.slow
def test_a_job_under_the_profile_runs_in_the_image_with_its_binds(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    bin_dir = stand_in_apptainer(tmp_path / "bin")
    calls = tmp_path / "calls.log"
    run = run_snakemake(
        work,
        "--workflow-profile",
        str(PROFILE.parent),
        "--executor",
        "local",
        "--cores",
        "1",
        "resources/tiny/receipt.json",
        timeout=600,
        env={"APPTAINER_CALLS": str(calls), "PWD": str(work)},
        path_first=(bin_dir,),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (call,) = calls.read_text().splitlines()
    image = REPO / "containers" / "align.sif"
    assert call.startswith("exec"), call
    assert f"--home {work}" in call.replace("'", ""), call
    assert f"--nv --bind {work}/results --bind {work}/resources" in call, call
    assert str(image) in call and "tiny_default.py" in call, call
