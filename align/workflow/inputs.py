"""The files a rule reads, decided from its pre-registration (the rules' input functions
call these with their config)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from align.paths import RunPaths
from align.stages.select import UNION


def selection_shards(eval_set: str, paths: RunPaths, arms: Iterable[str]) -> dict[str, Path | str]:
    """The pair shards selection's eval set is built from: each arm's held-out shard for the
    union of the arms' held pairs, else the one file `paired.eval_set` names."""
    if eval_set == UNION:
        return {arm: paths.arm(arm).shard("held") for arm in arms}
    return {"eval_set": eval_set}
