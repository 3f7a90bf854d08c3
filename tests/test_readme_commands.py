"""Every command in the README's shell blocks, run as a user types it.

Snakemake commands are dry-run (`--dry-run` appended) and the jobs they plan are counted;
the stage commands run in a copy of a finished default run; `make` and `pip` commands
are checked for what they would do. A command the README gains without a check here
fails the first test.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
from conftest import production_checkout, run_snakemake, stand_in_apptainer

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"

# The jobs of the embedded default's `arms` target, from nothing.
ARMS_FROM_NOTHING = Counter(
    tiny_default=1,
    sft=1,
    sft_gate=1,
    build_manifest=1,
    ref_cache=2,
    path_bias=2,
    preflight=2,
    probe=2,
    dpo=2,
    select_arms=1,
    arms=1,
)
# After a finished run, forcing ref_cache reruns it and what depends on it, nothing above.
ARMS_AFTER_REF_CACHE = Counter(
    ref_cache=2, path_bias=2, preflight=2, probe=2, dpo=2, select_arms=1, arms=1
)
# ... and with --until ref_cache, or a file target with --force, one rule's jobs alone.
ONLY_REF_CACHE = Counter(ref_cache=2)
ONLY_ARGILLA_PATH_BIAS = Counter(path_bias=1)


# The jobs of the production run's `arms` target, from a downloaded model and data: the
# kernel gate of its triton_fa2 arms where the default generates its tiny world.
PRODUCTION_ARMS = ARMS_FROM_NOTHING - Counter(tiny_default=1) + Counter(kernel_gate=1)


def readme_commands() -> list[str]:
    """The command lines of the README's unlabelled code blocks, without their comments."""
    blocks = re.findall(r"(?ms)^```(\w*)\n(.*?)^```$", README.read_text())
    lines = (
        line.split("  #")[0].strip()
        for label, block in blocks
        if not label
        for line in block.splitlines()
    )
    return [line for line in lines if line and not line.startswith("#")]


def planned_jobs(run: subprocess.CompletedProcess) -> Counter:
    """The job counts of a dry run's `Job stats` table."""
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    table = (run.stdout + run.stderr).split("Job stats:")[1].split("total")[0]
    return Counter({job: int(n) for job, n in re.findall(r"(?m)^(\w+)\s+(\d+)$", table)})


def dry_run(workdir: Path, command: str, **kwargs) -> Counter:
    """`command` (a `snakemake ...` line) dry-run in `workdir`, from the repository root."""
    args = shlex.split(command)
    assert args[0] == "snakemake", command
    profile = [i for i, arg in enumerate(args) if arg == "--workflow-profile"]
    for i in profile:  # relative to where the user stands: the repository root
        args[i + 1] = str(REPO / args[i + 1])
    return planned_jobs(run_snakemake(workdir, *args[1:], "--dry-run", timeout=300, **kwargs))


@pytest.fixture(scope="module")
def finished_copy(finished_workflow, tmp_path_factory) -> Path:
    """A copy of a finished default run where the README's relative paths resolve."""
    work = tmp_path_factory.mktemp("readme")
    for part in ("results", "resources"):
        shutil.copytree(finished_workflow / part, work / part, symlinks=True)
    (work / "config").symlink_to(REPO / "config")
    (work / "workflow").symlink_to(REPO / "workflow")
    return work


def stage(command: str, cwd: Path, *extra: str) -> subprocess.CompletedProcess:
    args = shlex.split(command)
    assert args[0] == "python", command
    return subprocess.run(
        [sys.executable, *args[1:], *extra], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def check_make_arms(command, tmp_path, finished_copy):
    # The suite's finished_workflow fixture runs this recipe; here, that it is the recipe.
    recipe = subprocess.run(["make", "-n", "arms"], cwd=REPO, capture_output=True, text=True)
    assert recipe.returncode == 0, recipe.stderr
    assert "snakemake --cores 2 arms" in recipe.stdout, recipe.stdout


def check_make_rehearsal(command, tmp_path, finished_copy):
    # About 40 minutes on two cores: here, that the recipe writes the inputs, runs the chain
    # at both sizes from their workflow configs, then compares measured with projected.
    recipe = subprocess.run(["make", "-n", "rehearsal"], cwd=REPO, capture_output=True, text=True)
    assert recipe.returncode == 0, recipe.stderr
    assert "benchmarks/rehearsal.py --out rehearsal --sizes 60m 250m" in recipe.stdout
    for size in ("60m", "250m"):
        config = f"config/rehearsal/{size}.yaml"
        assert f"snakemake --configfile {config} --cores 2 arms" in recipe.stdout, recipe.stdout
        assert (REPO / config).is_file()
    assert "projections.py rehearsal/60m/results rehearsal/250m/results" in recipe.stdout


def check_make_test(command, tmp_path, finished_copy):
    # CI runs exactly this; here, that it brings the services up and requires them.
    recipe = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True)
    assert recipe.returncode == 0, recipe.stderr
    assert "bash .ci/services_up.sh" in recipe.stdout, recipe.stdout
    assert "ALIGN_SERVICES=required" in recipe.stdout and "pytest" in recipe.stdout
    # Two runs side by side: the one beside takes the files the other ignores.
    beside = re.search(r"pytest -q ((?:tests/\S+ )+)>", recipe.stdout)
    rest = re.search(r"pytest -q ((?:--ignore=\S+ ?)+);", recipe.stdout)
    assert beside and rest, recipe.stdout
    assert beside[1].split() == rest[1].replace("--ignore=", "").split(), recipe.stdout
    assert "tests/test_slurm.py" in beside[1].split()


def check_dry_run_from_nothing(command, tmp_path, finished_copy):
    assert dry_run(tmp_path, command) == ARMS_FROM_NOTHING


def check_forcerun_after_a_finished_run(command, tmp_path, finished_copy):
    assert dry_run(finished_copy, command) == ARMS_AFTER_REF_CACHE


def check_forcerun_until_after_a_finished_run(command, tmp_path, finished_copy):
    assert dry_run(finished_copy, command) == ONLY_REF_CACHE


def check_force_of_one_file_after_a_finished_run(command, tmp_path, finished_copy):
    assert dry_run(finished_copy, command) == ONLY_ARGILLA_PATH_BIAS


def parsed_hf_command(command: str) -> tuple[str, dict]:
    """The `hf` subcommand a README line names and its parsed parameters, parsed by the
    installed huggingface_hub's own command line (nothing is run or downloaded)."""
    import click
    from huggingface_hub.cli.hf import app

    ctx = app.make_context("hf", shlex.split(command)[1:])
    with warnings.catch_warnings():
        # Click 8.2 keeps a group's subcommand words in protected_args, deprecated for 9.
        warnings.simplefilter("ignore", DeprecationWarning)
        while isinstance(ctx.command, click.Group):
            words = [*ctx.protected_args, *ctx.args]
            name, sub, rest = ctx.command.resolve_command(ctx, words)
            ctx = sub.make_context(name, rest, parent=ctx)
    return ctx.command_path, ctx.params


def check_hf_login(command, tmp_path, finished_copy):
    path, params = parsed_hf_command(command)
    assert path == "hf auth login" and params["token"] is None


def check_hf_download(command, tmp_path, finished_copy):
    # Every pattern is an --include: a bare word after one would be a file name instead.
    path, params = parsed_hf_command(command)
    assert path == "hf download"
    assert params["repo_id"] == "mistralai/Mistral-7B-v0.1"
    assert params["filenames"] == ()
    assert set(params["include"]) == {"*.json", "*.safetensors", "tokenizer.model"}
    assert params["local_dir"] == "resources/models/Mistral-7B-v0.1"


def check_dry_run_under_the_profile(command, tmp_path, finished_copy):
    # No image here: the stand-in answers Snakemake's version check; nothing runs.
    bin_dir = stand_in_apptainer(tmp_path / "bin")
    assert dry_run(tmp_path, command, path_first=(bin_dir,)) == ARMS_FROM_NOTHING


def check_gates_of_a_stage_by_hand(command, tmp_path, finished_copy):
    # Run as written; an override command trains, so it runs through the gates only.
    extra = () if "--gates-only" in command else ("--gates-only",)
    run = stage(command, finished_copy, *extra)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "probe      PASSED" in run.stderr, run.stderr[-3000:]


def check_production_dry_run(command, tmp_path, production):
    # The guide's checkout: a config-only Mistral-7B (no weights) and data under resources/.
    bin_dir = stand_in_apptainer(tmp_path / "bin")
    assert dry_run(production, command, path_first=(bin_dir,)) == PRODUCTION_ARMS


def check_preregister(command, tmp_path, production):
    # In the checkout's copy of config/production, which --write edits.
    args = shlex.split(command)
    align = Path(sys.executable).parent / args[0]
    run = subprocess.run(
        [str(align), *args[1:]], cwd=production, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for arm in ("argilla", "steppairs"):
        assert f"align preregister: arm {arm} " in run.stdout
        toml = (production / "config" / "production" / "arms" / f"{arm}.toml").read_text()
        assert re.search(r"(?m)^expected_train_pairs = \d+\nexpected_held_pairs = \d+$", toml)
        assert "# preregister: resources/data/" in toml


# The build backend from the venv: an isolated build would fetch setuptools from the index.
NO_BUILD = ("--no-build-isolation",)


def check_pip_extra(command, tmp_path, finished_copy):
    # Resolved against what is installed, no index: the extra and all it pulls are satisfied.
    args = shlex.split(command)
    assert args[:3] == ["pip", "install", "-e"], command
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", *NO_BUILD, *args[2:]],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    # What a production arm imports on the cluster comes with it.
    for package in ("snakemake-executor-plugin-slurm", "triton==3.7.1", "bitsandbytes"):
        assert package in run.stdout, (package, run.stdout[-3000:])


CHECKS = {
    "make arms": check_make_arms,
    "make test": check_make_test,
    "make rehearsal": check_make_rehearsal,
    "snakemake --dry-run arms": check_dry_run_from_nothing,
    "snakemake --cores 2 arms --forcerun ref_cache": check_forcerun_after_a_finished_run,
    "snakemake --cores 2 arms --forcerun ref_cache --until ref_cache": (
        check_forcerun_until_after_a_finished_run
    ),
    "snakemake --cores 2 results/argilla/path_bias.json --force": (
        check_force_of_one_file_after_a_finished_run
    ),
    "hf auth login": check_hf_login,
    "hf download mistralai/Mistral-7B-v0.1 --include '*.json' --include '*.safetensors'"
    " --include tokenizer.model --local-dir resources/models/Mistral-7B-v0.1": check_hf_download,
    "python workflow/scripts/dpo.py config/arms/argilla.toml --lr=5e-7": (
        check_gates_of_a_stage_by_hand
    ),
    "python workflow/scripts/dpo.py config/arms/argilla.toml --gates-only": (
        check_gates_of_a_stage_by_hand
    ),
    "pip install -e '.[cluster]'": check_pip_extra,
    "snakemake --workflow-profile profiles/slurm arms": check_dry_run_under_the_profile,
    "snakemake --executor slurm --jobs 16 --retries 2 arms": check_dry_run_from_nothing,
    "align preregister config/production/arms/argilla.toml config/production/arms/steppairs.toml"
    " --workflow-config config/production/config.yaml --write": check_preregister,
    "snakemake arms --workflow-profile profiles/slurm --configfile config/production/config.yaml"
    " --dry-run": check_production_dry_run,
    "snakemake arms --workflow-profile profiles/slurm --configfile config/production/config.yaml": (
        check_production_dry_run
    ),
}


def test_every_readme_command_has_a_check():
    assert set(readme_commands()) == set(CHECKS), set(readme_commands()) ^ set(CHECKS)


ON_A_FINISHED_RUN = (
    check_forcerun_after_a_finished_run,
    check_forcerun_until_after_a_finished_run,
    check_force_of_one_file_after_a_finished_run,
    check_gates_of_a_stage_by_hand,
)
IN_THE_PRODUCTION_CHECKOUT = (check_production_dry_run, check_preregister)


@pytest.fixture(scope="module")
def production(tmp_path_factory) -> Path:
    return production_checkout(tmp_path_factory.mktemp("production"))


@pytest.mark.parametrize(
    "command", [command for command, check in CHECKS.items() if check not in ON_A_FINISHED_RUN]
)
def test_the_readme_command_does_what_it_says(command, tmp_path, request):
    check = CHECKS[command]
    where = request.getfixturevalue("production") if check in IN_THE_PRODUCTION_CHECKOUT else None
    check(command, tmp_path, where)


@pytest.mark.slow
@pytest.mark.parametrize(
    "command", [command for command, check in CHECKS.items() if check in ON_A_FINISHED_RUN]
)
def test_the_readme_command_does_what_it_says_on_a_finished_run(command, tmp_path, finished_copy):
    CHECKS[command](command, tmp_path, finished_copy)
