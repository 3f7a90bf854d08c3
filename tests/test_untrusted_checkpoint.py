"""Untrusted checkpoints are refused cleanly (exit 3), never crash a stage: a config.json
that lies about the tensors, and safetensors headers that lie about the file.

The two cases that used to end a stage with a traceback (exit 70) run through the SFT
gate's real entry, under an address-space limit that a petabyte allocation could not
pass quietly; the rest of the family is checked at the library function.
"""

from __future__ import annotations

import json
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from mistral_7b import write_config_only_checkpoint
from tiny_models import TINY_SIZES

from align.config import SftConfig
from align.exit_codes import GATE_REFUSED, PREFLIGHT_REFUSED, PreflightRefused
from align.model.checkpoint_shapes import verified_hf_config, verify_checkpoint
from align.model.hf_config import load_hf_config
from align.train.memory import check_stage_rss
from align.utils.weights_hash import (
    UntrustedFileRefused,
    read_safetensors_header,
    read_safetensors_metadata,
)

REPO = Path(__file__).resolve().parents[1]
SFT_GATE = REPO / "workflow" / "scripts" / "sft_gate.py"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"
# The stage may map its interpreter and libraries; a petabyte (or 2^62 bytes) it may not.
ADDRESS_SPACE_LIMIT = 4 << 30
SFT_TOML = """
[data]
files = ["{data}"]
seq_len = 32

[gate]
max_held_nll = 20.0
min_terminated_fraction = 0.0

[gate.generation_check]
prompts = 2
max_new_tokens = 4

[run]
heavy_lock = "off"
threads = 1
"""


@pytest.fixture(scope="module")
def honest(tmp_path_factory) -> Path:
    """A tiny single-file checkpoint whose config.json tells the truth, with its tokenizer."""
    from align.model.tiny import make_tiny_model
    from align.model.tokenizer import train_bpe_tokenizer

    work = tmp_path_factory.mktemp("honest")
    texts = [f"{a} and {b} make {a + b}." for a in range(12) for b in range(12)]
    train_bpe_tokenizer(texts, 300, work / "tokenizer")
    return make_tiny_model(work / "model", work / "tokenizer", seed=0, **TINY_SIZES)


@pytest.fixture(scope="module")
def honest_sharded(honest, tmp_path_factory) -> Path:
    """The same weights as several shards with their index."""
    from align.model.checkpoint import load_pretrained, save_hf_checkpoint

    out = tmp_path_factory.mktemp("sharded") / "model"
    return save_hf_checkpoint(load_pretrained(honest), out, honest, max_shard_bytes=20_000)


@pytest.fixture
def copy(honest, tmp_path) -> Path:
    return shutil.copytree(honest, tmp_path / "checkpoint")


def edit_config(checkpoint: Path, **changes) -> None:
    path = checkpoint / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_header(path: Path, edit) -> None:
    """Rewrite a safetensors header in place of the old one; the data bytes stay as they are."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def refused(call, *args) -> UntrustedFileRefused:
    with pytest.raises(UntrustedFileRefused) as err:
        call(*args)
    assert err.value.exit_code == GATE_REFUSED
    return err.value


def limit_address_space() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))


def run_sft_gate(checkpoint: Path, work: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The SFT gate's stage entry on `checkpoint`, under the address-space limit."""
    data = work / "sft.jsonl"
    data.write_text(json.dumps({"messages": []}) + "\n")
    toml = work / "sft.toml"
    toml.write_text(SFT_TOML.format(data=data))
    command = [sys.executable, str(SFT_GATE), str(toml), f"--run.sft_checkpoint={checkpoint}"]
    command += [f"--run.results_dir={work / 'results'}", *overrides]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=work,
        preexec_fn=limit_address_space,
    )


def refusal_line(run: subprocess.CompletedProcess, exit_code: int, phrase: str) -> str:
    """The one line the stage refused with (its last, the only one with `phrase`); no
    traceback anywhere."""
    assert run.returncode == exit_code, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    assert [line for line in lines if phrase in line] == lines[-1:], run.stderr[-3000:]
    assert lines[-1].startswith("align sft_gate: ")
    return lines[-1]


# --- through the stage entry ------------------------------------------------------------


def test_config_vocab_size_1e12_refused_exit_3_before_allocation(copy, tmp_path):
    shape = list(read_safetensors_header(copy / WEIGHTS)[EMBED].shape)
    edit_config(copy, vocab_size=10**12)
    line = refusal_line(run_sft_gate(copy, tmp_path), GATE_REFUSED, "vocab_size=")
    assert str(copy / "config.json") in line and "vocab_size=1000000000000" in line
    assert f"{EMBED} of shape {shape}" in line and str(copy / WEIGHTS) in line
    assert not (tmp_path / "results" / "sft" / "gate.json").exists()


def test_safetensors_header_length_2_pow_62_refused_exit_3(copy, tmp_path):
    path = copy / WEIGHTS
    data = path.read_bytes()
    path.write_bytes(struct.pack("<Q", 2**62) + data[8:])
    line = refusal_line(run_sft_gate(copy, tmp_path), GATE_REFUSED, "header length")
    assert str(path) in line and f"found {2**62}" in line
    assert f"file size {len(data)}" in line


def test_stage_projection_over_the_node_refused_exit_6_before_loading(honest, tmp_path):
    run = run_sft_gate(honest, tmp_path, "--run.node_memory_mb=1")
    line = refusal_line(run, PREFLIGHT_REFUSED, "projected RSS")
    assert "projected RSS" in line and "of the node's 1 MiB (run.node_memory_mb)" in line
    assert "load_staging_rank0" in line


# --- config.json against the tensors -----------------------------------------------------


def test_honest_checkpoint_is_its_config_and_fits(honest, honest_sharded):
    for checkpoint in (honest, honest_sharded):
        assert verified_hf_config(checkpoint) == load_hf_config(checkpoint)
    stored = sum(t.end - t.begin for t in read_safetensors_header(honest / WEIGHTS).values())
    assert (
        verify_checkpoint(honest).stored_bytes
        == verify_checkpoint(honest_sharded).stored_bytes
        == stored
    )
    projection = check_stage_rss("sft_gate", SftConfig(), honest)
    assert projection["headroom_mb"] > 0


def test_projection_over_the_node_refused_exit_6_naming_projection_and_available(honest):
    cfg = SftConfig()
    cfg.run.node_memory_mb, cfg.run.node_memory_source = 1.0, "a 1 MiB node"
    with pytest.raises(PreflightRefused) as err:
        check_stage_rss("sft_gate", cfg, honest)
    assert err.value.exit_code == PREFLIGHT_REFUSED
    assert "projected RSS" in str(err.value) and "node's 1 MiB (a 1 MiB node)" in str(err.value)


def test_config_vocab_size_1e12_refused_by_the_projection_before_the_memory_check(copy):
    edit_config(copy, vocab_size=10**12)
    err = refused(check_stage_rss, "sft_gate", SftConfig(), copy)
    assert "vocab_size=1000000000000" in str(err)


def test_config_vocab_size_1e12_refused_by_load_pretrained(copy):
    from align.model.checkpoint import load_pretrained

    edit_config(copy, vocab_size=10**12)
    assert "vocab_size=1000000000000" in str(refused(load_pretrained, copy))


def test_config_hidden_size_lie_refused_naming_hidden_size(copy):
    edit_config(copy, hidden_size=2 * TINY_SIZES["hidden_size"])
    err = refused(verified_hf_config, copy)
    assert f"hidden_size={2 * TINY_SIZES['hidden_size']} disagrees with {EMBED}" in str(err)
    assert err.path == copy / "config.json"


def test_config_intermediate_size_lie_refused(copy):
    edit_config(copy, intermediate_size=10**9)
    err = refused(verified_hf_config, copy)
    assert "intermediate_size=1000000000 disagrees with model.layers.0.mlp.gate_proj" in str(err)


def test_config_num_key_value_heads_lie_refused(copy):
    edit_config(copy, num_key_value_heads=4)
    message = str(refused(verified_hf_config, copy))
    assert "num_key_value_heads x head_dim = 4 x 8 disagrees with" in message
    assert "model.layers.0.self_attn.k_proj.weight of shape [16, 32]" in message


def test_config_num_hidden_layers_more_than_tensors_present_refused(copy):
    edit_config(copy, num_hidden_layers=10**9)
    message = str(refused(verified_hf_config, copy))
    assert "num_hidden_layers=1000000000 disagrees with the weights" in message
    assert "which hold layers 0..1" in message and "model.layers.2.*" in message


def test_config_num_hidden_layers_fewer_than_tensors_present_refused(copy):
    edit_config(copy, num_hidden_layers=1)
    message = str(refused(verified_hf_config, copy))
    assert "num_hidden_layers=1 disagrees" in message
    assert "unexpected tensors ['model.layers.1." in message


def test_untied_config_without_lm_head_refused_naming_tie_word_embeddings(copy):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(copy / WEIGHTS)
    del tensors["lm_head.weight"]
    save_file(tensors, copy / WEIGHTS)
    with pytest.raises(UntrustedFileRefused, match="tie_word_embeddings=false disagrees"):
        verified_hf_config(copy)


def test_config_json_that_is_not_json_refused(copy):
    (copy / "config.json").write_text("{ not json")
    err = refused(verified_hf_config, copy)
    assert err.path == copy / "config.json"


def test_config_with_a_negative_vocab_size_refused(copy):
    edit_config(copy, vocab_size=-1)
    assert "vocab_size=-1 must be a positive integer" in str(refused(verified_hf_config, copy))


# --- the shard index ---------------------------------------------------------------------


def test_index_whose_total_size_lies_refused(honest_sharded, tmp_path):
    copy = shutil.copytree(honest_sharded, tmp_path / "sharded")
    index = json.loads((copy / INDEX).read_text())
    real = index["metadata"]["total_size"]
    index["metadata"]["total_size"] = 10**15
    (copy / INDEX).write_text(json.dumps(index))
    err = refused(verify_checkpoint, copy)
    assert err.path == copy / INDEX and f"expected {real}" in str(err) and "found 10" in str(err)


def test_plan_index_whose_total_size_lies_refused(tmp_path):
    stub = write_config_only_checkpoint(tmp_path / "mistral-7b")
    assert verify_checkpoint(stub).stored_bytes == 2 * 7_241_732_096
    index = json.loads((stub / INDEX).read_text())
    index["metadata"]["total_size"] = 1
    (stub / INDEX).write_text(json.dumps(index))
    message = str(refused(verify_checkpoint, stub))
    assert "metadata.total_size expected one of [14483464192, 28966928384]" in message
    assert "found 1" in message


def test_plan_config_vocab_size_1e12_refused_by_the_index_total_size(tmp_path):
    stub = write_config_only_checkpoint(tmp_path / "mistral-7b")
    edit_config(stub, vocab_size=10**12)
    assert "found 14483464192" in str(refused(verify_checkpoint, stub))


# --- safetensors headers -----------------------------------------------------------------


def test_file_smaller_than_8_bytes_refused(copy):
    (copy / WEIGHTS).write_bytes(b"\x01\x02")
    err = refused(read_safetensors_header, copy / WEIGHTS)
    assert "2 bytes is too short" in str(err) and err.path == copy / WEIGHTS


def test_metadata_reader_bounds_the_header_length_2_pow_62(copy):
    path = copy / WEIGHTS
    path.write_bytes(struct.pack("<Q", 2**62) + path.read_bytes()[8:])
    assert f"found {2**62}" in str(refused(read_safetensors_metadata, path))


def test_header_that_is_not_json_refused(copy):
    path = copy / WEIGHTS
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"\xff" * length + data[8 + length :])
    assert "expected a header of one JSON object, found no JSON" in str(
        refused(read_safetensors_header, path)
    )


def test_header_json_not_an_object_refused(copy):
    path = copy / WEIGHTS
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    path.write_bytes(data[:8] + b"[1]".ljust(length) + data[8 + length :])
    assert "expected a header of one JSON object, found a JSON array" in str(
        refused(read_safetensors_header, path)
    )


def test_header_offsets_past_the_file_end_refused(copy):
    def past_the_end(header):
        begin, end = header[EMBED]["data_offsets"]
        header[EMBED]["data_offsets"] = [begin, end + 10**12]

    edit_header(copy / WEIGHTS, past_the_end)
    message = str(refused(verified_hf_config, copy))
    assert f"tensor '{EMBED}' has data_offsets" in message and "outside the file" in message


def test_header_negative_shape_refused(copy):
    edit_header(copy / WEIGHTS, lambda header: header[EMBED].update(shape=[-300, -32]))
    assert "shape [-300, -32] is not a list of counts" in str(refused(verified_hf_config, copy))


def test_header_huge_shape_disagreeing_with_its_offsets_refused(copy):
    edit_header(copy / WEIGHTS, lambda header: header[EMBED].update(shape=[10**12, 32]))
    message = str(refused(verified_hf_config, copy))
    assert f"needs {4 * 32 * 10**12} bytes" in message and "data_offsets span" in message


def test_header_dtype_that_is_no_safetensors_dtype_refused(copy):
    edit_header(copy / WEIGHTS, lambda header: header[EMBED].update(dtype="F1024"))
    assert "dtype 'F1024' is not a safetensors dtype" in str(refused(verified_hf_config, copy))


def test_header_overlapping_tensors_refused(copy):
    def overlap(header):
        header[EMBED]["data_offsets"] = header["model.norm.weight"]["data_offsets"]
        header[EMBED]["shape"] = header["model.norm.weight"]["shape"]

    edit_header(copy / WEIGHTS, overlap)
    assert "holes and overlaps are refused" in str(refused(read_safetensors_header, copy / WEIGHTS))


# --- every JSON file of a checkpoint, through its reader -----------------------------------

# Valid JSON that no reader can walk: an array nested 200,000 deep.
DEEP_NESTING = "[" * 200_000 + "]" * 200_000
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def nested_header(path: Path) -> None:
    """`path`'s safetensors header replaced by DEEP_NESTING (its data bytes kept)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    raw = DEEP_NESTING.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + length :])


def load_tokenizer_of(checkpoint: Path):
    from align.model.tokenizer import load_tokenizer

    return load_tokenizer(checkpoint)


def reader_of(name: str):
    """The reader that parses checkpoint file `name`."""
    return load_tokenizer_of if name in TOKENIZER_FILES else verify_checkpoint


JSON_FILES = (*TOKENIZER_FILES, "config.json", "generation_config.json", INDEX)
# A field of the wrong type for each file, merged into its honest content, and the phrase
# its refusal names.
WRONG_TYPES = {
    "tokenizer.json": ({"model": 7}, "reads as a Tokenizer, found data did not match"),
    "tokenizer_config.json": ({"eos_token": ["</s>"]}, "eos_token expected a string"),
    "special_tokens_map.json": ({"bos_token": {"content": 1}}, "bos_token expected a string"),
    "config.json": ({"vocab_size": "300"}, "vocab_size='300' must be a positive integer"),
    "generation_config.json": ({"eos_token_id": "2"}, "eos_token_id expected a token id"),
    INDEX: ({"weight_map": ["model-00001.safetensors"]}, "weight_map maps tensor names"),
}


@pytest.fixture
def sharded_copy(honest_sharded, tmp_path) -> Path:
    """The sharded checkpoint with every optional JSON file a hub checkpoint may carry."""
    copy = shutil.copytree(honest_sharded, tmp_path / "sharded")
    (copy / "special_tokens_map.json").write_text(json.dumps({"eos_token": "</s>"}))
    (copy / "generation_config.json").write_text(json.dumps({"bos_token_id": 1}))
    return copy


def test_every_json_file_of_the_checkpoint_is_read_by_a_reader_here(sharded_copy):
    load_tokenizer_of(sharded_copy)
    verify_checkpoint(sharded_copy)
    assert {path.name for path in sharded_copy.iterdir()} >= set(JSON_FILES)


@pytest.mark.parametrize("name", JSON_FILES)
def test_a_checkpoint_json_file_nested_200000_deep_refused_exit_3_naming_it(sharded_copy, name):
    (sharded_copy / name).write_text(DEEP_NESTING)
    err = refused(reader_of(name), sharded_copy)
    assert err.path == sharded_copy / name
    assert str(sharded_copy / name) in str(err)
    assert "expected a JSON object" in str(err) and "nested deeper" in str(err)


@pytest.mark.parametrize("name", JSON_FILES)
def test_a_checkpoint_json_file_of_the_wrong_type_refused_exit_3_naming_it(sharded_copy, name):
    path = sharded_copy / name
    fields, phrase = WRONG_TYPES[name]
    wrong_field = json.dumps({**json.loads(path.read_text()), **fields})
    for text, expected in (("[1, 2]", "found a JSON array"), (wrong_field, phrase)):
        path.write_text(text)
        err = refused(reader_of(name), sharded_copy)
        assert err.path == path and expected in str(err), str(err)


def test_a_safetensors_header_nested_200000_deep_refused_exit_3(copy):
    nested_header(copy / WEIGHTS)
    err = refused(read_safetensors_header, copy / WEIGHTS)
    assert err.path == copy / WEIGHTS and "nested deeper" in str(err)


def test_a_chat_template_of_the_wrong_type_refused_exit_3(copy):
    path = copy / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": 7}))
    err = refused(load_tokenizer_of, copy)
    assert err.path == path and "chat_template expected a string" in str(err)


def test_preregister_with_a_tokenizer_json_nested_200000_deep_refused_exit_3(copy, tmp_path):
    """The reported case: `align preregister` ended with a traceback (exit 1) here."""
    (copy / "tokenizer.json").write_text(DEEP_NESTING)
    command = [sys.executable, "-m", "align.cli", "preregister", "config/arms/argilla.toml"]
    run = subprocess.run(
        [*command, f"--checkpoint={copy}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        preexec_fn=limit_address_space,
    )
    assert run.returncode == GATE_REFUSED, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    (line,) = run.stderr.splitlines()
    assert line.startswith("align preregister: gate checkpoint: ")
    assert str(copy / "tokenizer.json") in line and "nested deeper" in line
