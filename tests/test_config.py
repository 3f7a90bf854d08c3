"""Strict TOML loading, typed dotted overrides and cross-field validation (align.config)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from align.config import ArmConfig, SelectionConfig, SftConfig, TinyConfig, load_config
from align.exit_codes import USAGE, ConfigError

CONFIG = Path(__file__).resolve().parents[1] / "config"
ARGILLA = CONFIG / "arms" / "argilla.toml"
STEPPAIRS = CONFIG / "arms" / "steppairs.toml"
SFT = CONFIG / "sft.toml"
TINY = CONFIG / "tiny" / "tiny.toml"


def edited_copy(tmp_path: Path, old: str, new: str, source: Path = ARGILLA) -> Path:
    """A copy of `source` with one exact line replaced, so each test changes only one thing."""
    text = source.read_text()
    assert old in text, f"{old!r} not in {source}"
    path = tmp_path / source.name
    path.write_text(text.replace(old, new, 1))
    return path


def refused(path: Path, cls: type = ArmConfig, overrides: list[str] | None = None) -> str:
    with pytest.raises(ConfigError) as err:
        load_config(path, cls, overrides)
    assert err.value.exit_code == USAGE == 2
    return str(err.value)


# --- the shipped pre-registrations load -------------------------------------------------


def test_argilla_arm_loads_with_its_values():
    loaded = load_config(ARGILLA, ArmConfig)
    cfg = loaded.cfg
    assert cfg.arm == "argilla"
    assert cfg.data.format == "argilla"
    assert cfg.data.seq_len == 96
    assert cfg.data.filters.exclude_status == ["tie"]
    assert cfg.data.filters.min_chosen_score == 8.0
    assert cfg.data.filters.exclude_in_gsm8k_train is True
    assert cfg.optimizer.lr == 1e-3
    assert cfg.batch.global_batch == 16
    assert loaded.overrides == {}
    assert loaded.source == ARGILLA


REPO = CONFIG.parent
# Every pre-registration the repository ships or tests with, by the section it fills.
CONFIG_CLASSES = {"arms": ArmConfig, "sft": SftConfig, "selection": SelectionConfig}


def config_class(path: Path) -> type:
    return CONFIG_CLASSES["arms" if path.parent.name == "arms" else path.stem]


@pytest.mark.parametrize(
    "path",
    sorted(
        p
        for root in (CONFIG, REPO / "tests" / "configs")
        for p in root.rglob("*.toml")
        if p.parent.name == "arms" or p.stem in CONFIG_CLASSES
    ),
    ids=lambda p: str(p.relative_to(REPO)),
)
def test_every_pre_registration_in_the_repository_loads(path):
    """A renamed or removed key reaches the shipped, rehearsal, production and test configs
    alike: each loads under its config class."""
    assert load_config(path, config_class(path)).source == path


def test_steppairs_arm_loads_with_default_filters():
    cfg = load_config(STEPPAIRS, ArmConfig).cfg
    assert cfg.arm == "steppairs"
    assert cfg.data.format == "steppairs"
    assert cfg.data.split_seed == 23
    assert cfg.data.filters.exclude_status == []
    assert cfg.data.filters.min_chosen_score is None


WIRES = ("collapse", "length_drift", "generation")


@pytest.mark.parametrize("path", sorted((CONFIG / "arms").glob("*.toml")), ids=lambda p: p.stem)
def test_every_shipped_pre_registration_arms_every_wire(path):
    wires = load_config(path, ArmConfig).cfg.tripwires
    assert wires.armed_wires() == list(WIRES)
    assert all(not reason for reason in vars(wires.disarmed).values())
    assert wires.response.rpo_alpha and wires.response.rpo_alpha > 0


@pytest.mark.parametrize("wire", WIRES)
def test_a_wire_cannot_be_switched_off_without_a_reason(wire):
    message = refused(ARGILLA, ArmConfig, [f"--tripwires.{wire}=false"])
    assert f"override key 'tripwires.{wire}' is not a config key" in message, message
    message = refused(ARGILLA, ArmConfig, [f"--tripwires.disarmed.{wire}= "])
    assert (
        f"key 'tripwires.disarmed.{wire}' expected empty (the {wire} wire armed) or the " in message
    )
    assert str(ARGILLA) in message


@pytest.mark.parametrize("wire", WIRES)
def test_a_stated_reason_disarms_its_wire_alone(wire):
    reason = f"--tripwires.disarmed.{wire}=watched by hand in this study"
    wires = load_config(ARGILLA, ArmConfig, [reason]).cfg.tripwires
    assert not wires.armed(wire)
    assert wires.armed_wires() == [w for w in WIRES if w != wire]


@pytest.mark.parametrize(
    "token, expected",
    [
        ("--tripwires.generation_band.min_terminated_vs_sft=1.5", "a fraction in [0, 1]"),
        ("--tripwires.generation_band.length_low=1.2", "a factor in [0, 1]"),
        ("--tripwires.generation_band.length_high=0.9", "a factor >= 1"),
        ("--tripwires.generation_every_steps=0", "an integer >= 1"),
        ("--tripwires.generation_check.prompts=0", "an integer >= 1"),
    ],
)
def test_a_generation_wire_setting_out_of_range_is_refused(token, expected):
    assert expected in refused(ARGILLA, ArmConfig, [token])


def test_sft_config_loads():
    cfg = load_config(SFT, SftConfig).cfg
    assert cfg.data.seq_len == 96
    assert cfg.gate.max_held_nll == 1.5
    assert cfg.gate.min_terminated_fraction == 0.75
    assert (
        cfg.batch.world_size * cfg.batch.micro_batch * cfg.batch.grad_accum
        == cfg.batch.global_batch
        == 32
    )


def test_tiny_config_loads():
    cfg = load_config(TINY, TinyConfig).cfg
    assert cfg.vocab_size == 384
    assert cfg.model.hidden_size == 256
    assert cfg.model.rope_theta == 10000.0
    assert cfg.model.tie_word_embeddings is False


def test_a_missing_config_file_is_refused(tmp_path):
    message = refused(tmp_path / "nope.toml")
    assert "nope.toml" in message


def test_invalid_toml_is_refused_naming_the_file(tmp_path):
    path = edited_copy(tmp_path, 'arm = "argilla"', 'arm = "argilla')
    assert str(path) in refused(path)


def latin1_copy(tmp_path: Path) -> Path:
    """argilla.toml behind a comment saved as Latin-1, which no UTF-8 decoder reads."""
    path = tmp_path / "latin1.toml"
    path.write_bytes("# café\n".encode("latin-1") + ARGILLA.read_bytes())
    return path


def test_a_file_that_is_not_utf8_is_refused_naming_the_file(tmp_path):
    path = latin1_copy(tmp_path)
    message = refused(path)
    assert str(path) in message
    assert "not UTF-8" in message


def test_a_stage_given_a_file_that_is_not_utf8_exits_2_without_a_traceback(tmp_path):
    path = latin1_copy(tmp_path)
    script = Path(__file__).resolve().parents[1] / "workflow" / "scripts" / "dpo.py"
    result = subprocess.run(
        [sys.executable, str(script), str(path), "--gates-only"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == USAGE, result.stderr
    assert "Traceback" not in result.stderr
    assert str(path) in result.stderr


def test_an_optimizer_that_does_not_exist_is_refused_at_load(tmp_path):
    path = edited_copy(tmp_path, 'name = "adamw"', 'name = "sgd"')
    message = refused(path)
    assert "key 'optimizer.name' expected one of ('adamw', 'adamw8bit'), found 'sgd'" in message


def test_an_empty_results_dir_is_refused_at_load(tmp_path):
    path = edited_copy(tmp_path, "[eval]", '[run]\nresults_dir = ""\n\n[eval]')
    assert "key 'run.results_dir' expected a directory (required), found ''" in refused(path)


# --- unknown keys and wrong types in the file -------------------------------------------


def test_unknown_top_level_key_is_refused_naming_file_and_key(tmp_path):
    path = edited_copy(tmp_path, 'arm = "argilla"', 'arm = "argilla"\ncolour = "red"')
    message = refused(path)
    assert str(path) in message
    assert "'colour'" in message


def test_unknown_nested_key_is_refused_with_its_dotted_name(tmp_path):
    path = edited_copy(tmp_path, "lr = 1e-3", "lr = 1e-3\nlrr = 1e-3")
    message = refused(path)
    assert str(path) in message
    assert "'optimizer.lrr'" in message


def test_unknown_section_is_refused(tmp_path):
    path = edited_copy(tmp_path, "[eval]", "[evaluation]")
    assert "'evaluation'" in refused(path)


def test_unknown_key_in_sft_config_is_refused(tmp_path):
    path = edited_copy(tmp_path, "max_held_nll = 1.5", "max_held_nll = 1.5\nmax_nll = 1.0", SFT)
    assert "'gate.max_nll'" in refused(path, SftConfig)


def test_string_for_an_int_is_refused_naming_key_expected_and_found(tmp_path):
    path = edited_copy(tmp_path, "seq_len = 96", 'seq_len = "96"')
    message = refused(path)
    assert "'data.seq_len'" in message
    assert "expected int" in message
    assert "found str" in message


def test_bool_for_an_int_is_refused(tmp_path):
    path = edited_copy(tmp_path, "seq_len = 96", "seq_len = true")
    message = refused(path)
    assert "'data.seq_len'" in message
    assert "expected int" in message
    assert "found bool" in message


def test_bool_for_a_float_is_refused(tmp_path):
    path = edited_copy(tmp_path, "lr = 1e-3", "lr = true")
    message = refused(path)
    assert "'optimizer.lr'" in message
    assert "expected float" in message


def test_wrong_type_inside_a_list_is_refused(tmp_path):
    path = edited_copy(tmp_path, "betas = [0.9, 0.95]", 'betas = [0.9, "0.95"]')
    assert "'optimizer.betas[1]'" in refused(path)


def test_scalar_where_a_table_belongs_is_refused(tmp_path):
    path = tmp_path / "scalar.toml"
    path.write_text('arm = "argilla"\neval = 32\n')
    message = refused(path)
    assert "'eval'" in message
    assert "table" in message


def test_int_is_accepted_for_a_float(tmp_path):
    path = edited_copy(tmp_path, "lr = 1e-3", "lr = 1")
    lr = load_config(path, ArmConfig).cfg.optimizer.lr
    assert lr == 1.0
    assert type(lr) is float


# --- overrides ---------------------------------------------------------------------------


@pytest.mark.parametrize("token", ["--lr=5e-7", "lr=5e-7", "--optimizer.lr=5e-7"])
def test_each_override_spelling_sets_the_float_and_is_returned(token):
    loaded = load_config(ARGILLA, ArmConfig, [token])
    assert loaded.cfg.optimizer.lr == 5e-7
    assert type(loaded.cfg.optimizer.lr) is float
    assert loaded.overrides == {"optimizer.lr": 5e-7}


def test_int_override_is_typed_int():
    loaded = load_config(ARGILLA, ArmConfig, ["--epochs=3"])
    assert loaded.cfg.batch.epochs == 3
    assert type(loaded.cfg.batch.epochs) is int
    assert loaded.overrides == {"batch.epochs": 3}


def test_list_override_is_parsed_as_a_list_of_floats():
    loaded = load_config(ARGILLA, ArmConfig, ["--betas=[0.8, 0.9]"])
    assert loaded.cfg.optimizer.betas == [0.8, 0.9]
    assert all(type(b) is float for b in loaded.cfg.optimizer.betas)
    assert loaded.overrides == {"optimizer.betas": [0.8, 0.9]}


def test_none_override_clears_an_optional_field():
    loaded = load_config(ARGILLA, ArmConfig, ["--min_chosen_score=none"])
    assert loaded.cfg.data.filters.min_chosen_score is None
    assert loaded.overrides == {"data.filters.min_chosen_score": None}


def test_bool_override_accepts_only_true_or_false():
    assert load_config(
        TINY, TinyConfig, ["--tie_word_embeddings=true"]
    ).cfg.model.tie_word_embeddings
    message = refused(TINY, TinyConfig, ["--tie_word_embeddings=1"])
    assert "model.tie_word_embeddings" in message


@pytest.mark.parametrize("token", ["--epochs=3.5", "--epochs=true", "--lr=fast"])
def test_override_value_that_does_not_parse_is_refused(token):
    key = token[2:].split("=")[0]
    assert key in refused(ARGILLA, ArmConfig, [token])


@pytest.mark.parametrize(
    ("tokens", "named"),
    [(["lr"], "'lr'"), (["--lr"], "'--lr'"), (["lr", "5e-7"], "'lr'"), (["5e-7"], "'5e-7'")],
)
def test_override_without_equals_is_refused_naming_the_token(tokens, named):
    message = refused(ARGILLA, ArmConfig, tokens)
    assert named in message
    assert "--key=value" in message


def test_unknown_override_key_is_refused_naming_it():
    message = refused(ARGILLA, ArmConfig, ["--learning_rate=5e-7"])
    assert "'learning_rate'" in message


def test_ambiguous_override_leaf_is_refused_listing_the_candidates():
    message = refused(ARGILLA, ArmConfig, ["--dtype=bfloat16"])
    assert "ambiguous" in message
    assert "model.dtype" in message
    assert "ref.dtype" in message


def test_dotted_override_resolves_what_a_leaf_cannot():
    loaded = load_config(ARGILLA, ArmConfig, ["--ref.dtype=bfloat16"])
    assert loaded.cfg.ref.dtype == "bfloat16"
    assert loaded.cfg.model.dtype == "float32"
    assert loaded.overrides == {"ref.dtype": "bfloat16"}


def test_override_does_not_touch_the_file_or_its_hash():
    before = load_config(ARGILLA, ArmConfig)
    after = load_config(ARGILLA, ArmConfig, ["--lr=5e-7"])
    assert before.source_hash == after.source_hash


# --- cross-field validation --------------------------------------------------------------


def test_batch_topology_mismatch_is_refused_with_the_numbers():
    message = refused(ARGILLA, ArmConfig, ["--global_batch=32"])
    assert "key 'batch.global_batch' expected world_size x micro_batch x grad_accum" in message
    assert "2 x 4 x 2 = 16, found 32" in message


def test_batch_topology_mismatch_in_the_file_is_refused(tmp_path):
    path = edited_copy(tmp_path, "grad_accum = 1", "grad_accum = 2", SFT)
    message = refused(path, SftConfig)
    assert "2 x 16 x 2 = 64, found 32" in message


def test_consistent_topology_override_is_accepted():
    cfg = load_config(ARGILLA, ArmConfig, ["--grad_accum=4", "--global_batch=32"]).cfg
    assert (cfg.batch.grad_accum, cfg.batch.global_batch) == (4, 32)


@pytest.mark.parametrize("token", ["--model.dtype=float64", "--ref.dtype=fp32"])
def test_bad_dtype_is_refused(token):
    key, value = token[2:].split("=")
    message = refused(ARGILLA, ArmConfig, [token])
    assert repr(key) in message
    assert repr(value) in message


def test_bad_data_format_is_refused():
    assert "'data.format'" in refused(ARGILLA, ArmConfig, ["--data.format=csv"])


@pytest.mark.parametrize(
    "token, key, expected",
    [
        ("--dpo.loss=kto", "dpo.loss", "one of ('sigmoid', 'ipo', 'hinge')"),
        ("--dpo.beta=0", "dpo.beta", "a finite number > 0"),
        ("--dpo.label_smoothing=0.5", "dpo.label_smoothing", "a fraction in [0, 0.5)"),
        ("--dpo.rpo_alpha=-0.1", "dpo.rpo_alpha", "a finite number >= 0"),
        ("--dpo.rdpo_alpha=inf", "dpo.rdpo_alpha", "a finite number >= 0"),
        ("--tripwires.response.beta=-1", "tripwires.response.beta", "a finite number > 0"),
        ("--run.threads=0", "run.threads", "an integer >= 1"),
        ("--ref.slice_pairs=0", "ref.slice_pairs", "an integer >= 1"),
        ("--data.held_fraction=1.0", "data.held_fraction", "a fraction in (0, 1)"),
        (
            "--preflight.device_memory_fraction=0",
            "preflight.device_memory_fraction",
            "a fraction in (0, 1]",
        ),
    ],
)
def test_each_section_refuses_its_own_out_of_range_field(token, key, expected):
    message = refused(ARGILLA, ArmConfig, [token])
    assert f"key {key!r} expected {expected}, found" in message, message


def test_site_gpus_per_node_that_do_not_divide_the_world_are_refused():
    overrides = ["--batch.world_size=3", "--batch.global_batch=24", "--run.gpus_per_node=2"]
    message = refused(ARGILLA, ArmConfig, overrides)
    assert "key 'run.gpus_per_node' expected 0 (one node) or a divisor of " in message
    assert "batch.world_size = 3, found 2" in message


def test_the_placement_is_the_sites_not_the_pre_registrations():
    message = refused(ARGILLA, ArmConfig, ["--batch.gpus_per_node=2"])
    assert "batch.gpus_per_node" in message and "not a config key" in message, message


def test_label_smoothing_is_refused_for_a_loss_it_does_not_apply_to():
    message = refused(ARGILLA, ArmConfig, ["--dpo.loss=ipo", "--dpo.label_smoothing=0.1"])
    assert "key 'dpo.label_smoothing' expected 0 for loss 'ipo'" in message


def test_a_field_named_like_a_checked_one_in_another_section_is_not_checked_by_its_name():
    # eval.batch_size and ref.batch_size are each their own section's; the SFT gate's
    # fraction may be 0 while a band's may not exceed 1.
    cfg = load_config(SFT, SftConfig, ["--gate.min_terminated_fraction=0.0"]).cfg
    assert cfg.gate.min_terminated_fraction == 0.0
    message = refused(SFT, SftConfig, ["--gate.min_terminated_fraction=1.5"])
    assert "key 'gate.min_terminated_fraction' expected a fraction in [0, 1]" in message


def test_missing_arm_name_is_refused(tmp_path):
    path = edited_copy(tmp_path, 'arm = "argilla"', "")
    assert "'arm'" in refused(path)


# --- the config hash ---------------------------------------------------------------------


def test_config_hash_is_stable_across_loads():
    assert (
        load_config(ARGILLA, ArmConfig).config_hash == load_config(ARGILLA, ArmConfig).config_hash
    )


def test_config_hash_changes_when_an_override_changes_a_value():
    loaded = load_config(ARGILLA, ArmConfig)
    base, epochs = loaded.config_hash, loaded.cfg.batch.epochs
    assert load_config(ARGILLA, ArmConfig, ["--lr=5e-7"]).config_hash != base
    assert load_config(ARGILLA, ArmConfig, [f"--epochs={epochs + 1}"]).config_hash != base


def test_config_hash_is_unchanged_by_an_override_to_the_same_value():
    base = load_config(ARGILLA, ArmConfig).config_hash
    assert load_config(ARGILLA, ArmConfig, ["--lr=1e-3"]).config_hash == base


def test_config_hash_differs_between_arms():
    assert (
        load_config(ARGILLA, ArmConfig).config_hash != load_config(STEPPAIRS, ArmConfig).config_hash
    )


# --- import weight -----------------------------------------------------------------------

LIGHT_MODULES = [
    "align.config",
    "align.receipts",
    "align.paths",
    "align.stages.entry",
    "align.stages.select",
    "align.report.summary",
    "align.stages.gates",
    "align.train.ref_cache",
]


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_light_module_does_not_import_torch(module):
    # A fresh interpreter: this test process has torch loaded by other test modules.
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"importing {module} imported torch\n{result.stderr}"
