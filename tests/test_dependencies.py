"""The declared dependencies are exactly what the code imports.

The runtime set of pyproject.toml is what align/, workflow/ and the rules import at
module level or in a function; what only a GPU cluster run imports (the attention
kernels' compiler, the 8-bit optimizer) and the executor plugins Snakemake loads by
name are the `cluster` extra, which the README's cluster install and the image use.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
# Python files and the Snakemake files, whose Python lines import like any module.
SOURCES = ("align/**/*.py", "workflow/**/*.py", "rules/*.smk", "Snakefile")
SMK_IMPORT = re.compile(r"(?m)^\s*(?:from\s+([\w.]+)\s+import|import\s+([\w.]+))")


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def names(entries: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(entry).name) for entry in entries}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every absolute import in `path`."""
    text = path.read_text()
    if path.suffix != ".py":
        return {(a or b).split(".")[0] for a, b in SMK_IMPORT.findall(text)}
    found = set()
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def imported_distributions() -> dict[str, set[str]]:
    """Distribution name -> the files that import it (stdlib and align itself left out)."""
    providers = importlib.metadata.packages_distributions()
    by_dist: dict[str, set[str]] = {}
    for pattern in SOURCES:
        for path in REPO.glob(pattern):
            for module in imported_modules(path) - set(sys.stdlib_module_names) - {"align"}:
                assert module in providers, f"{path}: imports {module!r}, which nothing installs"
                for dist in providers[module]:
                    by_dist.setdefault(canonicalize_name(dist), set()).add(str(path))
    return by_dist


def test_runtime_dependencies_are_exactly_what_the_code_imports():
    cluster = names(project()["optional-dependencies"]["cluster"])
    imported = set(imported_distributions()) - cluster
    declared = names(project()["dependencies"])
    assert imported - declared == set(), "imported but not declared"
    assert declared - imported == set(), "declared but imported nowhere"


def test_what_only_a_cluster_run_imports_is_in_the_cluster_extra():
    cluster = names(project()["optional-dependencies"]["cluster"])
    imported = imported_distributions()
    for dist in ("triton", "bitsandbytes"):
        assert dist in imported and dist in cluster, dist


def test_the_cluster_extra_holds_the_executor_the_slurm_profile_names():
    profile = yaml.safe_load((REPO / "profiles/slurm/config.yaml").read_text())
    cluster = names(project()["optional-dependencies"]["cluster"])
    executor = f"snakemake-executor-plugin-{profile['executor']}"
    # Snakemake runs each job's step inside the allocation through the jobstep executor.
    assert {executor, f"{executor}-jobstep"} <= cluster


def test_every_pin_is_exact():
    extras = project()["optional-dependencies"]
    for entry in project()["dependencies"] + [e for v in extras.values() for e in v]:
        requirement = Requirement(entry)
        if requirement.name == "align":
            continue
        operators = {spec.operator for spec in requirement.specifier}
        assert operators == {"=="}, entry


def test_the_cluster_triton_is_the_one_torch_declares():
    """Torch's CUDA build declares one Triton; the extra pins that one, so pip check holds."""
    torch_pin = Requirement(next(e for e in project()["dependencies"] if e.startswith("torch")))
    triton = next(
        Requirement(e) for e in project()["optional-dependencies"]["cluster"] if "triton" in e
    )
    # torch 2.13.0's Linux x86-64 CUDA wheel requires triton==3.7.1 (its METADATA).
    assert str(torch_pin.specifier) == "==2.13.0"
    assert str(triton.specifier) == "==3.7.1"
    assert importlib.metadata.version("triton") == "3.7.1"
