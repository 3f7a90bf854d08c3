"""A scoring forward's host peak, measured against align.train.memory's model of it.

`python benchmarks/scoring_heap.py CHECKPOINT_DIR [CHECKPOINT_DIR ...]` builds each
checkpoint's model (random weights, float32) and, in a fresh process per shape, runs one
no-grad scoring forward (right-padded rows, the fused label head) after a small warm-up,
reading the rise of VmHWM over VmRSS. Each shape runs twice:

- with every tensor returned to the kernel on free (MALLOC_MMAP_THRESHOLD_=65536), which
  measures the tensors the forward holds at its peak: the activation model's figure;
- with glibc as the ranks run it (align.utils.heap pins its mmap threshold at 2 MiB), whose
  heap also keeps freed tensors under that threshold: the difference is part of what
  preflight.scoring_heap_overhead_mb covers.

It prints both per shape, and the model's figure beside them as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SHAPES = ((8, 1024), (16, 512), (32, 256), (4, 1024), (8, 512))
RETURN_ON_FREE = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def child(checkpoint: str, rows: int, length: int) -> None:
    """One scoring forward in this process; prints its peak's rise in MiB as JSON."""
    import torch

    from align.model.hf_config import load_hf_config
    from align.model.mistral import NmoMistralForCausalLM
    from align.train.phases import reset_host_peak, status_mb
    from align.utils.heap import fix_mmap_threshold

    if not RETURN_ON_FREE.keys() & os.environ.keys():
        fix_mmap_threshold()  # as every rank does (align.utils.guard)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = load_hf_config(checkpoint)
    model = NmoMistralForCausalLM(config, "sdpa").float().eval()
    ids = torch.randint(0, config.vocab_size, (rows, length))
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[:, length - length // 4 :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        model(ids[:1, :16], mask[:1, :16], labels=labels[:1, :16])
        start = status_mb("VmRSS")
        reset_host_peak()
        model(ids, mask, labels=labels)
    print(json.dumps({"peak_mb": status_mb("VmHWM") - start}))


def measure(checkpoint: str, rows: int, length: int, env: dict[str, str]) -> float:
    """The forward's peak rise in MiB, from a fresh process under `env`."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", checkpoint, str(rows), str(length)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mb"]


def modelled_mb(checkpoint: str, rows: int, length: int) -> float:
    from align.config import ArmConfig
    from align.model.hf_config import load_hf_config
    from align.train.memory import MIB, cpu_scoring_activations, job_shape

    shape = job_shape("path_bias", ArmConfig(), seq_len=length)
    return cpu_scoring_activations(shape, load_hf_config(checkpoint), rows, length) / MIB


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    args = parser.parse_args()
    print("checkpoint | rows x length | tensors (MiB) | glibc (MiB) | heap kept | model / tensors")
    for checkpoint in args.checkpoints:
        for rows, length in SHAPES:
            tensors = measure(checkpoint, rows, length, RETURN_ON_FREE)
            glibc = measure(checkpoint, rows, length, {})
            model = modelled_mb(checkpoint, rows, length)
            print(
                f"{checkpoint} | {rows} x {length} | {tensors:.0f} | {glibc:.0f} | "
                f"{glibc - tensors:+.0f} | {model / tensors:.2f}x"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
