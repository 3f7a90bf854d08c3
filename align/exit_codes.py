"""The documented exit codes of every stage, and the wrapper that maps errors to them.

A stage raises an `AlignError` subclass; `run_with_exit_codes` prints its one-line
reason to stderr and exits with the class's code. A write that finds its filesystem
full or its quota spent ends as `NoSpaceLeft` (exit 7) whichever library made the
write: `writing` names the path, and the wrapper catches what no `writing` did.
Anything else is an internal error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from align.log import reserve_log_space, stage_logger

OK = 0
USAGE = 2
GATE_REFUSED = 3
BAD_INPUT = 4
TRIPWIRE = 5
PREFLIGHT_REFUSED = 6
NO_SPACE = 7
INTERNAL = 70
RESUMABLE_STOP = 75


class AlignError(Exception):
    """Base of every error that ends a stage with a documented exit code."""

    exit_code = INTERNAL


class ConfigError(AlignError):
    """Usage or configuration error: unknown key, bad override, wrong type."""

    exit_code = USAGE


class GateRefused(AlignError):
    """A gate found a receipt missing, failed, or disagreeing with what it expects."""

    exit_code = GATE_REFUSED

    def __init__(self, gate: str, message: str):
        super().__init__(f"gate {gate}: {message}")
        self.gate = gate


class BadInputData(AlignError):
    """Input data is malformed; the message names the file, the row and the problem."""

    exit_code = BAD_INPUT


class TripwireFired(AlignError):
    """A tripwire fired again after the pre-registered rerun."""

    exit_code = TRIPWIRE


class PreflightRefused(AlignError):
    """The resource preflight projects more memory than the host can give."""

    exit_code = PREFLIGHT_REFUSED


class ResumableStop(AlignError):
    """Training stopped at a step boundary after a checkpoint; a retry resumes."""

    exit_code = RESUMABLE_STOP


class NoSpaceLeft(AlignError):
    """A write found its filesystem full (ENOSPC) or its quota spent (EDQUOT). Whatever it
    wrote is gone or unfinished, never taken as whole: free space and rerun."""

    exit_code = NO_SPACE

    def __init__(self, path: str | os.PathLike | None, needed_bytes: int | None, cause: str):
        needed = "an unknown number of" if needed_bytes is None else f"{needed_bytes:,}"
        if path is None:
            where = "writing a file its library did not name"
        else:
            free, total, mount = filesystem_space(path)
            where = (
                f"writing {path}: it needed {needed} bytes, the filesystem at {mount} has "
                f"{free:,} bytes free of {total:,}"
            )
        super().__init__(
            f"{cause} {where}; free space (or raise the quota) and rerun, nothing partly "
            "written is kept"
        )
        self.path = None if path is None else Path(path)


# ENOSPC and EDQUOT as libraries that hide the errno word them: Rust's io::Error, C's strerror.
_NO_SPACE_TEXT = re.compile(
    r"No space left on device|Disk quota exceeded|os error (28|122)\b|StorageFull|QuotaExceeded"
)
# How torch.save's zip writer fails when a write comes up short.
_TORCH_WRITE_FAILED = re.compile(r"inline_container\.cc|PytorchStreamWriter failed")
_CAUSES = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}


def filesystem_space(path: str | os.PathLike) -> tuple[int, int, Path]:
    """(bytes free to this user, bytes in all, mount point) of the filesystem holding `path`
    or, where it does not exist yet, its nearest existing parent."""
    where = Path(os.path.abspath(path))
    while not where.exists() and where != where.parent:
        where = where.parent
    stats = os.statvfs(where)
    mount = where
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize, mount


def no_space_cause(err: BaseException) -> str | None:
    """ "no space left on device" or "disk quota exceeded" where `err`, anything it was raised
    from, or a rank's failure it gathers (torch.distributed.checkpoint's) says so."""
    for current in _chain(err):
        if isinstance(current, OSError) and current.errno in _CAUSES:
            return _CAUSES[current.errno]
        match = _NO_SPACE_TEXT.search(str(current))
        if match:
            quota = "uota" in match.group(0) or match.group(1) == "122"
            return _CAUSES[errno.EDQUOT if quota else errno.ENOSPC]
    return None


def _chain(err: BaseException) -> Iterator[BaseException]:
    """`err`, what it was raised from or during, and the per-rank failures it gathers."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        failures = getattr(current, "failures", None)
        if isinstance(failures, dict):
            pending += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        pending += [current.__cause__, current.__context__]


@contextlib.contextmanager
def writing(path: str | os.PathLike, needed_bytes: int | None = None) -> Iterator[None]:
    """Turn a write to `path` that runs out of space into `NoSpaceLeft` naming it.

    torch.save words a full disk only as a failed write of its zip stream; with
    `needed_bytes` known, such a failure that left fewer bytes free counts as out of space.
    """
    try:
        yield
    except (NoSpaceLeft, KeyboardInterrupt, SystemExit):
        raise
    except BaseException as err:
        cause = no_space_cause(err)
        if (
            cause is None
            and needed_bytes is not None
            and _short_torch_write(err, path, needed_bytes)
        ):
            cause = "no space left on device"
        if cause is None:
            raise
        raise NoSpaceLeft(path, needed_bytes, cause) from err


def _short_torch_write(err: BaseException, path: str | os.PathLike, needed_bytes: int) -> bool:
    failed_write = any(_TORCH_WRITE_FAILED.search(str(e)) for e in _chain(err))
    return failed_write and filesystem_space(path)[0] < needed_bytes


def run_with_exit_codes(main: Callable[[], int | None], stage: str) -> None:
    """Run `main` and exit with its documented code, logging a one-line reason on error
    (`align STAGE: reason`, the line the workflow's logs and the tests read).

    The log keeps space reserved ahead of its end, so that line reaches a log on a full
    filesystem too.
    """
    reserve_log_space()
    try:
        code = main()
    except AlignError as err:
        stage_logger(stage).error(str(err))
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        stage_logger(stage).error("interrupted")
        sys.exit(RESUMABLE_STOP)
    except (SystemExit, GeneratorExit):
        raise
    # BaseException: torch.distributed.checkpoint's CheckpointException derives from it.
    except BaseException as err:
        cause = no_space_cause(err)
        if cause is not None:
            path = getattr(err, "filename", None)
            stage_logger(stage).error(str(NoSpaceLeft(path, None, cause)))
            sys.exit(NO_SPACE)
        traceback.print_exc()
        stage_logger(stage).error(f"internal error (exit {INTERNAL})")
        sys.exit(INTERNAL)
    sys.exit(OK if code is None else code)
