"""The Apptainer image and the Slurm profile agree with the project they run.

containers/align.def bootstraps Debian from its archive and runs one recipe,
containers/post.sh, which installs the project with its cluster extra, so the image holds
exactly what pyproject.toml pins (torch: the very version CI tests on the CPU), and runs
`pip check` when built and tested; its labels say the same versions; every rule that runs a
command carries the image; and the Slurm profile's container options reach the
`apptainer exec` of a real job, here through a stand-in `apptainer` that records its
arguments and runs the command. tests/test_image.py builds the image's root filesystem
from the same recipe and runs the workflow in it.
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
POST = REPO / "containers" / "post.sh"
PROFILE = REPO / "profiles" / "slurm" / "config.yaml"


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def sections(text: str) -> dict[str, str]:
    """The %sections of an Apptainer definition, by name."""
    parts = re.split(r"(?m)^%(\w+)[ \t]*$", text)
    return {name: body for name, body in zip(parts[1::2], parts[2::2], strict=True)}


def without_comments(text: str) -> str:
    return re.sub(r"(?m)^\s*#.*$", "", text)


def commands(section: str) -> str:
    """A section's shell lines without its comments."""
    return without_comments(sections(DEF.read_text())[section])


def recipe() -> str:
    """The build recipe's shell lines without its comments."""
    return without_comments(POST.read_text())


def header(key: str) -> str:
    return re.search(rf"(?m)^{key}:\s*(\S+)", DEF.read_text()).group(1)


def labels() -> dict[str, str]:
    body = sections(DEF.read_text())["labels"]
    return dict(line.split(None, 1) for line in body.strip().splitlines())


def pins(entries: list[str]) -> dict[str, str]:
    """name -> the exact version an entry pins."""
    out = {}
    for requirement in map(Requirement, entries):
        (spec,) = requirement.specifier
        out[canonicalize_name(requirement.name)] = spec.version
    return out


def test_the_def_runs_the_one_recipe_it_copies_in():
    assert "/opt/align/post.sh" in commands("post")
    assert re.search(r"(?m)^\s*containers/post.sh\s+/opt/align/post.sh\s*$", commands("files"))


def test_the_image_installs_the_project_with_its_cluster_extra_and_nothing_else():
    post = recipe()
    assert "install --no-cache-dir '/opt/align/src[cluster]'" in post
    # No package is named outside pyproject: the image's set is the cluster install's set.
    assert re.findall(r"(?m)(?:^|\s)([A-Za-z0-9][\w.-]*)==", post) == []


def test_the_image_checks_its_requirements_when_built_and_tested():
    assert "$pip check" in recipe()
    assert "pip check" in commands("test")


def test_the_image_torch_is_the_one_ci_tests():
    makefile = (REPO / "Makefile").read_text()
    (cpu_torch,) = re.findall(r"torch==([\w.]+)", makefile)
    assert pins(pyproject()["project"]["dependencies"])["torch"] == cpu_torch


def test_labels_name_the_versions_the_image_installs():
    project = pyproject()["project"]
    pinned = pins(project["dependencies"]) | pins(project["optional-dependencies"]["cluster"])
    found = labels()
    assert found["align.version"] == project["version"]
    for name in ("torch", "triton", "bitsandbytes"):
        assert found[f"align.{name}"] == pinned[name], name
    python = found["align.python"]
    assert f"python{python} " in recipe()
    assert SpecifierSet(project["requires-python"]).contains(python + ".0")


def test_the_image_bootstraps_from_debians_archive_and_tests_itself():
    """No registry image that this project cannot fetch: Debian's release by debootstrap,
    the very base CI builds; CUDA comes with torch's wheel and the node's driver."""
    text = DEF.read_text()
    assert header("Bootstrap") == "debootstrap"
    assert header("OSVersion") == "bookworm"
    assert header("MirrorURL").startswith("http://deb.debian.org/")
    assert "From:" not in text
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
