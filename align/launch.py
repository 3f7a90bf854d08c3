"""Launch a stage on this node's ranks through torchrun, keeping the documented exit codes.

`python -m align.launch --nproc N [--nnodes M] [--rdzv-endpoint HOST:PORT] [--rdzv-id ID]
[--stop-marker PATH] [--shutdown-timeout S] [--accept-exit CODE] SCRIPT ARGS...`

One node runs `torchrun --standalone`. Several nodes run one launcher each (under srun in
a Slurm job), joined by a c10d rendezvous; under Slurm its endpoint is the first node of
the job on a port derived from the job id, so every node computes the same one.

A rank's documented exit code (3, 4, 5, 6, 75, ...) becomes the launcher's, or 0 when it is
an `--accept-exit` code (a rule that counts that outcome as a result). SIGTERM and
SIGUSR1 reaching the launcher are forwarded to its workers as their stop request, and
torchrun is kept from turning them into a shutdown: the workers stop together at the next
optimizer-step boundary, save a checkpoint and exit 75, however long that takes. Where
torchrun does shut the workers down (SIGINT, SIGHUP, a failed node), it waits
`--shutdown-timeout` seconds for them before it kills them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from align.exit_codes import INTERNAL, RESUMABLE_STOP

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
# Rendezvous ports derived from a Slurm job id fall in [BASE, BASE + SPAN).
RDZV_PORT_BASE, RDZV_PORT_SPAN = 29500, 20000


def documented_code(exitcodes: list[int]) -> int:
    """The code to report for failed ranks: the first positive code, ranks in order; a rank
    killed by a signal reports 128 + the signal, as a shell would."""
    positive = [code for code in exitcodes if code > 0]
    if positive:
        return positive[0]
    signalled = [code for code in exitcodes if code < 0]
    return 128 - signalled[0] if signalled else INTERNAL


def child_pids(parent: int) -> list[int]:
    """Processes whose parent is `parent` (torchrun's workers are the launcher's children)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, ...
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            found.append(int(entry.name))
    return found


def forward_stop_signals() -> None:
    """SIGTERM / SIGUSR1 to this launcher become the same signal to each of its workers."""

    def forward(signum, frame) -> None:
        for pid in child_pids(os.getpid()):
            with contextlib.suppress(ProcessLookupError):  # a worker that just exited
                os.kill(pid, signum)

    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)


def slurm_rendezvous(job_id: str, nodelist: str) -> str:
    """HOST:PORT of a job's rendezvous: the first node's address, a port from the job id."""
    first = _scontrol("show", "hostnames", nodelist).split()[0]
    node = _scontrol("--oneliner", "show", "node", first)
    fields = dict(part.split("=", 1) for part in node.split() if "=" in part)
    address = fields.get("NodeAddr") or first
    return f"{address}:{RDZV_PORT_BASE + int(job_id) % RDZV_PORT_SPAN}"


def _scontrol(*args: str) -> str:
    return subprocess.run(
        ["scontrol", *args], capture_output=True, text=True, check=True, timeout=60
    ).stdout


def torchrun_args(ns: argparse.Namespace) -> list[str]:
    """torchrun's arguments for this node."""
    common = [
        f"--nproc_per_node={ns.nproc}",
        "--max_restarts=0",
        f"--signals_to_handle={TORCHRUN_SIGNALS}",
        f"--shutdown_timeout={ns.shutdown_timeout}",
    ]
    if ns.nnodes == 1:
        return ["--standalone", *common, ns.script, *ns.args]
    endpoint, rdzv_id = ns.rdzv_endpoint, ns.rdzv_id
    job_id = os.environ.get("SLURM_JOB_ID")
    if endpoint is None:
        if job_id is None:
            raise SystemExit("align.launch: --nnodes > 1 needs --rdzv-endpoint outside Slurm")
        endpoint = slurm_rendezvous(job_id, os.environ["SLURM_JOB_NODELIST"])
    rdzv_id = rdzv_id or job_id or "align"
    return [
        f"--nnodes={ns.nnodes}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        f"--rdzv_id={rdzv_id}",
        *common,
        ns.script,
        *ns.args,
    ]


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m align.launch")
    parser.add_argument("--nproc", type=int, required=True, help="ranks on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the job")
    parser.add_argument("--rdzv-endpoint", help="HOST:PORT (default under Slurm: first node)")
    parser.add_argument("--rdzv-id", help="the rendezvous id (default under Slurm: job id)")
    parser.add_argument("--stop-marker", type=Path, default=None)
    parser.add_argument(
        "--shutdown-timeout",
        type=int,
        default=30,
        help="seconds torchrun waits for stopped workers before it kills them",
    )
    parser.add_argument(
        "--accept-exit",
        type=int,
        action="append",
        default=[],
        help="a documented exit code that counts as success (repeatable)",
    )
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    for name in ("nproc", "nnodes", "shutdown_timeout"):
        if getattr(ns, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    code = launch(ns)
    if code in ns.accept_exit:
        print(f"align.launch: exit {code} accepted (--accept-exit)", file=sys.stderr)
        return 0
    return code


def launch(ns: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    started = time.time()
    args = get_args_parser().parse_args(torchrun_args(ns))
    forward_stop_signals()
    try:
        run(args)
    except ChildFailedError as err:
        failures = sorted(err.failures.items())
        return documented_code([failure.exitcode for _, failure in failures])
    except SignalException as err:
        # A marker from this launch (not an earlier one the workers will resume after).
        marker = ns.stop_marker
        if marker is not None and marker.exists() and marker.stat().st_mtime >= started:
            return RESUMABLE_STOP
        return 128 + int(err.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
