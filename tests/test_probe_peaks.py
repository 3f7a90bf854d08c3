"""The probe's memory figures on two gloo ranks whose device peaks differ: the largest rank's
peak is the job's, every rank's is recorded, and the ratio to the projection uses the largest."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from align.stages.dpo import job_peaks
from align.train.probes import probe_figures

PEAKS_MB = (100.0, 300.0)
PROJECTED_MB = 250.0


def peaks_worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        rss, device = job_peaks(PEAKS_MB[rank])
        figures = probe_figures(
            [1.0, 0.5, 0.5], [10.0, 20.0, 20.0], 6, 10, rss, device, PROJECTED_MB
        )
        with open(f"{out_dir}/rank{rank}.json", "w") as out:
            json.dump(figures, out)
    finally:
        dist.destroy_process_group()


def test_the_probe_records_the_largest_rank_peak_not_the_mean(tmp_path):
    mp.spawn(peaks_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    for rank in range(2):
        figures = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert figures["device_peaks_mb"] == list(PEAKS_MB)
        assert figures["peak_device_mb"] == max(PEAKS_MB)
        assert figures["device_measured_over_projected"] == max(PEAKS_MB) / PROJECTED_MB
        assert figures["peak_rss_mb"] > 0


def test_off_cuda_the_probe_records_no_device_peak():
    figures = probe_figures([1.0, 0.5], [10.0, 20.0], 4, 10, 123.0, [], None)
    assert figures["peak_device_mb"] == 0.0
    assert figures["device_peaks_mb"] == []
    assert figures["device_measured_over_projected"] is None
