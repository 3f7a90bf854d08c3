"""The reference log-prob cache: storage by pair id and its six-component key (align.train.ref_cache)."""

from __future__ import annotations

import dataclasses
import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import stand_in_cache_key
from safetensors.numpy import load_file, save_file

from align.data.metadata import read_metadata, single_key_metadata
from align.data.synthetic import default_texts, write_default_data
from align.exit_codes import GATE_REFUSED, GateRefused
from align.model.tiny import make_tiny_model
from align.model.tokenizer import TOKENIZER_FILE, train_bpe_tokenizer
from align.train.ref_cache import (
    CACHE_FORMAT,
    KEY_COMPONENTS,
    TENSORS_HASH,
    CacheKey,
    arrays_tensors_hash,
    check_key,
    check_tensors,
    expected_key,
    forward_impl_name,
    load_ref_cache,
    parse_forward_impl,
    read_cache_key,
    write_ref_cache,
)
from align.utils.weights_hash import file_tensors_hash, read_safetensors_header

# The tiny model is built on CPU; one thread avoids hand-off overhead on this small work.
torch.set_num_threads(1)

KEY = stand_in_cache_key("sdpa-fp32-b16-padded")
IDS = np.array([50, 10, 30, 20], dtype=np.int64)
CHOSEN = np.array([-5.0, -1.0, -3.0, -2.0], dtype=np.float32)
REJECTED = np.array([-50.0, -10.0, -30.0, -20.0], dtype=np.float32)


@pytest.fixture
def cache(tmp_path) -> Path:
    path = tmp_path / "ref" / "train.safetensors"
    write_ref_cache(path, IDS, CHOSEN, REJECTED, KEY)
    return path


def refusal(fn, *args) -> str:
    with pytest.raises(GateRefused) as err:
        fn(*args)
    assert err.value.exit_code == GATE_REFUSED
    assert err.value.gate == "ref_cache"
    return str(err.value)


def test_round_trip_in_the_written_order(cache):
    chosen, rejected = load_ref_cache(cache, KEY, IDS)
    assert np.array_equal(chosen, CHOSEN)
    assert np.array_equal(rejected, REJECTED)
    assert read_cache_key(cache) == KEY


def test_round_trip_is_aligned_by_pair_id_in_any_order(cache):
    wanted = np.array([20, 50, 10, 30])
    chosen, rejected = load_ref_cache(cache, KEY, wanted)
    assert chosen.tolist() == [-2.0, -5.0, -1.0, -3.0]
    assert rejected.tolist() == [-20.0, -50.0, -10.0, -30.0]


def test_write_leaves_only_the_cache_file(cache):
    assert [p.name for p in cache.parent.iterdir()] == [cache.name]


def test_matching_key_is_accepted(cache):
    check_key(cache, dataclasses.replace(KEY))


@pytest.mark.parametrize("component", KEY_COMPONENTS)
def test_each_changed_key_component_is_refused_by_name(cache, component):
    expected = dataclasses.replace(KEY, **{component: getattr(KEY, component) + "-changed"})
    message = refusal(check_key, cache, expected)
    assert repr(component) in message
    assert str(cache) in message
    assert repr(getattr(expected, component)) in message
    assert repr(getattr(KEY, component)) in message
    # Loading goes through the same check.
    assert repr(component) in refusal(load_ref_cache, cache, expected, IDS)


def test_six_components():
    assert KEY_COMPONENTS == (
        "checkpoint_weights",
        "tokenizer",
        "shard",
        "seq_len_truncation",
        "dtype",
        "forward_impl",
    )


@pytest.mark.parametrize(
    "stored",
    [
        {c: "x" for c in KEY_COMPONENTS if c != "dtype"},
        {**{c: "x" for c in KEY_COMPONENTS}, "extra": "x"},
        ["not", "a", "key"],
    ],
    ids=["missing_component", "foreign_component", "not_a_mapping"],
)
def test_a_stored_key_of_another_shape_is_refused_by_its_components(cache, stored):
    metadata = read_metadata(cache)
    arrays = load_file(str(cache))
    save_file(arrays, str(cache), metadata=single_key_metadata({**metadata, "key": stored}))
    message = refusal(read_cache_key, cache)
    assert str(cache) in message and "key expected ['checkpoint_weights'" in message, message


def test_missing_pair_ids_are_refused(cache):
    message = refusal(load_ref_cache, cache, KEY, np.array([10, 20, 30, 50, 99]))
    assert "missing" in message
    assert "99" in message


def test_extra_pair_ids_in_the_cache_are_refused(cache):
    message = refusal(load_ref_cache, cache, KEY, np.array([10, 20, 30]))
    assert "1 pair ids that the shard does not" in message


def test_a_missing_cache_is_refused(tmp_path):
    assert "missing" in refusal(check_key, tmp_path / "absent.safetensors", KEY)


# --- the cache's own bytes ------------------------------------------------------------------


def flip_tensor_byte(path: Path, tensor: str) -> None:
    """One bit of `tensor`'s first element, as bit rot or a partial overwrite would leave it."""
    begin = read_safetensors_header(path)[tensor].begin
    data = bytearray(path.read_bytes())
    data[begin] ^= 0x01
    path.write_bytes(bytes(data))


def test_the_cache_records_the_hash_of_its_tensor_bytes(cache, tmp_path):
    recorded = read_metadata(cache)[TENSORS_HASH]
    assert recorded == file_tensors_hash(cache) == arrays_tensors_hash(load_file(str(cache)))
    again = tmp_path / "again.safetensors"
    assert write_ref_cache(again, IDS, CHOSEN, REJECTED, KEY) == recorded
    assert write_ref_cache(again, IDS, CHOSEN + 1e-6, REJECTED, KEY) != recorded


def test_unchanged_tensor_bytes_pass_the_check(cache):
    check_tensors(cache, file_tensors_hash(cache), "receipt.json")


@pytest.mark.parametrize("tensor", ["chosen_logps", "rejected_logps", "pair_id"])
def test_flipped_byte_in_a_cache_tensor_is_refused_naming_the_file_and_both_hashes(cache, tensor):
    recorded = file_tensors_hash(cache)
    flip_tensor_byte(cache, tensor)
    found = file_tensors_hash(cache)
    message = refusal(check_tensors, cache, recorded, "receipt.json")
    assert f"{cache}: tensor bytes hash expected {recorded[:12]}" in message
    assert "(recorded by receipt.json)" in message
    assert f"found {found[:12]}" in message
    # The loader hashes the arrays it returns, against the cache's metadata.
    message = refusal(load_ref_cache, cache, KEY, IDS)
    assert f"{cache}: tensor bytes hash expected {recorded[:12]}" in message
    assert f"found {found[:12]}" in message


def test_cache_rewritten_with_its_own_hash_is_refused_against_the_receipt(cache):
    recorded = file_tensors_hash(cache)
    write_ref_cache(cache, IDS, CHOSEN - 1.0, REJECTED, KEY)
    load_ref_cache(cache, KEY, IDS)  # consistent with itself ...
    message = refusal(check_tensors, cache, recorded, "receipt.json")  # ... not with the receipt
    assert f"expected {recorded[:12]}" in message
    assert f"found {file_tensors_hash(cache)[:12]}" in message


def test_metadata_hash_differing_from_the_receipt_is_refused(cache):
    recorded = file_tensors_hash(cache)
    arrays = load_file(str(cache))
    metadata = {"format": CACHE_FORMAT, "key": KEY.as_dict(), TENSORS_HASH: "0" * 64}
    save_file(arrays, str(cache), metadata=single_key_metadata(metadata))
    message = refusal(check_tensors, cache, recorded, "receipt.json")
    assert f"metadata {TENSORS_HASH} expected {recorded[:12]}" in message
    assert "found 000000000000" in message
    assert "tensor bytes hash expected" in refusal(load_ref_cache, cache, KEY, IDS)


def test_forward_impl_name_describes_the_path():
    assert forward_impl_name("sdpa", "float32", 16) == "sdpa-fp32-b16-padded"
    assert forward_impl_name("eager", "bfloat16", 4, "shared") == "eager-bf16-b4-shared"
    assert forward_impl_name("flex", "float32", 8, "packed") == "flex-fp32-b8-packed"


def test_parse_forward_impl_inverts_the_name_and_refuses_an_unknown_layout():
    cases = (("sdpa", "float32", 16, "padded"), ("eager", "bfloat16", 4, "packed"))
    for args in cases:
        parsed = parse_forward_impl(forward_impl_name(*args))
        assert tuple(parsed.values()) == args
    with pytest.raises(ValueError, match=re.escape("<padded|shared|packed>")):
        parse_forward_impl("sdpa-fp32-b16-two_rows")


# --- the key computed from a real checkpoint ---------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt")
    data = write_default_data(root / "data", seed=0, n_argilla=20, n_steppairs=20, n_sft=20)
    tokenizer_dir = train_bpe_tokenizer(list(default_texts(data)), 300, root / "tok")
    return make_tiny_model(
        root / "model",
        tokenizer_dir,
        seed=0,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
    )


@pytest.fixture
def copy(tmp_path, checkpoint) -> Path:
    target = tmp_path / "model"
    shutil.copytree(checkpoint, target)
    shard = tmp_path / "pairs.safetensors"
    shard.write_bytes(b"shard bytes")
    return target


def key_of(checkpoint: Path) -> CacheKey:
    shard = checkpoint.parent / "pairs.safetensors"
    return expected_key(
        checkpoint, shard, 96, "prompt_left_response_right", "float32", "sdpa-fp32-b16-padded"
    )


def flip_one_weight_byte(checkpoint: Path) -> None:
    path = checkpoint / "model.safetensors"
    data = bytearray(path.read_bytes())
    (header_bytes,) = struct.unpack("<Q", data[:8])
    data_start = 8 + header_bytes
    position = data_start + (len(data) - data_start) // 2
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


def test_expected_key_is_stable(copy):
    assert key_of(copy) == key_of(copy)
    assert key_of(copy).seq_len_truncation == "96:prompt_left_response_right"


def test_one_weight_byte_changes_only_the_weights_component(copy):
    before = key_of(copy)
    flip_one_weight_byte(copy)
    after = key_of(copy)
    changed = {c for c in KEY_COMPONENTS if getattr(before, c) != getattr(after, c)}
    assert changed == {"checkpoint_weights"}


def test_a_cache_built_before_a_weight_change_is_refused(copy, tmp_path):
    cache = tmp_path / "train.safetensors"
    write_ref_cache(cache, IDS, CHOSEN, REJECTED, key_of(copy))
    flip_one_weight_byte(copy)
    assert "'checkpoint_weights'" in refusal(check_key, cache, key_of(copy))


def test_a_tokenizer_edit_changes_only_the_tokenizer_component(copy):
    before = key_of(copy)
    path = copy / TOKENIZER_FILE
    path.write_text(path.read_text() + " ")
    after = key_of(copy)
    assert {c for c in KEY_COMPONENTS if getattr(before, c) != getattr(after, c)} == {"tokenizer"}


def test_a_shard_edit_changes_only_the_shard_component(copy):
    before = key_of(copy)
    (copy.parent / "pairs.safetensors").write_bytes(b"other shard bytes")
    after = key_of(copy)
    assert {c for c in KEY_COMPONENTS if getattr(before, c) != getattr(after, c)} == {"shard"}
