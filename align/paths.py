"""Every path of a run, from (results_dir, arm): the Snakefile and the stage scripts share it.

Nothing else spells a results path, so a rule's output and the script that writes
it cannot drift apart. Receipts name files through `RunPaths.recorded` (relative to
the results directory when inside it) and readers find them through
`RunPaths.resolve` (against the results directory in use), so a results directory
that is copied or moved checks its own bytes. Imports nothing heavy.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from align.exit_codes import GateRefused

SPLITS = ("train", "held")
# The DPO stage's training runs: the first, and the one pre-registered rerun after an alarm.
FIRST_RUN, RERUN = "first", "rerun"
TRAINING_RUNS = (FIRST_RUN, RERUN)


def metrics_in(run_dir: str | Path) -> Path:
    """The training run's metrics, one JSON line per optimizer step."""
    return Path(run_dir) / "metrics.jsonl"


def checkpoints_in(run_dir: str | Path) -> Path:
    """Where a training run keeps its periodic and stop checkpoints."""
    return Path(run_dir) / "checkpoints"


def ended_run_in(run_dir: str | Path) -> Path:
    """Where a training run that a tripwire ended keeps its record, beside its checkpoints
    (so a fresh run moves it aside with them): a retry reads it instead of training again."""
    return checkpoints_in(run_dir) / "ended.json"


def trained_record_in(run_dir: str | Path) -> Path:
    """Where the DPO stage records what training decided once its policy is exported, beside
    the first run's checkpoints (so a fresh run moves it aside with them): a retry after a
    stop in evaluation reads it and evaluates the exported policy instead of training again."""
    return checkpoints_in(run_dir) / "trained.json"


def stop_marker_in(run_dir: str | Path) -> Path:
    """Where a training run that stopped cleanly (checkpoint saved) tells its launcher to
    exit 75, and its retry what it resumes after."""
    return Path(run_dir) / "stopped.json"


def _absolute(path: str | Path) -> Path:
    """Absolute and without `..`, symlinks left as they are (a moved run may be reached by one)."""
    return Path(os.path.abspath(path))


def external_locations(cfg: Any) -> list[str]:
    """What a config names outside the results directory: SFT checkpoint, base model, data files."""
    data = getattr(cfg, "data", None)
    named = [cfg.run.sft_checkpoint, cfg.run.base_model, *(data.files if data else [])]
    return [name for name in named if name]


@dataclass(frozen=True)
class RunPaths:
    """Paths shared by all arms: the SFT policy, its gate, the data manifest, the selection.

    `external` holds the absolute locations outside `results` that the run's
    configuration names: the only places a receipt may send a reader outside it.
    """

    results: Path
    external: tuple[str, ...] = ()

    @classmethod
    def of(cls, results_dir: str | Path, external: Iterable[str | Path] = ()) -> RunPaths:
        return cls(Path(results_dir), tuple(str(_absolute(p)) for p in external))

    @classmethod
    def of_config(cls, cfg: Any) -> RunPaths:
        """The paths of the run `cfg.run.results_dir`, with the external locations `cfg` names."""
        return cls.of(cfg.run.results_dir, external_locations(cfg))

    def recorded(self, path: str | Path) -> str:
        """How a receipt names `path`: relative to the results directory inside it, else absolute."""
        full, root = _absolute(path), _absolute(self.results)
        return full.relative_to(root).as_posix() if full.is_relative_to(root) else str(full)

    def resolve(self, name: str, gate: str, receipt: str | Path) -> Path:
        """The file that `receipt` names `name`, against the results directory in use.

        Refused (exit 3, gate `gate`) when it lies outside the results directory and
        outside every location the configuration names: a receipt of a moved run must
        not send the gates to the bytes of another.
        """
        root = _absolute(self.results)
        full = _absolute(root / name)
        if full.is_relative_to(root) or any(_covers(place, full) for place in self.external):
            return full
        raise GateRefused(
            gate,
            f"{receipt}: names {name!r}, which resolves to {full}, outside the results "
            f"directory {root} and every location the configuration names "
            "(run.sft_checkpoint, run.base_model, data.files)",
        )

    @property
    def sft_dir(self) -> Path:
        return self.results / "sft"

    @property
    def sft_checkpoint(self) -> Path:
        return self.sft_dir / "checkpoint"

    @property
    def sft_receipt(self) -> Path:
        return self.sft_dir / "sft.json"

    @property
    def sft_run_dir(self) -> Path:
        return self.sft_dir / "run"

    @property
    def sft_stop_marker(self) -> Path:
        return stop_marker_in(self.sft_run_dir)

    @property
    def sft_gate_run_dir(self) -> Path:
        """Where the SFT gate's evaluation runs (its generations and held-out NLL)."""
        return self.sft_dir / "gate_run"

    @property
    def sft_gate(self) -> Path:
        return self.sft_dir / "gate.json"

    @property
    def data_dir(self) -> Path:
        return self.results / "data"

    @property
    def manifest(self) -> Path:
        return self.data_dir / "manifest.json"

    @property
    def selection(self) -> Path:
        return self.results / "selection.json"

    def kernel_receipt(self, backend: str) -> Path:
        """The equivalence receipt of a gated attention backend (constants.GATED_ATTENTION)
        that the kernel_gate rule writes for this run."""
        return self.results / "kernels" / f"{backend}.json"

    def log(self, rule: str, name: str = "all") -> Path:
        return self.results / "logs" / rule / f"{name}.log"

    def benchmark(self, rule: str, name: str = "all") -> Path:
        return self.results / "benchmarks" / rule / f"{name}.tsv"

    def arm(self, arm: str) -> ArmPaths:
        return ArmPaths(self.results, arm)


@dataclass(frozen=True)
class ArmPaths:
    """Paths of one arm under results/<arm>/ and its data under results/data/<arm>/."""

    results: Path
    arm: str

    @property
    def root(self) -> Path:
        return self.results / self.arm

    def shard_dir(self, split: str) -> Path:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.results / "data" / self.arm / split

    def shard(self, split: str) -> Path:
        return self.shard_dir(split) / "pairs.safetensors"

    def shard_receipt(self, split: str) -> Path:
        return self.shard_dir(split) / "receipt.json"

    def ref_dir(self, forward_impl: str) -> Path:
        return self.root / "ref" / forward_impl

    def ref_cache(self, forward_impl: str, split: str) -> Path:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self.ref_dir(forward_impl) / f"{split}.safetensors"

    def ref_receipt(self, forward_impl: str) -> Path:
        return self.ref_dir(forward_impl) / "receipt.json"

    @property
    def path_bias(self) -> Path:
        return self.root / "path_bias.json"

    @property
    def preflight(self) -> Path:
        return self.root / "preflight.json"

    @property
    def probe(self) -> Path:
        return self.root / "probe.json"

    @property
    def arm_result(self) -> Path:
        return self.root / "arm_result.json"

    @property
    def policy_dir(self) -> Path:
        return self.root / "policy"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    @property
    def probe_run_dir(self) -> Path:
        """Where the probe's micro-steps run; nothing of it outlives the probe receipt."""
        return self.root / "probe_run"

    @property
    def stop_marker(self) -> Path:
        """The dpo stage's one marker, whichever of its runs stopped."""
        return stop_marker_in(self.run_dir)

    @property
    def metrics(self) -> Path:
        return metrics_in(self.run_dir)

    def training_run_dir(self, run: str) -> Path:
        """The DPO stage's first run trains in run_dir, its one pre-registered rerun under it."""
        if run not in TRAINING_RUNS:
            raise ValueError(f"training run must be one of {TRAINING_RUNS}, got {run!r}")
        return self.run_dir if run == FIRST_RUN else self.run_dir / RERUN

    def training_run_metrics(self, run: str) -> Path:
        return self.training_run_dir(run) / self.metrics.name


@dataclass(frozen=True)
class SelectionPaths:
    """The selection's working files beside selection.json: the eval set and the run dir."""

    root: Path

    @classmethod
    def of(cls, paths: RunPaths) -> SelectionPaths:
        return cls(paths.selection.with_suffix(""))

    @property
    def eval_set(self) -> Path:
        return self.root / "eval_pairs.safetensors"

    @property
    def run_dir(self) -> Path:
        return self.root / "run"


ARM_FIGURES = ("training", "tripwires", "probe")
RUN_FIGURES = ("held_out", "paired")


@dataclass(frozen=True)
class ReportPaths:
    """The report's figures and summary page under results/report/."""

    root: Path

    @classmethod
    def of(cls, paths: RunPaths) -> ReportPaths:
        return cls(paths.results / "report")

    def arm_figure(self, arm: str, name: str) -> Path:
        if name not in ARM_FIGURES:
            raise ValueError(f"arm figure must be one of {ARM_FIGURES}, got {name!r}")
        return self.root / arm / f"{name}.png"

    def run_figure(self, name: str) -> Path:
        if name not in RUN_FIGURES:
            raise ValueError(f"run figure must be one of {RUN_FIGURES}, got {name!r}")
        return self.root / f"{name}.png"

    @property
    def summary_html(self) -> Path:
        return self.root / "summary.html"


def _covers(place: str, path: Path) -> bool:
    """`path` is the named location, lies inside it, or matches it as a glob (data.files)."""
    return path.is_relative_to(place) or fnmatchcase(str(path), place)
