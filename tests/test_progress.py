"""The training log's progress line: when it is due, and what it says."""

from __future__ import annotations

from align.train.progress import Progress, clock

DPO_METRICS = {"loss": 0.6931, "rewards/accuracies": 0.625, "tokens_per_s": 12345.6}


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_dpo_log_showed_nothing_between_the_banner_and_the_final_figures():
    now = Clock()
    progress = Progress(56, 0, every_steps=10, every_s=0, projected_wall_s=300.0, now=now)
    due = []
    for step in range(1, 57):
        now.t += 2.0
        if progress.due(step):
            due.append(step)
            line = progress.line(step, DPO_METRICS)
    assert due == [10, 20, 30, 40, 50, 56]
    assert line.startswith("step 56/56, loss 0.6931, reward acc 0.625, 12,346 tokens/s")
    assert "elapsed 1m52s" in line and "ETA" not in line  # done: nothing left to estimate
    assert line.endswith("probe projected 5m00s for the run")


def test_the_eta_is_this_processs_own_pace_after_a_resume():
    now = Clock()
    progress = Progress(100, 40, every_steps=0, every_s=30, now=now)
    now.t += 10.0
    assert not progress.due(41)
    now.t += 20.0  # 10 steps in 30 s: 3 s a step, 50 steps to go
    assert progress.due(50)
    line = progress.line(50, {"loss": 1.5, "tokens_per_s": 100.0})
    assert "reward acc" not in line  # SFT's metrics have none
    assert "elapsed 30s" in line and "ETA 2m30s" in line and "probe" not in line


def test_clock_reads_hours_minutes_and_seconds():
    assert [clock(42.4), clock(125), clock(3723)] == ["42s", "2m05s", "1h02m03s"]
