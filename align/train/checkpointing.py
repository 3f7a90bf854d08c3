"""Training checkpoints under run_dir/checkpoints/micro_NNNNNNNN via torch.distributed.checkpoint.

A checkpoint is written under a `.partial` name by every rank, and only after all
ranks finished does rank 0 write COMPLETE and rename it into place, so a reader
never mistakes a torn one for valid. Trainer counters and the scheduler go in JSON,
each rank's RNG state in safetensors and each rank's own state (a stage's, such as its
tripwire windows) in JSON; nothing is pickled.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from align.exit_codes import NoSpaceLeft, writing
from align.log import stage_logger
from align.paths import checkpoints_in
from align.receipts import read_json, write_json_atomic
from align.utils.dist import DistInfo, barrier

NAME = re.compile(r"^micro_(\d{8})$")
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer_state.json"

LOG = stage_logger()


def _rng_file(rank: int) -> str:
    return f"rng_rank{rank:05d}.safetensors"


def _rank_state_file(rank: int) -> str:
    return f"state_rank{rank:05d}.json"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    micro_step: int


class CheckpointManager:
    def __init__(self, run_dir: str | Path, info: DistInfo, keep: int):
        if keep < 1:
            raise ValueError(f"trainer.keep_checkpoints must be >= 1, got {keep}")
        self.root = checkpoints_in(run_dir)
        self.info = info
        self.keep = keep
        # Seconds of each save and load on this rank, the figures a receipt reports.
        self.save_s: list[float] = []
        self.load_s: list[float] = []

    def valid(self) -> list[Checkpoint]:
        """Complete checkpoints, oldest first; torn ones are reported and skipped."""
        found = []
        if not self.root.is_dir():
            return found
        for path in sorted(self.root.iterdir()):
            match = NAME.match(path.name)
            if match and (path / COMPLETE).is_file() and (path / ".metadata").is_file():
                found.append(Checkpoint(path, int(match.group(1))))
            elif self.info.is_main and path.is_dir():
                LOG.warning(f"skipping torn checkpoint {path}")
        return found

    def latest(self) -> Checkpoint | None:
        valid = self.valid()
        return valid[-1] if valid else None

    def rotate_stale(self) -> Path | None:
        """A fresh run moves old checkpoints aside (rank 0 renames, every rank waits)."""
        moved = None
        if self.info.is_main and self.root.exists():
            moved = self.root.with_name(
                f"checkpoints.stale-{time.strftime('%Y%m%dT%H%M%S')}-{time.time_ns()}"
            )
            self.root.rename(moved)
            LOG.info(f"fresh run: moved stale checkpoints to {moved}")
        barrier()
        return moved

    def save(
        self,
        micro_step: int,
        model,
        optimizer,
        trainer_state: dict[str, Any],
        rank_state: dict[str, Any] | None = None,
    ) -> Checkpoint:
        """Every rank writes its shards, its RNG state and `rank_state` (if any)."""
        started = time.perf_counter()
        final = self.root / f"micro_{micro_step:08d}"
        partial = final.with_name(final.name + ".partial")
        if self.info.is_main:
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir(parents=True)
        barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        try:
            with writing(partial, _local_bytes([model_state, optim_state])):
                dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(partial))
                save_file(_rng_state(), str(partial / _rng_file(self.info.rank)))
                if rank_state is not None:
                    write_json_atomic(partial / _rank_state_file(self.info.rank), rank_state)
                if self.info.is_main:
                    write_json_atomic(partial / TRAINER_STATE, trainer_state)
        except NoSpaceLeft:
            # A torn checkpoint is never read; removing it gives its space back at once.
            shutil.rmtree(partial, ignore_errors=True)
            raise
        barrier()
        if self.info.is_main:
            self._mark_complete(partial, final, micro_step)
        barrier()
        self.save_s.append(time.perf_counter() - started)
        self.prune()
        return Checkpoint(final, micro_step)

    def _mark_complete(self, partial: Path, final: Path, micro_step: int) -> None:
        write_json_atomic(
            partial / COMPLETE, {"micro_step": micro_step, "world_size": self.info.world_size}
        )
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)

    def prune(self) -> None:
        """Keep the newest `keep` valid checkpoints; the newest valid one is never deleted."""
        if self.info.is_main:
            for old in self.valid()[: -self.keep]:
                shutil.rmtree(old.path)
        barrier()

    def load(self, checkpoint: Checkpoint, model, optimizer) -> dict[str, Any]:
        """Restore model, optimizer and this rank's RNG; return the trainer state."""
        started = time.perf_counter()
        state = read_json(checkpoint.path / TRAINER_STATE)
        if state["world_size"] != self.info.world_size:
            raise ValueError(
                f"{checkpoint.path}: written by world size {state['world_size']}, resuming with {self.info.world_size}"
            )
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(checkpoint.path))
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
        _set_rng_state(load_file(str(checkpoint.path / _rng_file(self.info.rank))))
        self.load_s.append(time.perf_counter() - started)
        return state

    def load_rank_state(self, checkpoint: Checkpoint) -> dict[str, Any]:
        """This rank's own state, as `save` was given it."""
        path = checkpoint.path / _rank_state_file(self.info.rank)
        if not path.is_file():
            raise ValueError(f"{path}: missing; this run resumes a rank state its checkpoint lacks")
        return read_json(path)


def _local_bytes(state: Any) -> int:
    """Bytes of this rank's tensors in a (nested) state dict: the shards it writes."""
    if isinstance(state, dict):
        return sum(_local_bytes(value) for value in state.values())
    if isinstance(state, list | tuple):
        return sum(_local_bytes(value) for value in state)
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    return 0


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
