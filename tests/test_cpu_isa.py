"""run.cpu_isa: the CPU math libraries capped at one instruction set and MKL held to its
strict reproducible branch, so that a CPU run computes the same bits whatever its thread
count and on CPUs of other generations, and the set torch ran is recorded."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from align.config import RunConfig, SftConfig, load_config
from align.constants import CPU_ISAS
from align.exit_codes import USAGE, ConfigError
from align.utils.guard import configure_cpu, pin_cpu_isa

TESTS = Path(__file__).parent
X86_ONLY = pytest.mark.skipif(
    platform.machine() != "x86_64", reason="the pins are x86-64 instruction sets"
)


@pytest.fixture
def on_x86_64(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    for var in {var for isa in CPU_ISAS.values() for var in isa["env"]}:
        # Set, then removed: monkeypatch then restores the variable (or its absence) after
        # the test, so a pin never leaks into the compiled kernels of later tests.
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)


def test_the_pin_sets_the_variable_each_library_reads(on_x86_64):
    pin_cpu_isa("avx2")
    assert {var: os.environ[var] for var in CPU_ISAS["avx2"]["env"]} == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2,STRICT",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }


def test_no_pin_leaves_the_libraries_to_pick(on_x86_64):
    pin_cpu_isa("")
    assert not set(CPU_ISAS["avx2"]["env"]) & set(os.environ)


def test_a_cpu_of_another_architecture_runs_unpinned_and_says_what_ran(on_x86_64, monkeypatch):
    """The sets are x86-64 ones; an aarch64 laptop still runs the tiny default."""
    import torch

    from align.utils.dist import assert_cpu_isa

    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    pin_cpu_isa("avx2")
    assert not set(CPU_ISAS["avx2"]["env"]) & set(os.environ)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "SVE256")
    assert_cpu_isa("avx2")
    with pytest.raises(ConfigError, match=r"run\.cpu_isa expected one of"):
        pin_cpu_isa("sse2")


def test_an_unknown_instruction_set_is_refused_by_the_config_and_the_pin():
    sft = Path(__file__).parents[1] / "config" / "sft.toml"
    with pytest.raises(
        ConfigError, match=r"'run.cpu_isa' expected one of \('', 'avx2', 'avx512'\), found 'sse2'"
    ):
        load_config(sft, SftConfig, ["--run.cpu_isa=sse2"])
    with pytest.raises(ConfigError, match=r"run.cpu_isa expected one of \('avx2', 'avx512'\)"):
        pin_cpu_isa("sse2")


def test_a_pin_torch_does_not_run_at_is_refused_naming_both(on_x86_64, monkeypatch):
    import torch

    from align.utils.dist import assert_cpu_isa

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    with pytest.raises(ConfigError, match=r"run.cpu_isa='avx2'.*run DEFAULT.*lacks AVX2"):
        assert_cpu_isa("avx2")
    assert_cpu_isa("")  # no pin: whatever torch runs


def run_child(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, env=env
    )


# Three AdamW steps of the tiny model on a batch wide enough that MKL splits its matrix
# products across threads; prints the rank's device identity and the weights' digest.
PINNED_STEPS = """
import sys
from align.config import RunConfig
from align.utils.guard import configure_cpu
configure_cpu(RunConfig(threads=int(sys.argv[1]), cpu_isa=sys.argv[2]))
import hashlib
import torch
from tiny_models import tiny_mistral_config
from align.model.mistral import NmoMistralForCausalLM
from align.utils.dist import DistInfo, assert_cpu_isa, device_identity
assert_cpu_isa(sys.argv[2])
torch.manual_seed(0)
model = NmoMistralForCausalLM(tiny_mistral_config())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ids = torch.randint(0, 64, (8, 96))
for _ in range(3):
    logits = model(ids)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
weights = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print(device_identity(DistInfo(0, 0, 1, torch.device("cpu"), "gloo")))
print(hashlib.sha256(weights).hexdigest())
"""


def pinned_steps(threads: int, isa: str) -> tuple[str, str]:
    """(device identity, weights digest) of PINNED_STEPS in a fresh process."""
    child = run_child(PINNED_STEPS, str(threads), isa)
    assert child.returncode == 0, child.stderr[-3000:]
    identity, digest = child.stdout.split()
    return identity, digest


@X86_ONLY
def test_two_node_and_one_node_ranks_of_other_thread_counts_compute_the_same_bits_under_the_pin():
    """A rank of two threads (one rank per node) and one of one thread (two ranks on one
    node) trained to different weights until MKL's reproducible branch was made strict."""
    one, two = pinned_steps(1, "avx2"), pinned_steps(2, "avx2")
    assert ":cpu:AVX2:pid" in one[0], one
    assert one[1] == two[1]


@X86_ONLY
def test_a_stage_whose_cpu_cannot_take_the_pin_exits_with_the_usage_code():
    """The refusal reaches the exit code a stage reports (the CPU is stood in for)."""
    code = (
        "import torch\n"
        "torch.backends.cpu.get_cpu_capability = lambda: 'DEFAULT'\n"
        "from align.exit_codes import run_with_exit_codes\n"
        "from align.utils.dist import assert_cpu_isa\n"
        "run_with_exit_codes(lambda: assert_cpu_isa('avx2'), 'dpo')\n"
    )
    child = run_child(code)
    assert child.returncode == USAGE, child.stderr[-3000:]
    assert "run.cpu_isa='avx2' requested" in child.stderr


def test_configure_cpu_caps_threads_and_pins(on_x86_64, monkeypatch):
    import torch

    # The suite's own thread count, so the cap leaves later tests in this process as they were.
    threads = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    configure_cpu(RunConfig(threads=threads, cpu_isa="avx512"))
    assert os.environ["OMP_NUM_THREADS"] == str(threads)
    assert os.environ["ATEN_CPU_CAPABILITY"] == "avx512"
