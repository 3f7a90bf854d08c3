"""The device-memory projection for Mistral-7B, against first-principles arithmetic and
against the table the README shows."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from mistral_7b import MISTRAL_7B, write_config_only_checkpoint

from align.cli import main as align_main
from align.config import ArmConfig, apply_overrides
from align.exit_codes import PreflightRefused
from align.train.memory import (
    GIB,
    MIB,
    activation_bytes_per_token_layer,
    check_device_projection,
    job_shape,
    parameter_count,
    projected_device_memory,
    projected_job_rss,
)

REPO = Path(__file__).resolve().parents[1]
TOPOLOGY = ["--batch.world_size=4", "--micro_batch=1", "--grad_accum=16", "--global_batch=64"]
# Evaluation scores 8 pairs a forward, as the production arms do.
EVAL = ["--eval.batch_size=8"]


@pytest.fixture(scope="module")
def stub(tmp_path_factory) -> Path:
    """A config-only Mistral-7B checkpoint: the projection needs no weights."""
    directory = tmp_path_factory.mktemp("mistral-7b")
    (directory / "config.json").write_text(json.dumps(MISTRAL_7B))
    return directory


def arm(optimizer: str, checkpointing: bool, *extra: str) -> ArmConfig:
    cfg = ArmConfig(arm="mistral7b")
    overrides = [
        "--model.dtype=bfloat16",
        f"--optimizer.name={optimizer}",
        "--data.seq_len=2048",
        "--run.device=cuda",
        f"--trainer.activation_checkpointing={str(checkpointing).lower()}",
        *TOPOLOGY,
        *EVAL,
        *extra,
    ]
    apply_overrides(cfg, overrides, where="test")
    return cfg


def test_mistral_7b_has_its_published_parameter_count(stub):
    from align.model.hf_config import load_hf_config

    assert parameter_count(load_hf_config(stub))["total"] == 7_241_732_096


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_rank_holds_its_own_devices_runtime_on_the_host(tmp_path, device):
    """A CUDA rank's host runtime (NCCL, the driver, Triton) is not a CPU rank's."""
    planned = write_config_only_checkpoint(tmp_path / "mistral-7b")
    cfg = arm("adamw8bit", True, f"--run.device={device}")
    projection = projected_job_rss(job_shape("dpo", cfg), planned, shard_bytes=0)
    runtime = projection["terms_mb"]["runtime"]
    per_rank = getattr(cfg.preflight, f"{device}_rank_overhead_mb")
    assert runtime == pytest.approx(4 * per_rank)
    assert cfg.preflight.cuda_rank_overhead_mb > 4 * cfg.preflight.cpu_rank_overhead_mb


def test_sharded_terms_follow_from_the_parameter_count(stub):
    per_gpu = 7_241_732_096 / 4
    adamw = projected_device_memory(arm("adamw", False), stub)["terms_mb"]
    eight_bit = projected_device_memory(arm("adamw8bit", False), stub)["terms_mb"]
    assert adamw["master_weights"] == pytest.approx(per_gpu * 4 / MIB)
    assert adamw["gradients"] == pytest.approx(per_gpu * 4 / MIB)
    assert adamw["optimizer_state"] == pytest.approx(per_gpu * 8 / MIB)
    assert eight_bit["optimizer_state"] == pytest.approx(per_gpu * (2 + 8 / 256) / MIB)
    # A bf16 master halves the weights, the gradients and torch AdamW's moments.
    pure = projected_device_memory(arm("adamw", False, "--model.master_dtype=bfloat16"), stub)
    assert pure["terms_mb"]["optimizer_state"] == pytest.approx(per_gpu * 4 / MIB)
    assert pure["terms_mb"]["master_weights"] == pytest.approx(per_gpu * 2 / MIB)


def test_activations_follow_from_the_layer_arithmetic(stub):
    from align.model.hf_config import load_hf_config

    config = load_hf_config(stub)
    # Two norms (float32 input + bf16 output), rotary q/k, q k v + output + lse, o input, MLP.
    by_hand = 2 * (4 * 4096 + 2 * 4096) + 2 * (4096 + 1024) + 2 * (2 * 4096 + 2 * 1024)
    by_hand += 4 * 32 + 2 * 4096 + 4 * 2 * 14336
    assert activation_bytes_per_token_layer(config, 2) == by_hand == 202_880
    tokens = 2 * 2048
    mask = 2 * 2048 * 2048 * 2
    expected = 32 * (tokens * by_hand + mask) + tokens * 4096 * 2
    terms = projected_device_memory(arm("adamw", False), stub)["terms_mb"]
    assert terms["activations"] == pytest.approx(expected / MIB)
    checkpointed = projected_device_memory(arm("adamw", True), stub)["terms_mb"]
    assert checkpointed["activations"] < terms["activations"] / 10


def readme_totals() -> dict[tuple[str, str], float]:
    text = (REPO / "README.md").read_text()
    rows = re.findall(r"(?m)^\| (adamw\w*) \| (on|off) \|.*\*\*([\d.]+)\*\* \|$", text)
    return {(opt, ac): float(total) for opt, ac, total in rows}


def test_the_readme_table_is_what_the_projection_says(stub):
    documented = readme_totals()
    assert len(documented) == 4
    for (optimizer, checkpointing), total in documented.items():
        projection = projected_device_memory(arm(optimizer, checkpointing == "on"), stub)
        assert round(projection["total_mb"] * MIB / GIB, 1) == total, (optimizer, checkpointing)


def test_a_job_over_the_device_is_refused_naming_the_terms(stub):
    cfg = arm("adamw", False)
    projection = projected_device_memory(cfg, stub)
    with pytest.raises(PreflightRefused, match=r"exceeds 92% of 40960 MiB .*activations"):
        check_device_projection(projection, cfg.preflight, 40 * 1024, "a 40 GiB card")
    fits = check_device_projection(projection, cfg.preflight, 141 * 1024, "an H200")
    assert fits["device_source"] == "an H200"


def test_evaluation_batches_over_the_device_are_refused_naming_the_phase(stub):
    """After training, the SFT policy's shard sits beside the trained one and evaluation
    scores 2 x eval.batch_size rows: a batch too wide for the device is refused before the
    job runs, though training itself fits."""
    cfg = arm("adamw8bit", True, "--eval.batch_size=64")
    projection = projected_device_memory(cfg, stub)
    phases = projection["phases"]
    assert phases["evaluate"]["total_mb"] > phases["train"]["total_mb"]
    assert phases["evaluate"]["terms_mb"]["second_policy"] == pytest.approx(
        7_241_732_096 / 4 * 4 / MIB
    )
    assert projection["total_mb"] == phases["evaluate"]["total_mb"]
    with pytest.raises(PreflightRefused, match=r"in evaluate .* second_policy 6906"):
        check_device_projection(projection, cfg.preflight, 32 * 1024, "a 32 GiB card")
    check_device_projection(
        projected_device_memory(arm("adamw8bit", True), stub),
        cfg.preflight,
        32 * 1024,
        "a 32 GiB card",
    )


def test_align_memory_prints_the_projection(stub, capsys):
    code = align_main(
        [
            "memory",
            str(REPO / "config" / "arms" / "argilla.toml"),
            "--checkpoint",
            str(stub),
            "--model.dtype=bfloat16",
            "--optimizer.name=adamw8bit",
            "--data.seq_len=2048",
            *TOPOLOGY,
        ]
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "total per GPU" in out and "48.94 GiB" in out


# --- the host projection, phase by phase ---------------------------------------------------


def cpu_arm(*extra: str) -> ArmConfig:
    cfg = ArmConfig(arm="mistral7b")
    overrides = ["--data.seq_len=1024", "--batch.world_size=2", "--micro_batch=1"]
    overrides += ["--grad_accum=2", "--global_batch=4", "--eval.batch_size=8", *extra]
    apply_overrides(cfg, overrides, where="test")
    return cfg


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> Path:
    return write_config_only_checkpoint(tmp_path_factory.mktemp("planned") / "mistral-7b")


def test_each_stage_projects_the_phases_it_runs_and_its_peak_is_the_largest(planned):
    expected = {
        "dpo": ["load", "train", "export", "evaluate"],
        "probe": ["load", "train"],
        "ref_cache": ["load", "evaluate"],
        "path_bias": ["load", "evaluate"],
    }
    for stage, phases in expected.items():
        projection = projected_job_rss(job_shape(stage, cpu_arm()), planned, shard_bytes=0)
        assert list(projection["phases"]) == phases, stage
        totals = {name: phase["total_mb"] for name, phase in projection["phases"].items()}
        assert projection["total_mb"] == max(totals.values())
        assert projection["peak_phase"] == max(totals, key=totals.get)
        for phase in projection["phases"].values():
            assert phase["total_mb"] == pytest.approx(sum(phase["terms_mb"].values()))


def test_after_training_the_sft_policy_is_counted_beside_the_trained_one(planned):
    """DPO's evaluation loads the SFT policy beside the trained one (rank 0 stages it while
    the trained root stays gathered), then scores both with both roots gathered: the
    larger moment is the phase's. Neither gradients nor optimizer state outlive training."""
    phases = projected_job_rss(job_shape("dpo", cpu_arm()), planned, 0)["phases"]
    weights = 7_241_732_096 * 4 / MIB
    root = phases["train"]["terms_mb"]["gathered_root"]
    evaluate = phases["evaluate"]["terms_mb"]
    assert evaluate["weights"] == evaluate["second_policy"] == pytest.approx(weights)
    # At 7B in float32 on the CPU, rank 0's staging copy outweighs scoring.
    assert evaluate["load_staging_rank0"] == phases["load"]["terms_mb"]["load_staging_rank0"]
    assert evaluate["gathered_root"] == root
    wide = projected_job_rss(job_shape("dpo", cpu_arm("--eval.batch_size=512")), planned, 0)
    scoring = wide["phases"]["evaluate"]["terms_mb"]
    assert scoring["gathered_root"] == 2 * root and "load_staging_rank0" not in scoring
    for phase in ("export", "evaluate"):
        assert not {"grads", "optimizer_state"} & phases[phase]["terms_mb"].keys(), phase
    assert phases["export"]["terms_mb"]["export_gather_rank0"] == pytest.approx(weights)


def test_evaluation_batches_widen_the_evaluation_not_training(planned):
    narrow = projected_job_rss(job_shape("path_bias", cpu_arm()), planned, 0)["phases"]
    wide = projected_job_rss(job_shape("path_bias", cpu_arm("--micro_batch=8")), planned, 0)
    assert wide["phases"]["load"] == narrow["load"]
    grown = wide["phases"]["evaluate"]["terms_mb"]["activations"]
    # Eight times the rows; the loss head's chunk does not grow with them.
    assert grown > 4 * narrow["evaluate"]["terms_mb"]["activations"]


def test_rank_zero_terms_fill_its_node_alone(planned):
    """Steady terms spread over the nodes; rank 0's staging stays on its node."""
    shape = job_shape("ref_cache", cpu_arm(), nodes=2)
    load = projected_job_rss(shape, planned, 0)["phases"]["load"]
    rank0 = load["terms_mb"]["load_staging_rank0"]
    assert load["node_mb"] == pytest.approx((load["total_mb"] - rank0) / 2 + rank0)


def test_a_stage_whose_config_names_no_row_length_must_be_given_one():
    from align.config import SelectionConfig

    with pytest.raises(ValueError, match="select_arms: its config names no seq_len"):
        job_shape("select_arms", SelectionConfig())
    assert job_shape("select_arms", SelectionConfig(), seq_len=1024).seq_len == 1024


def test_a_cuda_stage_on_a_host_without_cuda_is_refused_saying_so(planned):
    """Every model-loading stage checks its device before it loads: on a node without the
    GPUs it was sent for, the refusal names the cause, not only the missing setting."""
    from align.train.memory import check_stage_rss

    cfg = cpu_arm("--run.device=cuda", "--run.node_memory_mb=10000000")
    with pytest.raises(PreflightRefused, match="CUDA is not available on this host"):
        check_stage_rss("path_bias", cfg, planned)


def test_the_datas_longest_row_bounds_the_rows_a_stage_is_projected_to_score(planned):
    """A batch pads to its longest row, so shards whose longest row is under seq_len are
    scored that wide; the layout picks which width, and seq_len stays the bound."""
    from align.data.shards import RowWidths

    widths = RowWidths(padded=300, shared=500)
    assert job_shape("ref_cache", cpu_arm()).row_tokens == 1024
    assert job_shape("ref_cache", cpu_arm(), widths=widths).row_tokens == 300
    shared = cpu_arm("--ref.layout=packed")
    assert job_shape("ref_cache", shared, widths=widths).row_tokens == 500
    assert job_shape("ref_cache", shared, widths=RowWidths(3000, 3000)).row_tokens == 2048
    narrow = projected_job_rss(job_shape("ref_cache", cpu_arm(), widths=widths), planned, 0)
    wide = projected_job_rss(job_shape("ref_cache", cpu_arm()), planned, 0)
    scored = [p["phases"]["evaluate"]["terms_mb"]["activations"] for p in (narrow, wide)]
    assert scored[0] < scored[1]


def test_stages_that_read_rows_in_process_hold_the_row_reader(planned):
    """sft, sft_gate and select_arms read parquet rows (or the arms' union eval set) and hold
    a tokenizer; stages that read built shards do not."""
    from align.config import SelectionConfig, SftConfig

    sft = SftConfig()
    apply_overrides(sft, ["--batch.world_size=2"], where="test")
    per_rank = sft.preflight.row_reader_overhead_mb
    shapes = {
        "sft": job_shape("sft", sft),
        "sft_gate": job_shape("sft_gate", sft),
        "select_arms": job_shape("select_arms", SelectionConfig(), seq_len=1024),
        "dpo": job_shape("dpo", cpu_arm()),
    }
    expected = {"sft": 2 * per_rank, "sft_gate": per_rank, "select_arms": per_rank, "dpo": 0}
    for stage, shape in shapes.items():
        load = projected_job_rss(shape, planned, 0)["phases"]["load"]["terms_mb"]
        assert load["row_reader"] == pytest.approx(expected[stage]), stage


def test_selections_loads_after_a_scored_policy_hold_what_scoring_grew(planned):
    """select_arms loads each policy after the last one's scoring, in one process; the SFT
    gate loads one policy into a fresh process."""
    from align.config import PreflightConfig, SelectionConfig, SftConfig

    select = job_shape("select_arms", SelectionConfig(), seq_len=1024)
    gate = job_shape("sft_gate", SftConfig())
    terms = {
        stage: projected_job_rss(shape, planned, 0)["phases"]["load"]["terms_mb"]
        for stage, shape in (("select_arms", select), ("sft_gate", gate))
    }
    assert terms["select_arms"]["post_scoring"] == PreflightConfig().post_scoring_overhead_mb
    assert "post_scoring" not in terms["sft_gate"]


def test_scoring_projection_holds_swiglus_three_intermediate_tensors(tmp_path):
    """A no-grad forward holds silu(gate), up and their product at once: a model counting
    one intermediate-width tensor under-projects wide MLPs (at 258M parameters, 26.6 KB
    a token modelled where 55 KB were held)."""
    import subprocess
    import sys

    from align.model.hf_config import load_hf_config
    from align.train.memory import cpu_scoring_activations

    config = {
        **MISTRAL_7B,
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": 1024,
        "sliding_window": 256,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    rows, length = 16, 512
    # Every tensor returned on free, so that the peak is the tensors the forward holds.
    measured = subprocess.run(
        [
            sys.executable,
            REPO / "benchmarks/scoring_heap.py",
            "--child",
            tmp_path,
            *map(str, (rows, length)),
        ],
        env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"},
        capture_output=True,
        text=True,
        check=True,
    )
    peak_mb = json.loads(measured.stdout.strip().splitlines()[-1])["peak_mb"]
    shape = job_shape("path_bias", ArmConfig(), seq_len=length)
    modelled_mb = cpu_scoring_activations(shape, load_hf_config(tmp_path), rows, length) / MIB
    # Within 2%: the rotary tables and the label bookkeeping are not modelled.
    assert 0.95 <= peak_mb / modelled_mb <= 1.02, (peak_mb, modelled_mb)


@pytest.mark.parametrize(
    "stage, overrides, streamed",
    [
        ("dpo", ["--batch.layout=shared"], True),
        ("dpo", ["--batch.layout=packed"], True),
        ("dpo", ["--batch.layout=shared", "--model.attn_implementation=eager"], False),
        ("dpo", [], False),
        ("ref_cache", ["--ref.layout=shared"], True),
        ("ref_cache", ["--ref.layout=shared", "--ref.attn_implementation=eager"], False),
    ],
)
def test_a_streamed_layout_is_projected_without_the_dense_mask_it_never_builds(
    stage, overrides, streamed
):
    cfg = ArmConfig()
    apply_overrides(cfg, overrides, where="test")
    shape = job_shape(stage, cfg)
    assert shape.streamed is streamed
    seq_len, rows = shape.seq_len, shape.rows
    if streamed:
        # A rejected response's [r, p + r] per pair, each sequence within seq_len.
        assert shape.row_tokens == 2 * seq_len
        assert shape.mask_positions(rows, shape.row_tokens) == rows * seq_len * seq_len
    else:
        side = shape.row_tokens
        assert shape.mask_positions(rows, side) == rows * side * side
