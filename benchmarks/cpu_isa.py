"""What `run.cpu_isa` costs: training steps of the tiny default's model shape on the CPU,
unpinned (each library takes the CPU's widest set) against each pin this CPU can take.

Each setting runs in its own process, since the libraries read their caps once. Prints the
capability torch ran, the median seconds per optimizer step and the ratio to unpinned.

usage: python benchmarks/cpu_isa.py [--steps 10] [--batch 16] [--seq 96] [--threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from align.constants import CPU_ISAS

# The tiny default's pre-registered model shape.
TINY_TOML = Path(__file__).resolve().parents[1] / "config" / "tiny" / "tiny.toml"


def child(isa: str, steps: int, batch: int, seq: int, threads: int) -> dict:
    """Time `steps` AdamW steps after the pin; runs in a fresh process."""
    from align.config import RunConfig, TinyConfig, load_config
    from align.utils.guard import configure_cpu

    configure_cpu(RunConfig(threads=threads, cpu_isa=isa))
    import torch

    from align.model.hf_config import MistralConfig
    from align.model.mistral import NmoMistralForCausalLM
    from align.utils.dist import assert_cpu_isa

    assert_cpu_isa(isa)
    tiny = load_config(TINY_TOML, TinyConfig).cfg
    shape = dataclasses.asdict(tiny.model)
    torch.manual_seed(0)
    model = NmoMistralForCausalLM(
        MistralConfig(**shape, vocab_size=tiny.vocab_size, pad_token_id=0)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, tiny.vocab_size, (batch, seq))
    times = []
    for _ in range(steps + 1):  # the first step warms the allocator and kernels up
        start = time.perf_counter()
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "step_s": statistics.median(times[1:]),
    }


def run_setting(isa: str, args: argparse.Namespace) -> dict | None:
    command = [sys.executable, __file__, "--child", isa or "none"]
    command += ["--steps", str(args.steps), "--batch", str(args.batch)]
    command += ["--seq", str(args.seq), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{isa}: not taken here ({done.stderr.strip().splitlines()[-1]})")
        return None
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        isa = "" if args.child == "none" else args.child
        print(json.dumps(child(isa, args.steps, args.batch, args.seq, args.threads)))
        return
    base = run_setting("", args)
    print(f"{'pin':<10} {'torch runs':<11} {'s/step':>8} {'vs unpinned':>12}")
    print(f"{'(none)':<10} {base['capability']:<11} {base['step_s']:>8.4f} {1.0:>12.2f}")
    for isa in CPU_ISAS:
        measured = run_setting(isa, args)
        if measured:
            ratio = measured["step_s"] / base["step_s"]
            print(
                f"{isa:<10} {measured['capability']:<11} {measured['step_s']:>8.4f} {ratio:>12.2f}"
            )


if __name__ == "__main__":
    main()
