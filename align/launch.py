"""Launch a stage on N local ranks through torchrun, keeping the documented exit codes.

`python -m align.launch --nproc N [--stop-marker PATH] SCRIPT ARGS...` runs
`torchrun --standalone`; a rank's documented exit code (3, 4, 5, 6, 75, ...) becomes
the launcher's, instead of torchrun's generic failure. When the launcher itself is
signalled, its workers are stopped with SIGTERM; if they checkpointed and left the
stop marker, the launch ends in 75 (resumable).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from align.exit_codes import INTERNAL, RESUMABLE_STOP


def documented_code(exitcodes: list[int]) -> int:
    """The code to report for failed ranks: the first positive code, ranks in order."""
    positive = [code for code in exitcodes if code > 0]
    return positive[0] if positive else INTERNAL


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m align.launch")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("--stop-marker", type=Path, default=None)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {ns.nproc}")

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if ns.stop_marker is not None:
        ns.stop_marker.unlink(missing_ok=True)
    torchrun_args = get_args_parser().parse_args(
        ["--standalone", f"--nproc_per_node={ns.nproc}", "--max_restarts=0", ns.script, *ns.args]
    )
    try:
        run(torchrun_args)
    except ChildFailedError as err:
        failures = sorted(err.failures.items())
        return documented_code([failure.exitcode for _, failure in failures])
    except SignalException as err:
        if ns.stop_marker is not None and ns.stop_marker.exists():
            return RESUMABLE_STOP
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
