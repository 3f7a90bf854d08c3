"""The step loop shared by SFT and DPO: accumulate micro-batches, clip, step, log.

One JSON line of metrics per optimizer step goes to `metrics_path`; a non-finite
loss or gradient norm skips the optimizer step and is counted.
"""

from __future__ import annotations

import json
import math
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

import torch
from tqdm import tqdm

from align.data.loader import TokenBatch


class Trainer:
    def __init__(self, model, adapter, optimizer, scheduler, grad_clip: float, metrics_path: Path):
        self.model = model
        self.adapter = adapter
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.metrics_path = Path(metrics_path)
        self.step = 0
        self.skipped_steps = 0
        self.last_metrics: dict[str, float] = {}

    def train_step(self, micro_batches: list[TokenBatch]) -> dict[str, float]:
        self.model.train()
        started = time.perf_counter()
        denominator = self.adapter.step_denominator(micro_batches)
        sums: dict[str, float] = defaultdict(float)
        tokens = 0
        for batch in micro_batches:
            loss, batch_sums = self.adapter.loss(self.model, batch, denominator)
            loss.backward()
            for key, value in batch_sums.items():
                sums[key] += value
            tokens += int(batch.attention_mask.sum())
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip))
        metrics = self.adapter.summarize(sums)
        skipped = not (math.isfinite(metrics["loss"]) and math.isfinite(grad_norm))
        lr = self.scheduler.get_last_lr()[0]
        if skipped:
            self.skipped_steps += 1
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        elapsed = time.perf_counter() - started
        metrics.update(
            step=self.step,
            lr=lr,
            grad_norm=grad_norm,
            skipped=skipped,
            tokens_per_s=tokens / elapsed,
            step_time_s=elapsed,
        )
        self.step += 1
        self.last_metrics = metrics
        return metrics

    def fit(self, steps: Iterable[list[TokenBatch]], total: int) -> dict[str, float]:
        self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
        with (
            open(self.metrics_path, "w") as log,
            tqdm(total=total, desc=self.adapter.name, mininterval=5) as bar,
        ):
            for micro_batches in steps:
                metrics = self.train_step(micro_batches)
                log.write(json.dumps(metrics) + "\n")
                bar.update(1)
                bar.set_postfix(loss=f"{metrics['loss']:.4f}", refresh=False)
        return {"steps": self.step, "skipped_steps": self.skipped_steps, "final": self.last_metrics}
