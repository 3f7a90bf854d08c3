"""The triton_fa2 equivalence receipt is produced by the workflow (rule kernel_gate) and read
from results/kernels/ by the stages of an fa2 arm; on the CPU under Triton's interpreter."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import dry_run_rules, run_snakemake
from tiny_pairs import write_tiny_pairs

from align.model.tiny import make_tiny_model
from align.paths import RunPaths

REPO = Path(__file__).resolve().parents[1]
PRECOMPUTE = REPO / "tests" / "drivers" / "precompute_tiny.py"
# float16: the interpreter proves no bfloat16 (numpy has none).
FA2_REF = '[ref]\ndtype = "float16"\nattn_implementation = "triton_fa2"\n'


def fa2_arms(tmp_path: Path) -> Path:
    """The default arms, argilla's reference cache built through triton_fa2 in float16."""
    arms = tmp_path / "arms"
    arms.mkdir()
    for toml in (REPO / "config" / "arms").glob("*.toml"):
        text = toml.read_text()
        if toml.stem == "argilla":
            sdpa_ref = '[ref]\ndtype = "float32"\nattn_implementation = "sdpa"\n'
            assert sdpa_ref in text
            text = text.replace(sdpa_ref, FA2_REF)
        (arms / toml.name).write_text(text)
    return arms


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
    receipt = RunPaths.of("results").kernel_receipt
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
    sizes = {"hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 1}
    sizes.update(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    make_tiny_model(work / "base", work / "tok", seed=0, **sizes)
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
