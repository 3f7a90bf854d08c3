"""Build a reference cache of a tiny model with the real precompute, for resume and multi-rank tests.

`python tests/drivers/precompute_tiny.py WORKDIR OUT [--kill-after-parts=K] [--k=v overrides]`
under torchrun or alone. WORKDIR holds `base/` (an HF checkpoint) and `pairs.safetensors`;
the cache is written to OUT and rank 0 prints the precompute's figures as one JSON line.
`--kill-after-parts=K` SIGKILLs the process right after it has written its K-th part file.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

import torch

from align.config import ArmConfig, apply_overrides
from align.exit_codes import run_with_exit_codes
from align.stages import ref_precompute
from align.train.ref_cache import expected_key, ref_forward_impl
from align.utils.dist import destroy_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workdir", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-after-parts", type=int, default=0)
    ns, overrides = parser.parse_known_args()
    torch.set_num_threads(1)
    cfg = ArmConfig(arm="tiny")
    apply_overrides(cfg, overrides, where="driver")
    checkpoint, shard = ns.workdir / "base", ns.workdir / "pairs.safetensors"
    ref = cfg.ref
    impl = ref_forward_impl(ref)
    key = expected_key(checkpoint, shard, cfg.data.seq_len, cfg.data.truncation, ref.dtype, impl)
    if ns.kill_after_parts:
        _kill_after_parts(ns.kill_after_parts)
    figures, info = ref_precompute.precompute_ref_caches(
        checkpoint, [(str(shard), ns.out, key)], ref, cfg.run, ns.out.parent / "run"
    )
    if info.is_main:
        print(json.dumps(figures[ns.out.stem]))
    destroy_distributed()


def _kill_after_parts(limit: int) -> None:
    """SIGKILL this process once it has written `limit` part files: no clean-up runs."""
    original = ref_precompute.write_cache_part
    written = []

    def write_then_maybe_die(*args, **kwargs):
        path = original(*args, **kwargs)
        written.append(path)
        if len(written) == limit:
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return path

    ref_precompute.write_cache_part = write_then_maybe_die


if __name__ == "__main__":
    run_with_exit_codes(main, "precompute_tiny")
