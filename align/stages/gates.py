"""Gates the arm stages re-check before loading a model (no torch).

Each gate reads a receipt, verifies what it depends on, and raises `GateRefused`
naming the gate, the file and the expected vs found value. The files a receipt
names are resolved against the results directory in use (`RunPaths.resolve`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.config import ArmConfig, pinned_data_config
from align.data.manifest import Manifest
from align.exit_codes import GateRefused, PreflightRefused
from align.log import stage_logger
from align.model.checkpoint_files import NotACheckpoint, checkpoint_files
from align.model.tokenizer_hash import tokenizer_hash
from align.paths import SPLITS, RunPaths
from align.receipts import DESCOPED, FAILED, PASSED, load_receipt, verify_hash
from align.stages.sft_gate_result import SftGateResult
from align.train.memory import (
    MemoryVerdict,
    check_stage_rss,
)
from align.train.path_bias import RECOMPUTE, PathBias, TrainingPath
from align.train.probes import ProbeReceipt
from align.train.ref_cache import (
    TENSORS_HASH,
    CacheKey,
    check_key,
    check_tensors,
    expected_key,
    ref_forward_impl,
)
from align.utils.weights_hash import weights_fingerprint, weights_hash

LOG = stage_logger("gates")


@dataclass(frozen=True)
class SftPolicy:
    """The SFT checkpoint the quality gate passed, and the weight identity it recorded."""

    checkpoint: Path
    # None where the receipt records none; trusted_checkpoint_hash refuses it then.
    weights_hash: str | None
    # Sizes and times of the weight files when hashed: unchanged files need no new hash.
    fingerprint: dict[str, list[int]] | None


@dataclass(frozen=True)
class ArmEntry:
    """An arm's manifest entry once the manifest gate passed it: shards resolved and verified."""

    status: str
    reason: str | None
    counts: dict[str, int]
    shards: dict[str, Path]
    pins: dict[str, Any]


@dataclass(frozen=True)
class CacheInUse:
    """A reference cache the gates checked (key, then tensor bytes) for one split."""

    path: Path
    key: CacheKey


def sft_gate(paths: RunPaths) -> SftPolicy:
    """The SFT quality receipt passed; its checkpoint (the one to use) resolved."""
    gate = SftGateResult.of(load_receipt(paths.sft_gate, "sft_gate", stage="sft_gate"))
    if gate.status != PASSED or gate.passed is not True:
        raise GateRefused(
            "sft_gate", f"{paths.sft_gate}: expected passed=true, found {gate.passed!r}"
        )
    if not isinstance(gate.checkpoint, str):
        raise GateRefused(
            "sft_gate", f"{paths.sft_gate}: expected a checkpoint path, found {gate.checkpoint!r}"
        )
    checkpoint = paths.resolve(gate.checkpoint, "sft_gate", paths.sft_gate)
    if not checkpoint.is_dir():
        raise GateRefused("sft_gate", f"{paths.sft_gate}: checkpoint {checkpoint} does not exist")
    return SftPolicy(checkpoint, gate.checkpoint_hash, gate.checkpoint_fingerprint)


def require_checkpoint(gate: str, directory: str | Path) -> None:
    """Refuse (exit 3) a checkpoint directory that lacks its weights, a shard or a tokenizer
    file, naming what is missing, before a stage loads it."""
    try:
        checkpoint_files(directory)
    except NotACheckpoint as err:
        raise GateRefused(gate, str(err)) from err


def manifest_entry(paths: RunPaths, cfg: ArmConfig, checkpoint: str | Path) -> ArmEntry:
    """The arm's manifest entry, refused unless its counts and pins equal the pre-registration.

    Compared: the train / held counts with data.expected_*_pairs (which must be fixed),
    every `[data]` choice that shapes the shards (format, seq_len, truncation, filters, ...), the
    tokenizer hash with that of the SFT checkpoint `checkpoint`, and each shard's hash.
    The entry is returned with its shard paths resolved.
    """
    manifest = Manifest.of(
        load_receipt(paths.manifest, "manifest", stage="build_manifest"), paths.manifest
    )
    if cfg.arm not in manifest.arms:
        raise GateRefused(
            "manifest", f"{paths.manifest}: arm {cfg.arm!r} absent (found {sorted(manifest.arms)})"
        )
    entry = manifest.arms[cfg.arm]
    where = f"{paths.manifest}: arm {cfg.arm}"

    def refuse_unless(thing: str, want: Any, found: Any, remedy: str = "") -> None:
        if found != want:
            raise GateRefused(
                "manifest", f"{where} {thing} expected {want!r}, found {found!r}{remedy}"
            )

    toml = entry.config_source or f"config/arms/{cfg.arm}.toml"
    count_remedy = (
        f"; `align preregister {toml}` prints the counts this data gives, and with "
        "--write fixes them in the pre-registration"
    )
    expected = {"train": cfg.data.expected_train_pairs, "held": cfg.data.expected_held_pairs}
    for split in SPLITS:
        if expected[split] is None:
            raise GateRefused(
                "manifest",
                f"{where}: data.expected_{split}_pairs is not pre-registered (this build "
                f"gives {entry.counts[split]}){count_remedy}",
            )
        refuse_unless(
            f"{split} pairs (data.expected_{split}_pairs)",
            expected[split],
            entry.counts[split],
            count_remedy,
        )
    for key in ("format", "seq_len", "truncation", "max_prompt_tokens"):
        refuse_unless(f"data.{key}", getattr(cfg.data, key), getattr(entry, key))
    recorded = _flat(entry.data_config, "data.")
    for key, want in _flat(pinned_data_config(cfg.data), "data.").items():
        refuse_unless(key, want, recorded.get(key, "absent"))
    refuse_unless(
        f"tokenizer hash (of the SFT checkpoint {checkpoint})",
        tokenizer_hash(checkpoint),
        manifest.pins.get("tokenizer_hash"),
    )
    shards = {}
    for split in SPLITS:
        shard = entry.shards[split]
        shards[split] = paths.resolve(shard.path, "manifest", paths.manifest)
        verify_hash("manifest", shards[split], shard.hash)
    return ArmEntry(entry.status, entry.reason, entry.counts, shards, manifest.pins)


def _flat(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


class OfArm:
    """The arm's paths, for anything that holds its config and run paths."""

    @property
    def arm(self):
        return self.paths.arm(self.cfg.arm)


@dataclass
class GateWork(OfArm):
    """What the gates establish, filled in GATE_ORDER: each gate reads only what the gates
    before it set. Stages get a frozen `Gated` of it (`run_gates`), never this."""

    cfg: ArmConfig
    paths: RunPaths
    checkpoint: Path | None = None
    checkpoint_weights: str = ""
    entry: ArmEntry | None = None
    caches: dict[str, CacheInUse] = field(default_factory=dict)
    path_bias: PathBias | None = None
    projection: MemoryVerdict | None = None
    probe: ProbeReceipt | None = None

    @property
    def descoped(self) -> bool:
        return self.entry is not None and self.entry.status == DESCOPED

    def cache_key(self, split: str, forward_impl: str, dtype: str) -> CacheKey:
        data = self.cfg.data
        return expected_key(
            self.checkpoint,
            self.entry.shards[split],
            data.seq_len,
            data.truncation,
            dtype,
            forward_impl,
            checkpoint_weights=self.checkpoint_weights,
        )


def trusted_checkpoint_hash(policy: SftPolicy) -> str:
    """The gate receipt's weight hash while the weight files are unchanged; else hash again."""
    checkpoint, recorded = policy.checkpoint, policy.weights_hash
    if not isinstance(recorded, str):
        raise GateRefused(
            "sft_gate", f"sft/gate.json: expected checkpoint_hash, found {recorded!r}"
        )
    require_checkpoint("sft_gate", checkpoint)
    if policy.fingerprint == weights_fingerprint(checkpoint):
        return recorded
    found = weights_hash(checkpoint)
    if found != recorded:
        raise GateRefused(
            "sft_gate",
            f"{checkpoint}: weights hash expected {recorded[:12]} (sft/gate.json), found {found[:12]}",
        )
    return found


def _gate_sft(ctx: GateWork) -> dict[str, Any]:
    policy = sft_gate(ctx.paths)
    ctx.checkpoint = policy.checkpoint
    ctx.checkpoint_weights = trusted_checkpoint_hash(policy)
    return {
        "checkpoint": ctx.paths.recorded(ctx.checkpoint),
        "weights": ctx.checkpoint_weights[:12],
    }


def _gate_manifest(ctx: GateWork) -> dict[str, Any]:
    ctx.entry = manifest_entry(ctx.paths, ctx.cfg, ctx.checkpoint)
    counts = ctx.entry.counts
    return {"status": ctx.entry.status, "train": counts["train"], "held": counts["held"]}


def use_caches(ctx: GateWork, impl: str, dtype: str, gate: str) -> None:
    """Check the caches of forward path `impl` (key, then tensor bytes) and make them the ones in use."""
    for split in SPLITS:
        key = ctx.cache_key(split, impl, dtype)
        check_key(ctx.arm.ref_cache(impl, split), key, gate=gate)
        ctx.caches[split] = CacheInUse(ctx.arm.ref_cache(impl, split), key)
    path = ctx.arm.ref_receipt(impl)
    receipt = load_receipt(path, gate, stage="ref_cache")
    for split in SPLITS:
        recorded = receipt.get("caches", {}).get(split, {}).get(TENSORS_HASH)
        if not isinstance(recorded, str):
            raise GateRefused(
                gate, f"{path}: expected caches.{split}.{TENSORS_HASH}, found {recorded!r}"
            )
        check_tensors(ctx.arm.ref_cache(impl, split), recorded, path, gate)


def _gate_ref_cache(ctx: GateWork) -> dict[str, Any]:
    impl = ref_forward_impl(ctx.cfg.ref)
    use_caches(ctx, impl, ctx.cfg.ref.dtype, "ref_cache")
    return {"forward_impl": impl}


def _gate_path_bias(ctx: GateWork) -> dict[str, Any]:
    bias = PathBias.of(load_receipt(ctx.arm.path_bias, "path_bias", stage="path_bias"))
    cache_impl = ctx.caches["train"].key.forward_impl
    if bias.cache_forward_impl != cache_impl:
        raise GateRefused(
            "path_bias",
            f"{ctx.arm.path_bias}: measured against cache {bias.cache_forward_impl!r}, "
            f"expected {cache_impl!r}",
        )
    require_measured_path(
        "path_bias", ctx.arm.path_bias, bias.training_path, TrainingPath.of(ctx.cfg)
    )
    settings = dataclasses.asdict(ctx.cfg.path_bias)
    if bias.settings != settings:
        raise GateRefused(
            "path_bias",
            f"{ctx.arm.path_bias}: measured under path_bias settings {bias.settings}, "
            f"this run pre-registers {settings}",
        )
    impl = bias.required_forward_impl
    if bias.action == RECOMPUTE:
        use_caches(ctx, impl, ctx.cfg.model.dtype, "path_bias")
    ctx.path_bias = bias
    return {"action": bias.action, "ratio": round(bias.ratio, 4), "cache": impl}


def require_measured_path(
    gate: str, receipt: Path, recorded: dict[str, Any] | None, wanted: TrainingPath
) -> None:
    """Refuse a run whose training path is not the one the receipt measured, naming both."""
    if recorded != wanted.as_dict():
        raise GateRefused(
            gate,
            f"{receipt}: measured the training path {recorded}, this run trains through "
            f"{wanted.as_dict()}",
        )


def _gate_preflight(ctx: GateWork) -> dict[str, Any]:
    cfg = ctx.cfg
    master_updates = check_master_updates(cfg, ctx.checkpoint)
    shards = {split: ctx.entry.shards[split] for split in SPLITS}
    # The dpo job's memory on its fullest node, and on each device under CUDA.
    projection = check_stage_rss("dpo", cfg, ctx.checkpoint, shards)
    projection["master_updates"] = master_updates
    ctx.projection = MemoryVerdict.of(projection)
    shown = {
        "projected_mb": round(projection["total_mb"]),
        "available_mb": round(projection["available_mb"]),
    }
    if "device" in projection:
        device = projection["device"]
        shown.update(
            device_projected_mb=round(device["total_mb"]), device_mb=round(device["device_mb"])
        )
    return shown


def check_master_updates(cfg: ArmConfig, checkpoint: str | Path) -> dict[str, Any]:
    """Refuse (exit 6) a low-precision master dtype whose weights one step at optimizer.lr
    would mostly leave unchanged; float32 masters pass without a measurement."""
    dtype, lr = cfg.model.master_dtype, cfg.optimizer.lr
    if dtype == "float32":
        return {"master_dtype": dtype}
    from align.train.representability import moved_fraction, sample_weights

    weights = sample_weights(checkpoint)
    fraction = moved_fraction(weights, lr, dtype)
    minimum = cfg.preflight.min_moved_fraction
    if fraction < minimum:
        raise PreflightRefused(
            f"model.master_dtype = {dtype!r} at optimizer.lr = {lr:g}: one step would move "
            f"{fraction:.2%} of the master elements (measured on {weights.size} weights of "
            f"{checkpoint}), under preflight.min_moved_fraction = {minimum:g}; keep "
            "master_dtype = 'float32' (compute can stay in model.dtype)"
        )
    return {
        "master_dtype": dtype,
        "lr": lr,
        "moved_fraction": fraction,
        "sampled": int(weights.size),
    }


def _gate_probe(ctx: GateWork) -> dict[str, Any]:
    probe = ProbeReceipt.of(load_receipt(ctx.arm.probe, "probe", stage="probe"))
    b = ctx.cfg.batch
    measured_on = probe.topology
    expected = {
        "world_size": b.world_size,
        "micro_batch": b.micro_batch,
        "grad_accum": b.grad_accum,
    }
    if measured_on != expected:
        raise GateRefused(
            "probe", f"{ctx.arm.probe}: measured on topology {measured_on}, expected {expected}"
        )
    require_measured_path("probe", ctx.arm.probe, probe.training_path, TrainingPath.of(ctx.cfg))
    projected, measured = ctx.projection.total_mb, probe.peak_rss_mb
    tolerance = ctx.cfg.preflight.calibration_tolerance
    if projected < (1 - tolerance) * measured:
        raise GateRefused(
            "probe",
            f"{ctx.arm.probe}: failed calibration: projected RSS {projected:.0f} MiB undershoots the measured "
            f"peak {measured:.0f} MiB by more than {tolerance:.0%}",
        )
    ctx.probe = probe
    return {"median_step_s": round(probe.median_step_s, 4), "peak_rss_mb": round(measured)}


GATE_ORDER: tuple[tuple[str, Callable[[GateWork], dict[str, Any]]], ...] = (
    ("sft_gate", _gate_sft),
    ("manifest", _gate_manifest),
    ("ref_cache", _gate_ref_cache),
    ("path_bias", _gate_path_bias),
    ("preflight", _gate_preflight),
    ("probe", _gate_probe),
)
GATE_NAMES = tuple(name for name, _ in GATE_ORDER)


@dataclass(frozen=True)
class GateRow:
    """One gate that ran: PASSED with its figures, or FAILED with the reason."""

    gate: str
    status: str
    ms: float
    figures: dict[str, Any]


@dataclass
class GateReport:
    """Each gate that ran, in the order they ran."""

    rows: list[GateRow] = field(default_factory=list)

    def run(self, name: str, gate, *args, figures=lambda result: result):
        """`gate(*args)`, timed; a refusal is recorded, printed with the table and raised."""
        started = time.perf_counter()
        try:
            result = gate(*args)
        except GateRefused as err:
            self.rows.append(GateRow(name, FAILED, _ms(started), {"reason": str(err)}))
            LOG.error("\n%s", self.table())
            raise
        self.rows.append(GateRow(name, PASSED, _ms(started), figures(result)))
        return result

    def recorded(self) -> list[dict[str, Any]]:
        """The rows as a receipt's `gates` records them."""
        return [dataclasses.asdict(row) for row in self.rows]

    def table(self) -> str:
        lines = [f"  {'gate':<10} {'status':<8} {'ms':>8}  figures"]
        for r in self.rows:
            figures = ", ".join(f"{k}={v}" for k, v in r.figures.items())
            lines.append(f"  {r.gate:<10} {r.status:<8} {r.ms:>8.2f}  {figures}")
        return "\n".join(lines)


@dataclass(frozen=True)
class Gated(OfArm):
    """What the gates through preflight established for the stage after them. Nothing in
    it is missing: a run whose gates refused gets none."""

    cfg: ArmConfig
    paths: RunPaths
    checkpoint: Path
    checkpoint_weights: str
    entry: ArmEntry
    caches: dict[str, CacheInUse]
    path_bias: PathBias
    projection: MemoryVerdict


@dataclass(frozen=True)
class Probed(Gated):
    """... and the probe's measurement: what the dpo stage trains under."""

    probe: ProbeReceipt


@dataclass(frozen=True)
class Descoped(OfArm):
    """An arm the manifest descoped: there is nothing to check beyond it, nor to train."""

    cfg: ArmConfig
    paths: RunPaths
    entry: ArmEntry


# The gates a stage may run through, and what each gives it.
GATED_THROUGH = {"preflight": Gated, "probe": Probed}


def run_gates(cfg: ArmConfig, paths: RunPaths, through: str) -> tuple[GateReport, Gated | Descoped]:
    """Run GATE_ORDER up to and including `through` (preflight or probe); a refusal stops
    everything after it. A descoped arm stops after the manifest gate."""
    if through not in GATED_THROUGH:
        raise ValueError(f"gates run through one of {sorted(GATED_THROUGH)}, not {through!r}")
    work, report = GateWork(cfg, paths), GateReport()
    for name, gate in GATE_ORDER:
        report.run(name, gate, work)
        if name == "manifest" and work.descoped:
            return report, Descoped(cfg, paths, work.entry)
        if name == through:
            break
    found = {f.name: getattr(work, f.name) for f in dataclasses.fields(GATED_THROUGH[through])}
    return report, GATED_THROUGH[through](**found)


def _ms(started: float) -> float:
    return round(1e3 * (time.perf_counter() - started), 2)
