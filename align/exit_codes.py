"""The documented exit codes of every stage, and the wrapper that maps errors to them.

A stage raises an `AlignError` subclass; `run_with_exit_codes` prints its one-line
reason to stderr and exits with the class's code. Anything else is an internal error.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from align.log import stage_logger

OK = 0
USAGE = 2
GATE_REFUSED = 3
BAD_INPUT = 4
TRIPWIRE = 5
PREFLIGHT_REFUSED = 6
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


def run_with_exit_codes(main: Callable[[], int | None], stage: str) -> None:
    """Run `main` and exit with its documented code, logging a one-line reason on error
    (`align STAGE: reason`, the line the workflow's logs and the tests read)."""
    try:
        code = main()
    except AlignError as err:
        stage_logger(stage).error(str(err))
        sys.exit(err.exit_code)
    except KeyboardInterrupt:
        stage_logger(stage).error("interrupted")
        sys.exit(RESUMABLE_STOP)
    except Exception:
        traceback.print_exc()
        stage_logger(stage).error(f"internal error (exit {INTERNAL})")
        sys.exit(INTERNAL)
    sys.exit(OK if code is None else code)
