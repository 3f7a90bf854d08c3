"""The resumable, multi-rank reference precompute (align.stages.ref_precompute).

A precompute SIGKILLed after some slices and restarted under the same key, and one
run on two gloo ranks, both write the cache byte for byte as one uninterrupted
process does; part files of another key or layout are discarded, naming why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import stand_in_cache_key
from tiny_pairs import write_tiny_pairs

from align.config import RefConfig, RunConfig
from align.data.deal import slice_rows
from align.exit_codes import AlignError
from align.stages.ref_precompute import (
    merge_parts,
    precompute_ref_caches,
    reusable_parts,
    slice_size,
)
from align.train.ref_cache import (
    CacheKey,
    expected_key,
    load_ref_cache,
    part_path,
    parts_dir,
    write_cache_part,
)

torch.set_num_threads(1)
DRIVER = Path(__file__).parent / "drivers" / "precompute_tiny.py"
N_PAIRS, SEQ, BATCH, SLICE = 40, 14, 4, 8  # five slices of two batches
OVERRIDES = [
    f"--ref.batch_size={BATCH}",
    f"--ref.slice_pairs={SLICE}",
    f"--data.seq_len={SEQ}",
    "--run.threads=1",
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("precompute")
    write_tiny_pairs(work, N_PAIRS, SEQ)
    return work


def cache_key(work: Path) -> CacheKey:
    return expected_key(
        work / "base",
        work / "pairs.safetensors",
        SEQ,
        "prompt_left_response_right",
        "float32",
        f"sdpa-fp32-b{BATCH}-padded",
    )


@pytest.fixture(scope="module")
def uninterrupted(workdir) -> bytes:
    """The cache of one process that ran to the end, built in this process."""
    out = workdir / "whole" / "train.safetensors"
    figures, _ = precompute_ref_caches(
        workdir / "base",
        [(str(workdir / "pairs.safetensors"), out, cache_key(workdir))],
        RefConfig(batch_size=BATCH, slice_pairs=SLICE),
        RunConfig(threads=1),
        workdir / "whole",
    )
    assert figures["train"]["slices"] == 5 and figures["train"]["reused_slices"] == 0
    assert not parts_dir(out).exists()
    return out.read_bytes()


def precompute(work: Path, out: Path, *extra: str, world: int = 1) -> subprocess.CompletedProcess:
    args = [str(DRIVER), str(work), str(out), *OVERRIDES, *extra]
    launch = ["-m", "align.launch", f"--nproc={world}"] if world > 1 else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *launch, *args], capture_output=True, text=True, timeout=300, env=env
    )


def figures_of(run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_killed_precompute_resumes_to_the_same_bytes(workdir, uninterrupted):
    out = workdir / "killed" / "train.safetensors"
    killed = precompute(workdir, out, "--kill-after-parts=2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not out.exists()
    assert sorted(p.name for p in parts_dir(out).iterdir()) == [
        "slice-000000.safetensors",
        "slice-000001.safetensors",
    ]
    resumed = precompute(workdir, out)
    figures = figures_of(resumed)
    assert (figures["reused_slices"], figures["computed_slices"]) == (2, 3), figures
    assert "5 slices, 2 reused" in resumed.stderr
    assert figures["computed_tokens"] < figures["tokens"]
    assert out.read_bytes() == uninterrupted
    assert not parts_dir(out).exists()


def test_two_ranks_build_the_same_bytes_as_one(workdir, uninterrupted):
    out = workdir / "two" / "train.safetensors"
    figures = figures_of(precompute(workdir, out, world=2))
    assert figures["world_size"] == 2 and figures["computed_slices"] == 5, figures
    assert figures["tokens_per_s"] > 0
    assert out.read_bytes() == uninterrupted
    assert not parts_dir(out).exists()


# --- part files, without a model ------------------------------------------------------

IDS = np.array([7, 3, 9, 1, 4], dtype=np.int64)
KEY = stand_in_cache_key("sdpa-fp32-b2-padded")
BOUNDS = slice_rows(len(IDS), 2)  # [0, 2), [2, 4), [4, 5)


def write_part(parts: Path, index: int, key: CacheKey = KEY, rows=None) -> Path:
    start, stop = rows or BOUNDS[index]
    values = -np.arange(start, stop, dtype=np.float32)
    return write_cache_part(
        parts, index, (start, stop, len(IDS)), IDS[start:stop], values, values - 10, key
    )


def test_slices_hold_whole_batches_and_cover_every_row_once():
    assert slice_size(RefConfig(batch_size=16, slice_pairs=100)) == 112
    assert slice_size(RefConfig(batch_size=4, slice_pairs=8)) == 8
    bounds = slice_rows(250, 112)
    assert bounds == [(0, 112), (112, 224), (224, 250)]
    assert slice_rows(0, 112) == []


def test_valid_parts_are_reused(tmp_path):
    parts = tmp_path / "train.safetensors.parts"
    for index in (0, 2):
        write_part(parts, index)
    assert reusable_parts(parts, BOUNDS, IDS, KEY) == ([0, 2], [])
    assert reusable_parts(tmp_path / "absent", BOUNDS, IDS, KEY) == ([], [])


@pytest.mark.parametrize("component", ["checkpoint_weights", "dtype", "forward_impl"])
def test_a_part_under_another_key_is_discarded_naming_the_component(tmp_path, component):
    parts = tmp_path / "parts"
    write_part(parts, 0)
    stale = write_part(parts, 1, key=dataclasses.replace(KEY, **{component: "other"}))
    reused, discarded = reusable_parts(parts, BOUNDS, IDS, KEY)
    assert reused == [0]
    (line,) = discarded
    assert str(stale) in line and f"key component {component!r}" in line
    assert repr(getattr(KEY, component)) in line and "'other'" in line
    assert not stale.exists()


def test_a_part_of_another_slice_layout_is_discarded(tmp_path):
    parts = tmp_path / "parts"
    write_part(parts, 1, rows=(3, 5))
    reused, (line,) = reusable_parts(parts, BOUNDS, IDS, KEY)
    assert reused == [] and "slice layout expected" in line


def test_a_part_of_other_pairs_is_discarded(tmp_path):
    parts = tmp_path / "parts"
    write_part(parts, 0)
    reused, (line,) = reusable_parts(parts, BOUNDS, IDS[::-1].copy(), KEY)
    assert reused == [] and "pair ids differ" in line


def test_unfinished_writes_and_damaged_parts_are_discarded(tmp_path):
    parts = tmp_path / "parts"
    good = write_part(parts, 0)
    torn = parts / ".slice-000001.safetensors.abc123.tmp"
    torn.write_bytes(b"half a file")
    damaged = write_part(parts, 2)
    damaged.write_bytes(damaged.read_bytes()[:40])
    reused, discarded = reusable_parts(parts, BOUNDS, IDS, KEY)
    assert reused == [0]
    assert any(str(torn) in line and "unfinished write" in line for line in discarded)
    assert any(str(damaged) in line and "unreadable" in line for line in discarded)
    assert sorted(parts.iterdir()) == [good]


def test_merge_orders_by_pair_id_and_removes_the_parts(tmp_path):
    parts = tmp_path / "train.safetensors.parts"
    for index in range(len(BOUNDS)):
        write_part(parts, index)
    out = tmp_path / "train.safetensors"
    merge_parts(parts, out, BOUNDS, IDS, KEY)
    assert not parts.exists()
    chosen, rejected = load_ref_cache(out, KEY, np.array([1, 3, 4, 7, 9]))
    # Row r holds -r: ids 1, 3, 4, 7, 9 sit at rows 3, 1, 4, 0, 2.
    assert chosen.tolist() == [-3.0, -1.0, -4.0, -0.0, -2.0]
    assert rejected.tolist() == [-13.0, -11.0, -14.0, -10.0, -12.0]


def test_merge_refuses_a_part_that_no_longer_matches(tmp_path):
    parts = tmp_path / "parts"
    for index in range(len(BOUNDS)):
        write_part(parts, index)
    write_part(parts, 1, key=dataclasses.replace(KEY, shard="changed"))
    with pytest.raises(AlignError, match="slice 1 changed while merging: key component 'shard'"):
        merge_parts(parts, tmp_path / "train.safetensors", BOUNDS, IDS, KEY)
    assert part_path(parts, 0).exists()
