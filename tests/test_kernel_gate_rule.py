"""The equivalence receipts of the gated attention backends are produced by the workflow
(rule kernel_gate) and read from results/kernels/ by the stages of an arm that runs one:
triton_fa2 on the CPU under Triton's interpreter, flex on the CPU, compiled."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import dry_run_rules, run_snakemake
from safetensors.torch import load_file
from tiny_pairs import write_tiny_pairs

from align.model.tiny import make_tiny_model
from align.paths import RunPaths

REPO = Path(__file__).resolve().parents[1]
PRECOMPUTE = REPO / "tests" / "drivers" / "precompute_tiny.py"
SDPA_REF = '[ref]\ndtype = "float32"\nattn_implementation = "sdpa"\n'
# float16: the interpreter proves no bfloat16 (numpy has none).
FA2_REF = '[ref]\ndtype = "float16"\nattn_implementation = "triton_fa2"\n'
HEAD_DIM_64 = {"hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1}
HEAD_DIM_64.update(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
FLEX_REF = '[ref]\ndtype = "float32"\nattn_implementation = "flex"\n'


def arms_with_ref(tmp_path: Path, ref: str) -> Path:
    """The default arms, argilla's reference cache built through another forward path."""
    arms = tmp_path / "arms"
    arms.mkdir()
    for toml in (REPO / "config" / "arms").glob("*.toml"):
        text = toml.read_text()
        if toml.stem == "argilla":
            assert SDPA_REF in text
            text = text.replace(SDPA_REF, ref)
        (arms / toml.name).write_text(text)
    return arms


def fa2_arms(tmp_path: Path) -> Path:
    return arms_with_ref(tmp_path, FA2_REF)


def dry_run_shell(workdir: Path, arms: Path) -> str:
    """What a dry run of the arms prints, their shell commands included."""
    args = ("--dry-run", "--printshellcmds", "arms", "--config", f"arm_config_dir={arms}")
    run = run_snakemake(workdir, *args, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout + run.stderr


def precompute(work: Path, out: str, overrides: list[str], env: dict[str, str]):
    """The reference precompute of the tiny checkpoint in `work`, as a stage runs it there."""
    return subprocess.run(
        [sys.executable, str(PRECOMPUTE), str(work), str(work / out), *overrides],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **env},
    )


def test_the_kernel_gate_rule_is_in_the_dry_run_of_an_fa2_arm_only(tmp_path):
    assert "kernel_gate" not in dry_run_rules(tmp_path, "arms")
    arms = fa2_arms(tmp_path)
    rules = dry_run_rules(tmp_path, "arms", "--config", f"arm_config_dir={arms}")
    assert rules.index("kernel_gate") < rules.index("ref_cache"), rules


@pytest.mark.slow
def test_under_the_interpreter_the_rule_writes_a_receipt_that_a_later_stage_reads(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    env = {"TRITON_INTERPRET": "1"}
    arms = fa2_arms(tmp_path)
    receipt = RunPaths.of("results").kernel_receipt("triton_fa2")
    run = run_snakemake(
        work, "--cores", "1", str(receipt), "--config", f"arm_config_dir={arms}", env=env
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    written = json.loads((work / receipt).read_text())
    assert written["passed"] and written["key"]["cuda_capability"] == "interpreter"
    assert written["key"]["device_name"] == "cpu (triton interpreter)"

    # A reference precompute through the kernel: head_dim 64, as the receipt proved.
    write_tiny_pairs(work, 6, 12)
    shutil.rmtree(work / "base")
    make_tiny_model(work / "base", work / "tok", seed=0, **HEAD_DIM_64)
    fa2 = ["--ref.attn_implementation=triton_fa2", "--ref.dtype=float16", "--data.seq_len=12"]
    child = precompute(work, "cache.safetensors", fa2, env)
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.splitlines()[-1])["key"]["forward_impl"].startswith(
        "triton_fa2-fp16"
    )

    # The same stage refuses once the receipt is gone: it reads the workflow's, no other.
    (work / receipt).unlink()
    refused = precompute(work, "again.safetensors", fa2, env)
    assert refused.returncode != 0
    assert f"no equivalence receipt at {receipt}" in refused.stderr, refused.stderr[-2000:]


def test_a_flex_arm_runs_the_flex_gate_before_its_reference_cache(tmp_path):
    arms = arms_with_ref(tmp_path, FLEX_REF)
    shell = dry_run_shell(tmp_path, arms)
    assert "align.kernels.flex_gate --device=cpu" in shell
    assert "align.kernels.equivalence" not in shell


@pytest.mark.slow
def test_the_rule_writes_a_flex_receipt_that_a_later_stage_reads(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    arms = arms_with_ref(tmp_path, FLEX_REF)
    receipt = RunPaths.of("results").kernel_receipt("flex")
    run = run_snakemake(work, "--cores", "1", str(receipt), "--config", f"arm_config_dir={arms}")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    written = json.loads((work / receipt).read_text())
    assert written["passed"] and written["key"]["cuda_capability"].startswith("cpu-")

    # The reference precompute through flex equals sdpa's, as another forward path: head_dim
    # 64, as the receipt proved.
    write_tiny_pairs(work, 6, 12)
    shutil.rmtree(work / "base")
    make_tiny_model(work / "base", work / "tok", seed=0, **HEAD_DIM_64)
    caches = {}
    for backend in ("sdpa", "flex"):
        path = ["--ref.attn_implementation=" + backend, "--data.seq_len=12"]
        child = precompute(work, f"{backend}.safetensors", path, {})
        assert child.returncode == 0, child.stderr[-3000:]
        key = json.loads(child.stdout.splitlines()[-1])["key"]
        assert key["forward_impl"].startswith(f"{backend}-fp32")
        caches[backend] = load_file(work / f"{backend}.safetensors")
    for name, logps in caches["sdpa"].items():
        assert torch.allclose(caches["flex"][name], logps, rtol=0, atol=1e-4), name
