"""Every path of a run, from (results_dir, arm): the Snakefile and the stage scripts share it.

Nothing else spells a results path, so a rule's output and the script that writes
it cannot drift apart. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SPLITS = ("train", "held")
# The DPO stage's training runs: the first, and the one pre-registered rerun after an alarm.
FIRST_RUN, RERUN = "first", "rerun"
TRAINING_RUNS = (FIRST_RUN, RERUN)


@dataclass(frozen=True)
class RunPaths:
    """Paths shared by all arms: the SFT policy, its gate, the data manifest, the selection."""

    results: Path

    @classmethod
    def of(cls, results_dir: str | Path) -> RunPaths:
        return cls(Path(results_dir))

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
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def training_run_dir(self, run: str) -> Path:
        """The DPO stage's first run trains in run_dir, its one pre-registered rerun under it."""
        if run not in TRAINING_RUNS:
            raise ValueError(f"training run must be one of {TRAINING_RUNS}, got {run!r}")
        return self.run_dir if run == FIRST_RUN else self.run_dir / RERUN

    def training_run_metrics(self, run: str) -> Path:
        return self.training_run_dir(run) / self.metrics.name
