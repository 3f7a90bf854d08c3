"""Peak extra memory and time of one DPO forward+backward through the lm_head, on CPU.

Compares, at V = 32000, H = 1024, 4 pairs (8 rows) and T in {512, 1024, 2048}, float32:
  reference  full [8, T, V] logits, log_softmax and gather (align.losses.reference)
  fused      the chunked objective (align.losses.fused.fused_dpo)
  liger      Liger Kernel's LigerFusedLinearDPOLoss, where it imports and runs
Every position but the last is scored, the worst case for the fused path, which skips
unscored positions. Reference log-probs are zero for all three, so their losses agree.

How memory is measured: each (method, T) runs in a fresh subprocess. It builds the
inputs, runs one untimed forward+backward (library set-up, Liger's torch.compile),
drops the gradients, then, for each measured step, resets the kernel's peak-RSS
counter (writing 5 to /proc/self/clear_refs), reads VmRSS, runs forward+backward and
reads VmHWM. Peak extra memory = VmHWM - VmRSS before the step: every page touched by
the loss at its peak, including the gradients of hidden and weight it returns. The
child runs with MALLOC_MMAP_THRESHOLD_=1 MiB so that glibc hands every large tensor
back to the OS when freed; otherwise memory kept from the untimed step would hide the
peak. Tables show the largest peak and the shortest wall and CPU (process_time) times
of the measured steps; CPU time is the steadier figure when other jobs share the cores.

Run: .venv/bin/python benchmarks/loss_memory.py   (several minutes on two cores)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch

from align.losses.dpo import DPOObjective
from align.losses.fused import fused_dpo
from align.losses.reference import reference_dpo

VOCAB = 32000
HIDDEN = 1024
PAIRS = 4
BETA = 0.1
LENGTHS = (512, 1024, 2048)
METHODS = ("reference", "fused", "liger")
SWEEP_LENGTH = 512
SWEEP_CHUNKS = (256, 1024, 4096)
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


def measure(method: str, length: int, chunk_size: int, repeats: int) -> dict[str, float]:
    """One warm-up, then `repeats` measured forward+backward steps in this (fresh) process."""
    step = STEPS[method]
    inputs = make_inputs(length)
    forward_backward(step, inputs, chunk_size)
    peaks, walls, cpus = [], [], []
    for _ in range(repeats):
        gc.collect()
        reset_peak_rss()
        before = proc_status_kib("VmRSS")
        wall, cpu = time.perf_counter(), time.process_time()
        loss = forward_backward(step, inputs, chunk_size)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        peaks.append((proc_status_kib("VmHWM") - before) / 1024)
    return {"peak_mib": max(peaks), "seconds": min(walls), "cpu_seconds": min(cpus), "loss": loss}


def run_child(method: str, length: int, chunk_size: int, repeats: int) -> dict:
    command = [
        sys.executable,
        __file__,
        "--measure",
        method,
        str(length),
        str(chunk_size),
        str(repeats),
    ]
    done = subprocess.run(
        command, env={**os.environ, **CHILD_ENV}, capture_output=True, text=True, check=False
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}: {done.stderr.strip()[-2000:]}"}
    return json.loads(lines[-1])


def child_main(method: str, length: int, chunk_size: int, repeats: int) -> None:
    try:
        print(json.dumps(measure(method, length, chunk_size, repeats)))
    except Exception as error:
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        print(json.dumps({"error": detail}))


def ratio(value: float, base: float | None) -> str:
    return f"{value / base:6.3f}" if base else "     -"


HEADER = "    T  {:14s}  peak MiB   x ref   wall s   x ref    cpu s   x ref  loss"


def print_row(length: int, name: str, result: dict, reference: dict | None) -> None:
    if "error" in result:
        print(f"{length:5d}  {name:14s}  unavailable: {result['error']}", flush=True)
        return
    cells = []
    for key, width in (("peak_mib", 8), ("seconds", 7), ("cpu_seconds", 7)):
        base = reference[key] if reference else None
        cells.append(f"{result[key]:{width}.1f}  {ratio(result[key], base)}")
    print(f"{length:5d}  {name:14s}  {'  '.join(cells)}  {result['loss']:.6f}", flush=True)


def main(chunk_size: int, repeats: int) -> None:
    print(
        f"V={VOCAB} H={HIDDEN} pairs={PAIRS} float32 CPU, {torch.get_num_threads()} threads, "
        f"fused chunk_size={chunk_size}, best of {repeats} measured steps per cell"
    )
    print(HEADER.format("method"))
    liger_error = None
    for length in LENGTHS:
        reference = run_child("reference", length, chunk_size, repeats)
        print_row(length, "reference", reference, None)
        base = None if "error" in reference else reference
        print_row(length, "fused", run_child("fused", length, chunk_size, repeats), base)
        if liger_error is None:
            liger = run_child("liger", length, chunk_size, repeats)
            liger_error = liger.get("error")
        print_row(length, "liger", liger if liger_error is None else {"error": liger_error}, base)
    print(f"\nfused against chunk size at T={SWEEP_LENGTH} ({2 * PAIRS * SWEEP_LENGTH} tokens)")
    print(HEADER.format("chunk"))
    for chunk in SWEEP_CHUNKS:
        result = run_child("fused", SWEEP_LENGTH, chunk, repeats)
        print_row(SWEEP_LENGTH, f"chunk={chunk}", result, None)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--measure", nargs=4, metavar=("METHOD", "T", "CHUNK", "REPEATS"))
    args = parser.parse_args()
    if args.measure:
        method, length, chunk, repeats = args.measure
        child_main(method, int(length), int(chunk), int(repeats))
    else:
        main(args.chunk_size, args.repeats)
