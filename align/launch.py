"""Launch a stage on this node's ranks through torchrun, keeping the documented exit codes.

`python -m align.launch --nproc N [--nnodes M --node-rank R] [--rdzv-endpoint HOST:PORT]
[--rdzv-id ID] [--stop-marker PATH] [--shutdown-timeout S] [--accept-exit CODE] SCRIPT ARGS...`

One node runs `torchrun --standalone`. Several nodes run one launcher each (under srun in
a Slurm job), joined by a c10d rendezvous; under Slurm its endpoint is the first node of
the job on a port derived from the job id, so every node computes the same one. Node 0's
launcher hosts the rendezvous store itself and keeps it until every node's launcher has
ended: a node whose ranks end later than node 0's still reads its own ranks' exit code,
where a store that ended with node 0's torchrun would leave it a connection error.

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
import sys
import time
from datetime import timedelta
from pathlib import Path

from align.constants import LAUNCHER_PID_ENV
from align.exit_codes import INTERNAL, RESUMABLE_STOP
from align.log import stage_logger

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TORCHRUN_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"
# Rendezvous ports derived from a Slurm job id fall in [BASE, BASE + SPAN).
RDZV_PORT_BASE, RDZV_PORT_SPAN = 29500, 20000
# The rendezvous store's count of node launchers that have ended.
NODES_ENDED_KEY = "align.launch/nodes_ended"
# How long a node that has ended waits to reach the store host to say so.
REPORT_END_TIMEOUT_S = 10


def documented_code(exitcodes: list[int]) -> int:
    """The code to report for failed ranks: the first positive code other than INTERNAL,
    ranks in order, since a rank that saw its peer fail (a broken collective) ends internal;
    then INTERNAL; a rank killed by a signal reports 128 + the signal, as a shell would."""
    positive = sorted((code for code in exitcodes if code > 0), key=lambda code: code == INTERNAL)
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


def slurm_rendezvous(job_id: str, launch_node_address: str) -> str:
    """HOST:PORT of a job's rendezvous: the address of the node srun was started from (the
    batch step's, the job's first node: node 0, which hosts the store), a port from the job
    id. srun hands every task that address, so nothing of Slurm's client is needed inside
    the image the launcher runs in."""
    return f"{launch_node_address}:{RDZV_PORT_BASE + int(job_id) % RDZV_PORT_SPAN}"


def rendezvous_endpoint(ns: argparse.Namespace) -> str:
    """HOST:PORT of a multi-node launch: as given, or derived from the Slurm job step."""
    if ns.rdzv_endpoint is not None:
        return ns.rdzv_endpoint
    job_id = os.environ.get("SLURM_JOB_ID")
    address = os.environ.get("SLURM_LAUNCH_NODE_IPADDR")
    if job_id is None or address is None:
        raise SystemExit(
            "align.launch: --nnodes > 1 needs --rdzv-endpoint outside a Slurm job step "
            "(srun sets SLURM_JOB_ID and SLURM_LAUNCH_NODE_IPADDR)"
        )
    return slurm_rendezvous(job_id, address)


def torchrun_args(ns: argparse.Namespace, endpoint: str | None) -> list[str]:
    """torchrun's arguments for this node; `endpoint` is None on one node."""
    common = [
        f"--nproc_per_node={ns.nproc}",
        "--max_restarts=0",
        f"--signals_to_handle={TORCHRUN_SIGNALS}",
        f"--shutdown_timeout={ns.shutdown_timeout}",
    ]
    if endpoint is None:
        return ["--standalone", *common, ns.script, *ns.args]
    return [
        f"--nnodes={ns.nnodes}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={endpoint}",
        f"--rdzv_id={ns.rdzv_id or os.environ.get('SLURM_JOB_ID') or 'align'}",
        # Every torchrun is a client: the store is node 0's launcher's (see host_store).
        "--rdzv_conf=is_host=false",
        *common,
        ns.script,
        *ns.args,
    ]


def _store(endpoint: str, *, host: bool, timeout_s: float):
    from torch.distributed import TCPStore

    address, port = endpoint.rsplit(":", 1)
    return TCPStore(
        address,
        int(port),
        is_master=host,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
    )


def host_store(endpoint: str, ns: argparse.Namespace):
    """Node 0's rendezvous store, hosted by this launcher rather than by its torchrun."""
    return _store(endpoint, host=True, timeout_s=ns.shutdown_timeout)


def hold_until_nodes_end(store, ns: argparse.Namespace) -> None:
    """Keep the store up until every node's launcher has said it ended, for at most the
    shutdown timeout: a node that failed apart from the others still ends the job then."""
    store.add(NODES_ENDED_KEY, 1)
    deadline = time.monotonic() + ns.shutdown_timeout
    while store.add(NODES_ENDED_KEY, 0) < ns.nnodes and time.monotonic() < deadline:
        time.sleep(0.1)


def report_end(endpoint: str) -> None:
    """Tell node 0's launcher this node has ended; a store already gone has nothing to hold."""
    with contextlib.suppress(RuntimeError):  # torch's DistError: the host is unreachable
        _store(endpoint, host=False, timeout_s=REPORT_END_TIMEOUT_S).add(NODES_ENDED_KEY, 1)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m align.launch")
    parser.add_argument("--nproc", type=int, required=True, help="ranks on this node")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes of the job")
    parser.add_argument(
        "--node-rank",
        type=int,
        default=os.environ.get("SLURM_NODEID"),
        help="this node's index in a multi-node launch; 0 hosts the rendezvous store "
        "(default under Slurm: SLURM_NODEID)",
    )
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
    if ns.nnodes > 1 and not (ns.node_rank is not None and 0 <= ns.node_rank < ns.nnodes):
        parser.error(
            f"--nnodes={ns.nnodes} needs --node-rank in [0, {ns.nnodes}) (or SLURM_NODEID), "
            f"got {ns.node_rank}"
        )
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse(argv)
    code = launch(ns)
    if code in ns.accept_exit:
        stage_logger("launch").info(f"exit {code} accepted (--accept-exit)")
        return 0
    return code


def launch(ns: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    started = time.time()
    endpoint = rendezvous_endpoint(ns) if ns.nnodes > 1 else None
    args = get_args_parser().parse_args(torchrun_args(ns, endpoint))
    store = host_store(endpoint, ns) if endpoint and ns.node_rank == 0 else None
    forward_stop_signals()
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
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
    finally:
        if store is not None:
            hold_until_nodes_end(store, ns)
        elif endpoint is not None:
            report_end(endpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())
