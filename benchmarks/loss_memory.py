"""Peak extra memory and time of one DPO forward+backward through the lm_head, on CPU.

Compares, at V = 32000, H = 1024, 4 pairs (8 rows) and T in {512, 1024, 2048}, float32:
  reference  full [8, T, V] logits, log_softmax and gather (align.losses.reference)
  fused      align.losses.fused.fused_dpo: ChunkedLabelLogps, chunks of scored positions;
             backward consumes the last chunk held from forward and recomputes the rest
  liger      Liger Kernel's LigerFusedLinearDPOLoss, where it imports and runs
Targets: fused time <= 1.25x the reference's at every T, and fused peak memory under 1/8
of the reference's at T = 2048. At T = 512 the fused path also runs at other chunk
sizes. Every position but the last is scored, the worst case for the fused path, which
skips unscored positions. Reference log-probs are zero for all, so their losses agree.

How it measures: each T runs in a fresh subprocess holding one set of inputs. Each
method first runs one untimed forward+backward (library set-up, Liger's torch.compile);
then `repeats` rounds each run every method once, in an order that reverses from round
to round, so that reference and fused steps sit next to each other in time and share
whatever load other jobs put on the cores. Per step: reset the kernel's peak-RSS counter
(writing 5 to /proc/self/clear_refs), read VmRSS, run forward+backward, read VmHWM.
Peak extra memory = VmHWM - VmRSS before the step: every page the loss touched at its
peak, including the gradients of hidden and weight it returns. The child runs with
MALLOC_MMAP_THRESHOLD_=1 MiB so that glibc hands every large tensor back to the OS when
freed; otherwise memory kept from an earlier step would hide the peak. Tables show the
largest peak, the median wall and CPU (process_time) time, and as "x ref" the median over
rounds of each round's ratio to that round's reference step.

Run: .venv/bin/python benchmarks/loss_memory.py   (about half an hour on two shared cores)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch

from align.losses.dpo import DPOObjective
from align.losses.fused import DEFAULT_CHUNK_SIZE, fused_dpo
from align.losses.reference import reference_dpo

VOCAB = 32000
HIDDEN = 1024
PAIRS = 4
BETA = 0.1
LENGTHS = (512, 1024, 2048)
SWEEP_LENGTH = 512
SWEEP_CHUNKS = (256, 4096)
TIME_TARGET = 1.25
MEMORY_TARGET = 1 / 8
MEMORY_TARGET_LENGTH = 2048
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)}


def make_inputs(length: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(length)
    labels = torch.randint(0, VOCAB, (2 * PAIRS, length), generator=generator)
    labels[:, -1] = -100
    return {
        "hidden": torch.randn(2 * PAIRS, length, HIDDEN, generator=generator).requires_grad_(),
        "weight": (torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN**0.5).requires_grad_(),
        "labels": labels,
        "ref": torch.zeros(PAIRS),
    }


def reference_step(inputs: dict[str, torch.Tensor], chunk_size: int) -> torch.Tensor:
    objective = DPOObjective(beta=BETA)
    hidden, weight, labels, ref = (inputs[k] for k in ("hidden", "weight", "labels", "ref"))
    return reference_dpo(hidden, weight, labels, ref, ref, objective, dtype=torch.float32).loss


def fused_step(inputs: dict[str, torch.Tensor], chunk_size: int) -> torch.Tensor:
    objective = DPOObjective(beta=BETA)
    hidden, weight, labels, ref = (inputs[k] for k in ("hidden", "weight", "labels", "ref"))
    return fused_dpo(hidden, weight, labels, ref, ref, objective, chunk_size).loss


def liger_step(inputs: dict[str, torch.Tensor], chunk_size: int) -> torch.Tensor:
    # Optional: imported here so that the other methods run where Liger does not.
    from liger_kernel.chunked_loss import LigerFusedLinearDPOLoss

    loss_fn = LigerFusedLinearDPOLoss(beta=BETA, use_ref_model=False)
    loss, _ = loss_fn(inputs["weight"], inputs["hidden"], inputs["labels"])
    return loss


STEPS: dict[str, Callable[[dict[str, torch.Tensor], int], torch.Tensor]] = {
    "reference": reference_step,
    "fused": fused_step,
    "liger": liger_step,
}


def entries_for(length: int) -> list[str]:
    """Entries `method:chunk` measured at `length`; the reference comes first."""
    entries = ["reference:0", f"fused:{DEFAULT_CHUNK_SIZE}", "liger:0"]
    if length == SWEEP_LENGTH:
        entries += [f"fused:{chunk}" for chunk in SWEEP_CHUNKS]
    return entries


def proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def forward_backward(step, inputs: dict[str, torch.Tensor], chunk_size: int) -> float:
    loss = step(inputs, chunk_size)
    loss.backward()
    value = float(loss.detach())
    inputs["hidden"].grad = None
    inputs["weight"].grad = None
    return value


def measured_step(step, inputs: dict[str, torch.Tensor], chunk_size: int) -> dict[str, float]:
    gc.collect()
    reset_peak_rss()
    before = proc_status_kib("VmRSS")
    wall, cpu = time.perf_counter(), time.process_time()
    loss = forward_backward(step, inputs, chunk_size)
    return {
        "seconds": time.perf_counter() - wall,
        "cpu_seconds": time.process_time() - cpu,
        "peak_mib": (proc_status_kib("VmHWM") - before) / 1024,
        "loss": loss,
    }


def measure(length: int, entries: list[str], repeats: int) -> dict[str, dict]:
    """Per entry: its steps of every round, or the error that stopped it at warm-up."""
    inputs = make_inputs(length)
    results: dict[str, dict] = {}
    for entry in entries:
        method, chunk = entry.split(":")
        try:
            forward_backward(STEPS[method], inputs, int(chunk))
            results[entry] = {"steps": []}
        except Exception as error:
            detail = "".join(traceback.format_exception_only(type(error), error)).strip()
            results[entry] = {"error": detail}
    running = [entry for entry in entries if "steps" in results[entry]]
    for round_index in range(repeats):
        for entry in running if round_index % 2 == 0 else running[::-1]:
            method, chunk = entry.split(":")
            results[entry]["steps"].append(measured_step(STEPS[method], inputs, int(chunk)))
    return results


def run_child(length: int, entries: list[str], repeats: int) -> dict[str, dict]:
    command = [sys.executable, __file__, "--measure", str(length), str(repeats), *entries]
    done = subprocess.run(
        command, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True, check=False
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        error = f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"
        return {entry: {"error": error} for entry in entries}
    return json.loads(lines[-1])


def summarize(result: dict, reference: dict | None) -> dict[str, float]:
    """Largest peak, median times, and medians of the per-round ratios to the reference."""
    steps = result["steps"]
    summary = {
        "peak_mib": max(step["peak_mib"] for step in steps),
        "seconds": statistics.median(step["seconds"] for step in steps),
        "cpu_seconds": statistics.median(step["cpu_seconds"] for step in steps),
        "loss": steps[-1]["loss"],
    }
    if reference is not None:
        base_steps = reference["steps"]
        summary["peak_ratio"] = summary["peak_mib"] / max(s["peak_mib"] for s in base_steps)
        for key in ("seconds", "cpu_seconds"):
            ratios = [s[key] / b[key] for s, b in zip(steps, base_steps, strict=True)]
            summary[f"{key}_ratio"] = statistics.median(ratios)
    return summary


HEADER = "    T  {:16s}  peak MiB   x ref   wall s   x ref    cpu s   x ref  loss"


def print_row(length: int, name: str, summary: dict) -> None:
    cells = []
    for key, width in (("peak_mib", 8), ("seconds", 7), ("cpu_seconds", 7)):
        ratio = summary.get(key.replace("_mib", "") + "_ratio")
        shown = f"{ratio:6.3f}" if ratio is not None else "     -"
        cells.append(f"{summary[key]:{width}.1f}  {shown}")
    print(f"{length:5d}  {name:16s}  {'  '.join(cells)}  {summary['loss']:.6f}", flush=True)


def label(entry: str) -> str:
    method, chunk = entry.split(":")
    return f"{method} chunk={chunk}" if method == "fused" else method


def main(repeats: int) -> None:
    print(
        f"V={VOCAB} H={HIDDEN} pairs={PAIRS} float32 CPU, {torch.get_num_threads()} threads, "
        f"medians of {repeats} alternating rounds per T"
    )
    print(HEADER.format("method"))
    verdicts = []
    for length in LENGTHS:
        results = run_child(length, entries_for(length), repeats)
        reference = results["reference:0"]
        if "error" in reference:
            print(f"{length:5d}  reference unavailable: {reference['error']}", flush=True)
            continue
        print_row(length, "reference", summarize(reference, None))
        for entry, result in results.items():
            if entry == "reference:0":
                continue
            if "error" in result:
                print(f"{length:5d}  {label(entry):16s}  unavailable: {result['error']}")
                continue
            summary = summarize(result, reference)
            print_row(length, label(entry), summary)
            if entry == f"fused:{DEFAULT_CHUNK_SIZE}":
                verdicts.append(verdict(length, summary))
    print()
    for line in verdicts:
        print(line)


def verdict(length: int, summary: dict) -> str:
    time_ok = summary["seconds_ratio"] <= TIME_TARGET
    line = (
        f"T={length}: fused wall {summary['seconds_ratio']:.3f}x reference "
        f"(target <= {TIME_TARGET}) {'met' if time_ok else 'MISSED'}"
    )
    if length == MEMORY_TARGET_LENGTH:
        memory_ok = summary["peak_ratio"] < MEMORY_TARGET
        line += (
            f"; peak memory {summary['peak_ratio']:.3f}x (target < {MEMORY_TARGET:.3f}) "
            f"{'met' if memory_ok else 'MISSED'}"
        )
    return line


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--measure", nargs="+", metavar="T REPEATS ENTRY")
    args = parser.parse_args()
    if args.measure:
        length, repeats, *entries = args.measure
        print(json.dumps(measure(int(length), entries, int(repeats))))
    else:
        main(args.repeats)
