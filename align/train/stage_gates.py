"""Gates the arm stages re-check before loading a model (no torch).

Each gate reads a receipt, verifies what it depends on, and raises `GateRefused`
naming the gate, the file and the expected vs found value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from align.config import ArmConfig
from align.exit_codes import GateRefused
from align.paths import SPLITS, RunPaths
from align.receipts import PASSED, load_receipt, verify_hash


def sft_gate(paths: RunPaths) -> dict[str, Any]:
    """The SFT quality receipt passed; returns it (its `checkpoint` is the one to use)."""
    receipt = load_receipt(paths.sft_gate, "sft_gate", stage="sft_gate")
    if receipt.get("status") != PASSED or receipt.get("passed") is not True:
        raise GateRefused(
            "sft_gate", f"{paths.sft_gate}: expected passed=true, found {receipt.get('passed')!r}"
        )
    if not Path(receipt["checkpoint"]).is_dir():
        raise GateRefused(
            "sft_gate", f"{paths.sft_gate}: checkpoint {receipt['checkpoint']} does not exist"
        )
    return receipt


def manifest_entry(paths: RunPaths, cfg: ArmConfig) -> dict[str, Any]:
    """The arm's manifest entry, with its counts equal to the pre-registration and shards intact."""
    manifest = load_receipt(paths.manifest, "manifest", stage="build_manifest")
    arms = manifest.get("arms", {})
    if cfg.arm not in arms:
        raise GateRefused(
            "manifest", f"{paths.manifest}: arm {cfg.arm!r} absent (found {sorted(arms)})"
        )
    entry = arms[cfg.arm]
    expected = {"train": cfg.data.expected_train_pairs, "held": cfg.data.expected_held_pairs}
    for split in SPLITS:
        found = entry["counts"][split]
        if expected[split] is not None and found != expected[split]:
            raise GateRefused(
                "manifest",
                f"{paths.manifest}: arm {cfg.arm} {split} pairs expected {expected[split]} "
                f"(data.expected_{split}_pairs), found {found}",
            )
        verify_hash("manifest", entry["shards"][split]["path"], entry["shards"][split]["hash"])
    for key, want in (
        ("seq_len", cfg.data.seq_len),
        ("truncation", cfg.data.truncation),
        ("format", cfg.data.format),
    ):
        if entry[key] != want:
            raise GateRefused(
                "manifest",
                f"{paths.manifest}: arm {cfg.arm} {key} expected {want!r}, found {entry[key]!r}",
            )
    return {**entry, "pins": manifest["pins"]}
