"""Every leaf key of every config class is range-checked at load (align.config).

BAD holds, per loadable class, one out-of-range value for each dotted key; EXEMPT names the
keys that have none, with the reason. The coverage test fails for a field added without an
entry, and the refusal test for an entry whose field has no check. Allowed names come from
align.constants, and the guards below keep each consumer on that one list.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from align import constants
from align.config import ArmConfig, SelectionConfig, SftConfig, TinyConfig, leaf_paths, load_config
from align.exit_codes import USAGE, ConfigError

CONFIG = Path(__file__).resolve().parents[1] / "config"
# The shipped file each class's bad values are applied to, one at a time.
BASE = {
    ArmConfig: CONFIG / "arms" / "argilla.toml",
    SftConfig: CONFIG / "sft.toml",
    SelectionConfig: CONFIG / "selection.toml",
    TinyConfig: CONFIG / "tiny" / "tiny.toml",
}


def under(prefix: str, table: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}.{key}": value for key, value in table.items()}


FREE_BOOL = "a bool: both values are valid"

# --- sections shared between classes: section key -> bad value (or -> exemption reason) ---

MODEL = {
    "dtype": "float64",
    "master_dtype": "fp32",
    "reduce_dtype": "int8",
    "attn_implementation": "flash9",
}
EVAL = {"batch_size": 0}
PREFLIGHT = {
    "host_memory_fraction": 7.0,
    "cpu_rank_overhead_mb": -1.0,
    "row_reader_overhead_mb": -1.0,
    "post_training_overhead_mb": -1.0,
    "post_scoring_overhead_mb": -1.0,
    "scoring_heap_overhead_mb": -1.0,
    "cuda_rank_overhead_mb": -1.0,
    "launcher_overhead_mb": -1.0,
    "calibration_tolerance": 1.0,
    "min_moved_fraction": 0.0,
    "device_memory_gb": -1.0,
    "device_memory_fraction": 1.5,
    "cuda_context_mb": math.nan,
}
OPTIMIZER = {
    "name": "sgd",
    "lr": 0.0,
    "weight_decay": -0.1,
    "betas": [0.9],
    "eps": 0.0,
    "warmup_steps": -1,
    "min_lr_ratio": 2.0,
    "grad_clip": -1.0,
}
BATCH = {
    "world_size": 0,
    "micro_batch": 0,
    "grad_accum": 0,
    "global_batch": 0,
    "epochs": 0,
    "seed": -1,
    "layout": "two_rows",
}
TRAINER = {
    "checkpoint_every": -1,
    "keep_checkpoints": 0,
    "max_wall_seconds": -1.0,
    "max_micro_steps": -1,
    "probe_steps": 0,
    "max_consecutive_skipped_steps": -1,
    "max_skipped_fraction": 5.0,
    "progress_every_steps": -1,
    "progress_every_s": -1.0,
}
TRAINER_EXEMPT = {"resume": FREE_BOOL, "activation_checkpointing": FREE_BOOL}
RUN = {
    "results_dir": "",
    "base_model": " ",
    "device": "tpu",
    "gpus_per_node": -1,
    "threads": 0,
    "cpu_isa": "sse2",
    "heavy_lock": "sometimes",
    "expected_host": "node 1",
    "node_memory_mb": -1.0,
    # The shipped configs leave node_memory_mb = 0: a source of nothing.
    "node_memory_source": "scontrol",
}
RUN_EXEMPT = {
    "sft_checkpoint": "empty trains SFT; any other string is a checkpoint the sft_gate checks",
    "heavy_lock_path": "empty is the per-user default; any other string is a lock file",
    "require_off_root": FREE_BOOL,
}
BAND = {
    "min_terminated_vs_sft": 1.5,
    "min_terminated_vs_chosen": -0.1,
    "length_low": 1.2,
    "length_high": 0.9,
}

# --- per loadable class: dotted key -> one value outside its range ---------------------

BAD: dict[type, dict[str, Any]] = {
    ArmConfig: {
        "arm": "../argilla",
        "data.format": "csv",
        "data.files": [""],
        "data.seq_len": 1,
        "data.truncation": "middle_out",
        "data.held_fraction": 1.0,
        "data.split_seed": -1,
        "data.min_pairs": 0,
        "data.expected_train_pairs": -1,
        "data.expected_held_pairs": -1,
        "data.max_prompt_tokens": 0,
        "data.filters.exclude_status": [""],
        "data.filters.min_chosen_score": math.nan,
        **under("model", MODEL),
        "ref.dtype": "fp8",
        "ref.attn_implementation": "flash9",
        "ref.batch_size": 0,
        "ref.slice_pairs": 0,
        "ref.layout": "shared_prompt",
        "dpo.beta": 0.0,
        "dpo.loss": "kto",
        "dpo.label_smoothing": 0.5,
        "dpo.rpo_alpha": -0.1,
        "dpo.rdpo_alpha": math.inf,
        **under("optimizer", OPTIMIZER),
        **under("batch", BATCH),
        **under("trainer", TRAINER),
        "path_bias.tolerance": -1e-3,
        "path_bias.sample_pairs": 0,
        "path_bias.seed": -1,
        **under("preflight", PREFLIGHT),
        "tripwires.logps_window": 0,
        "tripwires.chosen_logp_floor": -math.inf,
        "tripwires.length_window_pairs": 0,
        "tripwires.length_band": -0.25,
        "tripwires.generation_every_steps": 0,
        "tripwires.generation_check.prompts": 0,
        "tripwires.generation_check.max_new_tokens": 0,
        **under("tripwires.generation_band", BAND),
        # A reason disarms its wire, so it must say something.
        "tripwires.disarmed.collapse": " ",
        "tripwires.disarmed.length_drift": "\t",
        "tripwires.disarmed.generation": "  ",
        "tripwires.response.lr": 0.0,
        "tripwires.response.beta": -1.0,
        "tripwires.response.rpo_alpha": -0.3,
        **under("eval", EVAL),
        **under("run", RUN),
    },
    SftConfig: {
        "data.files": [" "],
        "data.seq_len": 1,
        "data.held_fraction": 0.0,
        "data.split_seed": -1,
        **under("model", MODEL),
        **under("optimizer", OPTIMIZER),
        **under("batch", BATCH),
        **under("preflight", PREFLIGHT),
        **under("trainer", TRAINER),
        "gate.max_held_nll": 0.0,
        "gate.generation_check.prompts": 0,
        "gate.generation_check.max_new_tokens": 0,
        "gate.min_terminated_fraction": 1.5,
        **under("eval", EVAL),
        **under("run", RUN),
    },
    SelectionConfig: {
        "rule": "best_loss",
        "default_arm": "",
        "paired.eval_set": "",
        "paired.n_boot": 0,
        "paired.seed": -1,
        "paired.confidence": 1.0,
        "generation_check.prompts": 0,
        "generation_check.max_new_tokens": 0,
        **under("generation_band", BAND),
        **under("model", MODEL),
        **under("eval", EVAL),
        **under("run", RUN),
    },
    TinyConfig: {
        "seed": -1,
        "out_dir": "",
        "n_argilla": 0,
        "n_steppairs": 0,
        "n_sft": 0,
        "vocab_size": constants.MIN_VOCAB_SIZE - 1,
        "model.hidden_size": 0,
        "model.intermediate_size": 0,
        "model.num_hidden_layers": 0,
        "model.num_attention_heads": 0,
        "model.num_key_value_heads": 3,
        "model.max_position_embeddings": 0,
        "model.rope_theta": 0.0,
    },
}

# --- per loadable class: dotted key -> why it has no out-of-range value ----------------

EXEMPT: dict[type, dict[str, str]] = {
    ArmConfig: {
        "data.merge_system_into_user": FREE_BOOL,
        "data.filters.exclude_in_gsm8k_train": FREE_BOOL,
        "dpo.length_normalize": FREE_BOOL,
        **under("trainer", TRAINER_EXEMPT),
        **under("run", RUN_EXEMPT),
    },
    SftConfig: {**under("trainer", TRAINER_EXEMPT), **under("run", RUN_EXEMPT)},
    SelectionConfig: under("run", RUN_EXEMPT),
    TinyConfig: {"model.tie_word_embeddings": FREE_BOOL},
}


def override(key: str, value: Any) -> str:
    """`--key=value` as a command line spells it (a string raw, a list as TOML)."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, list):
        text = json.dumps(value)
    else:
        text = repr(value)
    return f"--{key}={text}"


CASES = [(cls, key, value) for cls, table in BAD.items() for key, value in table.items()]


@pytest.mark.parametrize("cls", list(BAD), ids=lambda cls: cls.__name__)
def test_every_leaf_key_has_a_bad_value_or_a_stated_exemption(cls):
    bad, exempt = set(BAD[cls]), set(EXEMPT[cls])
    assert not bad & exempt, f"both bad and exempt: {sorted(bad & exempt)}"
    leaves = set(leaf_paths(cls))
    assert leaves - bad - exempt == set(), "keys without a bad value or an exemption"
    assert (bad | exempt) - leaves == set(), "entries that are not keys"


@pytest.mark.parametrize("cls", list(BASE), ids=lambda cls: cls.__name__)
def test_the_shipped_file_each_table_edits_loads(cls):
    load_config(BASE[cls], cls)


@pytest.mark.parametrize(
    ("cls", "key", "value"), CASES, ids=[f"{cls.__name__}:{key}" for cls, key, _ in CASES]
)
def test_a_value_outside_its_range_is_refused_at_load_naming_the_key(cls, key, value):
    with pytest.raises(ConfigError) as err:
        load_config(BASE[cls], cls, [override(key, value)])
    message = str(err.value)
    assert err.value.exit_code == USAGE == 2
    assert f"key {key!r} expected " in message, message
    assert f"found {value!r}" in message, message
    assert str(BASE[cls]) in message


@pytest.mark.parametrize("betas", [[0.9], [1.5, -2.0], [0.9, 1.0], [0.9, 0.95, 0.99]])
def test_betas_are_two_decay_rates_in_0_1(betas):
    with pytest.raises(ConfigError, match=r"key 'optimizer.betas' expected two decay rates"):
        load_config(BASE[ArmConfig], ArmConfig, [override("optimizer.betas", betas)])


@pytest.mark.parametrize("layout", ["shared", "packed"])
@pytest.mark.parametrize("section", ["batch", "ref"])
def test_prefix_sharing_with_a_backend_that_cannot_mask_segments_is_refused(section, layout):
    forward = "model" if section == "batch" else "ref"
    tokens = [f"--{forward}.attn_implementation=triton_fa2", f"--{section}.layout={layout}"]
    with pytest.raises(ConfigError) as err:
        load_config(BASE[ArmConfig], ArmConfig, tokens)
    assert f"key '{section}.layout' expected 'padded' with attn_implementation" in str(err.value)
    shared = load_config(BASE[ArmConfig], ArmConfig, [f"--{section}.layout={layout}"]).cfg
    assert getattr(shared, section).layout == layout


@pytest.mark.parametrize("layout", ["shared", "packed"])
def test_sft_refuses_a_pair_layout(layout):
    with pytest.raises(ConfigError, match=r"key 'batch.layout' expected 'padded' \(SFT rows"):
        load_config(BASE[SftConfig], SftConfig, [f"--batch.layout={layout}"])


def test_every_failing_key_is_named_in_one_line():
    tokens = ["--optimizer.name=sgd", "--run.results_dir=", "--min_lr_ratio=2"]
    with pytest.raises(ConfigError) as err:
        load_config(BASE[ArmConfig], ArmConfig, tokens)
    message = str(err.value)
    assert "\n" not in message
    for key in ("optimizer.name", "optimizer.min_lr_ratio", "run.results_dir"):
        assert f"key {key!r} expected" in message


# --- one list of names: each consumer reads the list the config checks against --------


def test_consumers_that_name_a_set_import_it_from_constants():
    from align.stages import select
    from align.train import optim
    from align.utils import guard

    assert optim.OPTIMIZERS is constants.OPTIMIZERS
    assert guard.LOCK_MODES is constants.LOCK_MODES
    assert select.RULES is constants.SELECTION_RULES


def test_consumers_that_register_by_name_register_exactly_the_constants():
    from align.data.formats import READERS
    from align.model.attention import ATTENTION_BACKENDS
    from align.model.tokenizer import BYTE_ALPHABET_SIZE, SPECIAL_TOKENS

    assert tuple(ATTENTION_BACKENDS) == constants.ATTENTION_IMPLEMENTATIONS
    assert set(constants.SEGMENT_MASK_ATTENTION) < set(ATTENTION_BACKENDS)
    assert tuple(READERS) == constants.DATA_FORMATS
    assert BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS) == constants.MIN_VOCAB_SIZE
