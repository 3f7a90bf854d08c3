"""Equivalence receipts of an attention backend that must be proven before it runs.

A backend declares a `GateSpec`: what its result depends on (the receipt's key), the
pre-registered shapes it is measured on, and the thresholds of each tensor's relative
error against a float64 reference. `seal_receipt` writes the measured results with a hash
of their contents; `verify_receipt` refuses a missing, tampered, stale or failed one, and
the attention selector asks it before the backend may run. The triton_fa2 kernel
(align.kernels.equivalence) and FlexAttention (align.kernels.flex) are proven this way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from align.exit_codes import ConfigError, GateRefused
from align.receipts import hash_json, now_iso, read_json, write_json_atomic

RECEIPTS_ENV = "ALIGN_KERNEL_RECEIPTS"
DEFAULT_RECEIPTS_DIR = Path("~/.cache/align/kernels")
RECEIPT_SCHEMA = 1


@dataclass(frozen=True)
class AttentionShape:
    """What every pre-registered case draws its q, k and v by; a backend's gate adds the
    layout it measures."""

    batch: int
    q_heads: int
    kv_heads: int
    length: int
    head_dim: int
    dtype: str

    def as_dict(self) -> dict[str, Any]:
        """The case as a receipt records it (JSON's lists for tuples)."""
        return json.loads(json.dumps(asdict(self)))


def proven_by(grid: Sequence[AttentionShape]) -> tuple[frozenset[torch.dtype], frozenset[int]]:
    """The dtypes and head dims a gate's grid proves."""
    return (
        frozenset(getattr(torch, shape.dtype) for shape in grid),
        frozenset(shape.head_dim for shape in grid),
    )


@dataclass(frozen=True)
class GateSpec:
    """One backend's gate: its receipts are named, keyed and judged by these."""

    backend: str
    command: str  # the CLI that proves the backend on this machine
    receipt_env: str  # a stage reads the workflow's receipt at this variable's path
    key_components: dict[str, str]  # key field -> what it names, for a stale receipt's error
    metric: str
    thresholds: dict[str, dict[str, float]]  # dtype -> tensor -> largest relative error
    grid_for: Callable[[dict[str, str]], Sequence[Any]]  # key -> the shapes to measure

    def rerun(self) -> str:
        return f"run `{self.command}` on this machine to prove {self.backend}"


def relative_error(found: torch.Tensor, reference: torch.Tensor) -> float:
    """max|found - reference| / max|reference|; absolute when the reference is all zero."""
    diff = (found.double() - reference.double()).abs().max().item()
    scale = reference.double().abs().max().item()
    return diff / scale if scale > 0 else diff


def over_threshold(errors: dict[str, float], thresholds: dict[str, float]) -> list[str]:
    """The tensors whose error is above its threshold or not finite (every tensor that the
    thresholds of its dtype name; `_check_current` holds them to the spec's)."""
    return [
        name
        for name in thresholds
        if not (math.isfinite(errors[name]) and errors[name] <= thresholds[name])
    ]


def within(errors: dict[str, float], thresholds: dict[str, float]) -> bool:
    return not over_threshold(errors, thresholds)


def draw_inputs(shape: Any, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """Seeded q, k, v and the output gradient of a shape, drawn in float32 and rounded to
    its dtype, so every path computes on the same rounded inputs."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def draw(heads: int) -> torch.Tensor:
        size = (shape.batch, heads, shape.length, shape.head_dim)
        return torch.randn(size, generator=generator, device=device).to(getattr(torch, shape.dtype))

    return draw(shape.q_heads), draw(shape.kv_heads), draw(shape.kv_heads), draw(shape.q_heads)


def shape_result(
    shape: Any,
    seed: int,
    thresholds: dict[str, float],
    found: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    baseline: dict[str, torch.Tensor],
) -> dict[str, Any]:
    """One shape's entry of a receipt: each tensor's error against the float64 reference,
    the verdict, and for context SDPA's own error in the backend's dtype."""
    errors = {name: relative_error(found[name], reference[name]) for name in found}
    return {
        "shape": shape.as_dict(),
        "seed": seed,
        "errors": errors,
        "thresholds": thresholds,
        "passed": within(errors, thresholds),
        "sdpa_same_dtype_errors": {
            name: relative_error(baseline[name], reference[name]) for name in found
        },
    }


Measure = Callable[[Any, torch.device, int], dict[str, Any]]


def run_gate(
    spec: GateSpec,
    device: torch.device | str,
    key: dict[str, str],
    measure: Measure,
    grid: Sequence[Any] | None = None,
) -> dict[str, Any]:
    """`measure(shape, device, seed)` every shape of `grid` (the key's grid by default); the
    sealed receipt (not yet written)."""
    device = torch.device(device)
    grid = spec.grid_for(key) if grid is None else grid
    started = time.perf_counter()
    results = []
    for seed, shape in enumerate(grid):
        results.append(measure(shape, device, seed))
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the float64 references of the long shapes are GBs
    return seal_receipt(spec, key, results, time.perf_counter() - started)


def main(
    spec: GateSpec,
    argv: Sequence[str] | None,
    device_key: Callable[[str], dict[str, str]],
    measure: Measure,
    description: str,
) -> int:
    """The gate's CLI: prove the backend on --device, write the receipt either way, and
    exit 3 (GateRefused) when it failed."""
    parser = argparse.ArgumentParser(prog=spec.command, description=description)
    parser.add_argument("--out", type=Path, help="receipt path (default: the per-device path)")
    parser.add_argument("--device", default="cuda", help="device to prove (default: cuda)")
    args = parser.parse_args(argv)
    try:
        key = device_key(args.device)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    out = args.out or receipt_path(spec, key)
    receipt = run_gate(spec, args.device, key, measure)
    write_json_atomic(out, receipt)
    for result in receipt["results"]:
        errors = " ".join(f"{name}={error:.2e}" for name, error in result["errors"].items())
        first_call = f" first call {result['first_call_s']} s" if "first_call_s" in result else ""
        print(f"{'ok  ' if result['passed'] else 'FAIL'} {result['shape']} {errors}{first_call}")
    if not receipt["passed"]:
        raise GateRefused(
            "kernel-equivalence", f"{spec.backend} failed its equivalence gate; see {out}"
        )
    print(f"{spec.backend} passed its equivalence gate; receipt {out}")
    return 0


def receipts_dir() -> Path:
    """$ALIGN_KERNEL_RECEIPTS, else ~/.cache/align/kernels."""
    return Path(os.environ.get(RECEIPTS_ENV) or DEFAULT_RECEIPTS_DIR).expanduser()


def receipt_path(spec: GateSpec, key: dict[str, str], directory: Path | None = None) -> Path:
    """One receipt per backend and device, so a receipt from older software reads as stale."""
    device = re.sub(r"[^A-Za-z0-9]+", "_", key["device_name"]).strip("_") or "device"
    capability = key["cuda_capability"].replace(".", "")
    return (directory or receipts_dir()) / f"{spec.backend}-{device}-sm{capability}.json"


def seal_receipt(
    spec: GateSpec, key: dict[str, str], results: list[dict[str, Any]], seconds: float
) -> dict:
    """The receipt for per-shape `results` under `key`, with its contents hash."""
    body = {
        "schema_version": RECEIPT_SCHEMA,
        "backend": spec.backend,
        "key": key,
        "metric": spec.metric,
        "thresholds": spec.thresholds,
        "results": results,
        "passed": bool(results) and all(result["passed"] for result in results),
        "seconds": round(seconds, 3),
        "finished_at": now_iso(),
    }
    return {**body, "receipt_sha256": hash_json(body)}


def verify_receipt(spec: GateSpec, path: Path, key: dict[str, str]) -> dict[str, Any]:
    """The receipt at `path` if it is sealed, current for `key` and passed; else ValueError."""
    if not path.is_file():
        raise ValueError(
            f"{spec.backend} refused: no equivalence receipt at {path}; {spec.rerun()}"
        )
    try:
        receipt = read_json(path)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{spec.backend} refused: unreadable receipt {path} ({err}); {spec.rerun()}"
        ) from err
    _check_sealed(spec, receipt, path)
    _check_current(spec, receipt, path, key)
    _check_passed(spec, receipt, path)
    return receipt


def required_receipt(spec: GateSpec, key: dict[str, str]) -> dict[str, Any]:
    """The passed, current receipt under `key`: the workflow's (at $`spec.receipt_env`)
    where a stage runs in one, else the per-device one."""
    given = os.environ.get(spec.receipt_env)
    return verify_receipt(spec, Path(given) if given else receipt_path(spec, key), key)


def _check_sealed(spec: GateSpec, receipt: Any, path: Path) -> None:
    tampered = f"{spec.backend} refused: receipt {path} is tampered or corrupt"
    if not isinstance(receipt, dict):
        raise ValueError(f"{tampered} (not a JSON object)")
    body = {name: value for name, value in receipt.items() if name != "receipt_sha256"}
    if receipt.get("receipt_sha256") != hash_json(body):
        raise ValueError(f"{tampered} (its receipt_sha256 does not match its contents)")
    try:
        results = receipt["results"]
        verdicts = [within(result["errors"], result["thresholds"]) for result in results]
        consistent = receipt["passed"] == (bool(results) and all(verdicts)) and all(
            result["passed"] == verdict for result, verdict in zip(results, verdicts, strict=True)
        )
    except (KeyError, TypeError) as err:
        raise ValueError(f"{tampered} (malformed: {err!r})") from err
    if not consistent:
        raise ValueError(f"{tampered} (its verdicts disagree with its own errors and thresholds)")


def _check_current(spec: GateSpec, receipt: dict, path: Path, key: dict[str, str]) -> None:
    stale = []
    if receipt.get("schema_version") != RECEIPT_SCHEMA:
        stale.append(("receipt schema", RECEIPT_SCHEMA, receipt.get("schema_version")))
    recorded = receipt.get("key") or {}
    for component, label in spec.key_components.items():
        if recorded.get(component) != key[component]:
            stale.append((label, key[component], recorded.get(component)))
    grid = [shape.as_dict() for shape in spec.grid_for(key)]
    if [result.get("shape") for result in receipt.get("results", [])] != grid:
        stale.append(("equivalence grid", f"{len(grid)} pre-registered shapes", "another grid"))
    shape_thresholds = [
        result.get("thresholds") == spec.thresholds.get(result.get("shape", {}).get("dtype"))
        for result in receipt.get("results", [])
    ]
    if receipt.get("thresholds") != spec.thresholds or not all(shape_thresholds):
        stale.append(("thresholds", spec.thresholds, receipt.get("thresholds")))
    if stale:
        changes = "; ".join(
            f"{label} is {now!r} but the receipt has {then!r}" for label, now, then in stale
        )
        raise ValueError(
            f"{spec.backend} refused: receipt {path} is stale: {changes}; {spec.rerun()}"
        )


def _check_passed(spec: GateSpec, receipt: dict, path: Path) -> None:
    if receipt["passed"]:
        return
    failures = [
        f"{result['shape']}: {name} {result['errors'][name]:.3g} > {result['thresholds'][name]:.3g}"
        for result in receipt["results"]
        for name in over_threshold(result["errors"], result["thresholds"])
    ]
    raise ValueError(
        f"{spec.backend} refused: receipt {path} records a FAILED equivalence run: "
        + ("; ".join(failures[:3]) or "no shapes measured")
    )
