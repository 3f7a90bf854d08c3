"""Atomic receipts, content hashes, receipt reading for gates (align.receipts), and the
files receipts name, relative to the results directory (align.paths)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from align import __version__
from align import receipts as rc
from align.config import ArmConfig, load_config
from align.exit_codes import GATE_REFUSED, GateRefused
from align.paths import RunPaths
from align.receipts import (
    SCHEMA_VERSION,
    atomic_path,
    hash_file,
    hash_files,
    hash_json,
    load_receipt,
    make_receipt,
    verify_hash,
    write_json_atomic,
)

ARM_TOML = Path(__file__).resolve().parents[1] / "config" / "arms" / "argilla.toml"
ENVELOPE = {
    "schema_version",
    "stage",
    "status",
    "config_hash",
    "overrides",
    "inputs",
    "outputs",
    "package_version",
    "host",
    "started_at",
    "finished_at",
    "figures",
}


def receipt(stage: str = "sft_gate", status: str = rc.PASSED, **extra) -> dict:
    return make_receipt(
        stage,
        status,
        config_hash="abc",
        overrides={"optimizer.lr": 5e-7},
        inputs={"in": "h1"},
        outputs={"out": "h2"},
        started_at=rc.now_iso(),
        figures={"nll": 1.25},
        **extra,
    )


# --- atomic writes -----------------------------------------------------------------------


def test_write_json_atomic_writes_sorted_json_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "sub" / "r.json"
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2], "b": 1}
    assert path.read_text().index('"a"') < path.read_text().index('"b"')
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]


def test_failed_serialization_keeps_the_old_file_and_leaves_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"old": True})
    old = path.read_bytes()

    def broken_dumps(*args, **kwargs):
        raise RuntimeError("serializer failed")

    monkeypatch.setattr(rc.json, "dumps", broken_dumps)
    with pytest.raises(RuntimeError, match="serializer failed"):
        write_json_atomic(path, {"new": True})
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


def test_failure_after_a_partial_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"old": True})
    old = path.read_bytes()
    with pytest.raises(OSError, match="disk full"), atomic_path(path) as tmp:
        tmp.write_text('{"new": ')
        raise OSError("disk full")
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]


@pytest.mark.parametrize("umask", [0o022, 0o002, 0o077])
def test_file_mode_follows_the_umask(tmp_path, umask):
    # mkstemp creates 0600 files; a receipt must be readable as any normally written file.
    previous = os.umask(umask)
    try:
        path = tmp_path / "r.json"
        write_json_atomic(path, {"a": 1})
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_read_json_round_trips(tmp_path):
    write_json_atomic(tmp_path / "r.json", {"x": [1, 2.5, None]})
    assert rc.read_json(tmp_path / "r.json") == {"x": [1, 2.5, None]}


# --- hashes ------------------------------------------------------------------------------


def test_hash_file_is_sha256_of_the_bytes_and_sensitive_to_one_byte(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"hello world")
    assert hash_file(path) == rc.sha256_bytes(b"hello world")
    assert hash_file(path) == hash_file(path)
    path.write_bytes(b"hello World")
    assert hash_file(path) != rc.sha256_bytes(b"hello world")


def test_hash_file_streams_files_larger_than_one_chunk(tmp_path):
    data = os.urandom(rc._CHUNK + 17)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    assert hash_file(path) == rc.sha256_bytes(data)


def test_hash_files_ignores_argument_order(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("A")
    b.write_text("B")
    assert hash_files([a, b]) == hash_files([b, a])


def test_hash_files_is_sensitive_to_content_and_to_names(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("A")
    b.write_text("B")
    before = hash_files([a, b])
    b.write_text("B!")
    assert hash_files([a, b]) != before
    b.write_text("B")
    c = tmp_path / "c.txt"
    b.rename(c)
    assert hash_files([a, c]) != before


def test_hash_files_with_root_uses_relative_names(tmp_path):
    for root in (tmp_path / "one", tmp_path / "two"):
        (root / "sub").mkdir(parents=True)
        (root / "sub" / "f.txt").write_text("same")
    one = hash_files([tmp_path / "one" / "sub" / "f.txt"], root=tmp_path / "one")
    two = hash_files([tmp_path / "two" / "sub" / "f.txt"], root=tmp_path / "two")
    assert one == two
    assert one != hash_files([tmp_path / "one" / "sub" / "f.txt"])


def test_hash_json_ignores_key_order_and_detects_value_changes():
    assert hash_json({"a": 1, "b": [1, 2]}) == hash_json({"b": [1, 2], "a": 1})
    assert hash_json({"a": 1, "b": [1, 2]}) != hash_json({"a": 1, "b": [2, 1]})
    assert hash_json({"a": 1}) != hash_json({"a": 1.5})
    assert hash_json({"a": 1}) != hash_json({"a": "1"})


# --- the receipt envelope ----------------------------------------------------------------


def test_make_receipt_has_every_envelope_key():
    r = receipt(extra_field="kept")
    assert set(r) == ENVELOPE | {"extra_field"}
    assert r["schema_version"] == SCHEMA_VERSION
    assert r["stage"] == "sft_gate"
    assert r["status"] == rc.PASSED
    assert r["overrides"] == {"optimizer.lr": 5e-7}
    assert r["package_version"] == __version__
    assert r["figures"] == {"nll": 1.25}
    assert r["started_at"] <= r["finished_at"]


def test_make_receipt_defaults_empty_mappings():
    r = make_receipt(
        "s", rc.FAILED, config_hash=None, overrides=None, inputs=None, outputs=None, started_at="t"
    )
    assert (r["overrides"], r["inputs"], r["outputs"], r["figures"]) == ({}, {}, {}, {})


@pytest.mark.parametrize("status", ["passed", "OK", "", "SKIPPED"])
def test_make_receipt_refuses_an_unknown_status(status):
    with pytest.raises(ValueError, match="status"):
        receipt(status=status)


# --- reading receipts at a gate ----------------------------------------------------------


def refusal(path: Path, gate: str = "sft_gate", stage: str | None = None) -> str:
    with pytest.raises(GateRefused) as err:
        load_receipt(path, gate, stage=stage)
    assert err.value.exit_code == GATE_REFUSED == 3
    assert err.value.gate == gate
    message = str(err.value)
    assert f"gate {gate}" in message
    assert str(path) in message
    return message


def test_load_receipt_returns_a_valid_receipt(tmp_path):
    path = tmp_path / "gate.json"
    write_json_atomic(path, receipt())
    assert load_receipt(path, "sft_gate", stage="sft_gate")["figures"] == {"nll": 1.25}


def test_load_receipt_refuses_a_missing_file(tmp_path):
    assert "missing" in refusal(tmp_path / "gate.json")


def test_load_receipt_refuses_bad_json(tmp_path):
    path = tmp_path / "gate.json"
    path.write_text('{"schema_version": 1, "stage": ')
    assert "unreadable" in refusal(path)


@pytest.mark.parametrize(
    "content",
    [b"[1, 2]", b"null", b'"a receipt"', b"\xff\xfe{}"],
    ids=["list", "null", "str", "bytes"],
)
def test_load_receipt_refuses_content_that_is_not_a_json_object(tmp_path, content):
    # Anything other than a JSON object must end at the gate (exit 3), not as an internal error.
    path = tmp_path / "gate.json"
    path.write_bytes(content)
    refusal(path)


def test_load_receipt_refuses_a_wrong_schema_version(tmp_path):
    path = tmp_path / "gate.json"
    write_json_atomic(path, {**receipt(), "schema_version": SCHEMA_VERSION + 1})
    message = refusal(path)
    assert f"expected {SCHEMA_VERSION}" in message
    assert f"found {SCHEMA_VERSION + 1}" in message


def test_load_receipt_refuses_a_receipt_without_schema_version(tmp_path):
    path = tmp_path / "gate.json"
    write_json_atomic(path, {"stage": "sft_gate"})
    assert "found None" in refusal(path)


def test_load_receipt_refuses_a_receipt_of_another_stage(tmp_path):
    path = tmp_path / "manifest.json"
    write_json_atomic(path, receipt(stage="sft"))
    message = refusal(path, gate="manifest", stage="build_manifest")
    assert "expected 'build_manifest'" in message
    assert "found 'sft'" in message


def test_verify_hash_accepts_the_recorded_hash(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"abc")
    verify_hash("manifest", path, hash_file(path))


def test_verify_hash_refuses_a_changed_file_naming_expected_and_found(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"abc")
    recorded = hash_file(path)
    path.write_bytes(b"abd")
    with pytest.raises(GateRefused) as err:
        verify_hash("manifest", path, recorded)
    message = str(err.value)
    assert err.value.exit_code == GATE_REFUSED
    assert "gate manifest" in message
    assert str(path) in message
    assert f"expected {recorded[:12]}" in message
    assert f"found {hash_file(path)[:12]}" in message


def test_verify_hash_refuses_a_missing_file(tmp_path):
    with pytest.raises(GateRefused, match="missing"):
        verify_hash("manifest", tmp_path / "gone.bin", "0" * 64)


# --- portable receipts: files named against the results directory -----------------------


def test_a_file_inside_the_results_dir_is_recorded_relative_to_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    paths = RunPaths.of("results")
    assert paths.recorded(paths.sft_checkpoint) == "sft/checkpoint"
    assert paths.recorded(tmp_path / "results" / "data" / "x") == "data/x"
    assert paths.recorded("resources/base") == str(tmp_path / "resources" / "base")


def test_a_recorded_name_resolves_against_the_results_dir_in_use(tmp_path):
    original, moved = RunPaths.of(tmp_path / "a" / "results"), RunPaths.of(tmp_path / "b")
    name = original.recorded(original.manifest)
    assert name == "data/manifest.json"
    assert moved.resolve(name, "manifest", "r.json") == tmp_path / "b" / "data" / "manifest.json"


@pytest.mark.parametrize("name", ["../elsewhere/pairs.safetensors", "/somewhere/else/checkpoint"])
def test_a_receipt_naming_a_file_outside_the_results_dir_is_refused(tmp_path, name):
    paths = RunPaths.of(tmp_path / "results")
    with pytest.raises(GateRefused) as err:
        paths.resolve(name, "sft_gate", "sft/gate.json")
    message = str(err.value)
    assert err.value.exit_code == GATE_REFUSED
    assert "gate sft_gate: sft/gate.json" in message and repr(name) in message
    assert f"outside the results directory {tmp_path / 'results'}" in message


def test_an_external_location_the_config_names_may_be_named_by_a_receipt(tmp_path):
    store, data = tmp_path / "store" / "sft", tmp_path / "data"
    paths = RunPaths.of(tmp_path / "results", [store, data / "*.jsonl"])
    assert paths.resolve(str(store), "sft_gate", "g.json") == store
    assert paths.resolve(str(store / "model.safetensors"), "g", "g.json").parent == store
    assert paths.resolve(str(data / "a.jsonl"), "manifest", "m.json") == data / "a.jsonl"
    with pytest.raises(GateRefused, match="outside the results directory"):
        paths.resolve(str(tmp_path / "store" / "other"), "sft_gate", "g.json")


def test_of_config_names_the_sft_checkpoint_base_model_and_data_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = ["--run.sft_checkpoint=/models/sft", "--run.results_dir=out"]
    cfg = load_config(ARM_TOML, ArmConfig, overrides).cfg
    paths = RunPaths.of_config(cfg)
    assert paths.results == Path("out")
    assert paths.external == (
        "/models/sft",
        str(tmp_path / cfg.run.base_model),
        *(str(tmp_path / f) for f in cfg.data.files),
    )
