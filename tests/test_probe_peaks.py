"""The probe's memory figures on two gloo ranks whose peaks differ: the largest rank's device
peak is the job's, every rank's is recorded, the ratio to the projection uses the largest,
and the host peak is the sum of the ranks' phase peaks (align.train.phases)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from align.stages.dpo import rank_device_peaks
from align.train.phases import PhaseMeter, status_mb
from align.train.probes import Beside, probe_figures

PEAKS_MB = (100.0, 300.0)
PROJECTED_MB = 250.0
# Rank r touches (r + 1) x 64 MiB in its train phase, then frees it.
TOUCHED_MB = 64


def peaks_worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        meter = PhaseMeter("cpu")
        with meter.phase("load"):
            pass
        with meter.phase("train"):
            baseline = status_mb("VmRSS")
            block = np.ones((rank + 1) * TOUCHED_MB * 2**20, dtype=np.uint8)
            del block
        report = meter.report({"phases": {"train": {"total_mb": 1000.0, "terms_mb": {}}}})
        figures = probe_figures(
            [1.0, 0.5, 0.5],
            [10.0, 20.0, 20.0],
            6,
            [100] * 10,
            meter.job_host_peak_mb(),
            rank_device_peaks(PEAKS_MB[rank]),
            PROJECTED_MB,
        )
        with open(f"{out_dir}/rank{rank}.json", "w") as out:
            json.dump({"figures": figures, "phases": report, "baseline": baseline}, out)
    finally:
        dist.destroy_process_group()


def test_the_probe_records_the_largest_rank_peak_not_the_mean(tmp_path):
    mp.spawn(peaks_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        figures = record["figures"]
        assert figures["device_peaks_mb"] == list(PEAKS_MB)
        assert figures["peak_device_mb"] == max(PEAKS_MB)
        assert figures["device_measured_over_projected"] == max(PEAKS_MB) / PROJECTED_MB
        assert figures["peak_rss_mb"] == record["phases"]["train"]["host_peak_mb"]


def test_each_phase_peak_is_its_own_and_the_job_peak_sums_the_ranks(tmp_path):
    mp.spawn(peaks_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    train = records[0]["phases"]["train"]
    assert train == records[1]["phases"]["train"]
    for rank in range(2):
        # Each rank's train peak holds its block over where the phase began; its load
        # phase, before the block, does not.
        rise = train["rank_host_peak_mb"][rank] - records[rank]["baseline"]
        assert abs(rise - (rank + 1) * TOUCHED_MB) < 8
        load = records[0]["phases"]["load"]["rank_host_peak_mb"][rank]
        assert load < train["rank_host_peak_mb"][rank] - TOUCHED_MB / 2
    assert train["host_peak_mb"] == sum(train["rank_host_peak_mb"])
    assert train["projected_host_mb"] == 1000.0
    assert train["host_ratio"] == train["host_peak_mb"] / 1000.0
    assert "projected_host_mb" not in records[0]["phases"]["load"]


def test_off_cuda_the_probe_records_no_device_peak():
    figures = probe_figures([1.0, 0.5], [10.0, 20.0], 4, [100] * 10, 123.0, [], None)
    assert figures["peak_device_mb"] == 0.0
    assert figures["device_peaks_mb"] == []
    assert figures["device_measured_over_projected"] is None


def test_a_phase_does_not_inherit_the_heap_the_last_one_freed():
    """glibc keeps freed heap pages resident (the last block pins the heap's top); the next
    phase starts from what is live, not from what the last one touched."""
    baseline = status_mb("VmRSS")
    blocks = [np.ones(8000) for _ in range(4000)]  # 64 KB each, under mmap's threshold
    last = blocks[-1]
    del blocks
    assert status_mb("VmRSS") > baseline + 200  # freed, still resident
    meter = PhaseMeter("cpu")
    with meter.phase("evaluate"):
        pass
    assert meter.phases["evaluate"].host_start_mb < baseline + 20
    assert last.sum() == 8000


def test_the_projected_wall_counts_the_saves_and_generation_checks_a_run_makes():
    """10 optimizer steps, a save every 4 (after steps 4 and 8), a generation check before
    training and every 3 steps (3, 6, 9) and at the end (10): 2 saves, 5 checks."""
    beside = Beside(checkpoint_s=2.0, checkpoint_every=4, generation_s=3.0, generation_every=3)
    steps = [100] * 10
    figures = probe_figures([9.0, 1.0, 1.0], [10.0, 20.0, 20.0], 6, steps, 1.0, [], None, beside)
    assert (figures["checkpoint_saves"], figures["generation_checks"]) == (2, 5)
    assert figures["projected_steps_s"] == 10.0
    assert figures["projected_wall_s"] == 10.0 + 2 * 2.0 + 5 * 3.0
    unarmed = Beside(2.0, 0, None, 3)
    assert probe_figures([1.0], [1.0], 1, steps, 1.0, [], None, unarmed)["projected_wall_s"] == 10.0


def test_the_projected_steps_take_as_long_as_the_positions_they_compute():
    """Rows vary in length, so steps do: the measured steps' time per computed position
    (the first step's one-off costs left out) times every step's positions."""
    step_tokens = [500, 200, 400, 100, 800]
    figures = probe_figures([9.0, 2.0, 4.0], [1.0] * 3, 3, step_tokens, 1.0, [], None)
    assert figures["seconds_per_computed_token"] == 0.01
    assert figures["projected_steps_s"] == pytest.approx(0.01 * 2000)
    assert figures["horizon_steps"] == 5 and figures["horizon_computed_tokens"] == 2000
    # The median step alone would have projected 5 x 3 s.
    assert figures["median_step_s"] == 3.0
