"""align's one log. Each line reads `align STAGE: message` (`align: message` outside a
stage, `align STAGE rank R: message` from a rank other than 0) and is written whole in one
write(2), so the lines of ranks that share a log never run into each other. Rank 0 logs
from INFO, every other rank only its warnings; ALIGN_LOG_LEVEL=DEBUG shows every rank's
INFO and DEBUG lines too. A stage's messages go through `stage_logger(stage)`.
"""

from __future__ import annotations

import ctypes
import functools
import io
import logging
import os
import stat
import sys

ROOT = "align"
LEVEL_ENV = "ALIGN_LOG_LEVEL"
# Bytes kept allocated past the end of a log file, so that the lines a stage ends with
# reach it when its filesystem has filled: far more than any stage's last lines.
LOG_RESERVE_BYTES = 64 << 10
# fallocate(2)'s mode that allocates without changing the file's size.
_FALLOC_FL_KEEP_SIZE = 1


def process_rank() -> int:
    """This process's rank under torchrun (0 for a process launched alone)."""
    return int(os.environ.get("RANK", "0"))


def stage_logger(stage: str | None = None) -> logging.Logger:
    """The logger whose lines name `stage` (none: the package's own lines)."""
    logger = logging.getLogger(f"{ROOT}.{stage}" if stage else ROOT)
    _install()
    return logger


class _StagePrefix(logging.Formatter):
    """`align STAGE[ rank R]: ` before the message; a multi-line message keeps its lines."""

    def format(self, record: logging.LogRecord) -> str:
        stage = record.name[len(ROOT) + 1 :] if record.name != ROOT else ""
        rank = process_rank()
        prefix = " ".join(part for part in (ROOT, stage, f"rank {rank}" if rank else "") if part)
        message = record.getMessage()
        return f"{prefix}:{'' if message.startswith(chr(10)) else ' '}{message}"


class _OneWrite(logging.Handler):
    """Each record as one write to stderr's file descriptor, whatever Python buffers."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record) + "\n"
            stream = sys.stderr
            stream.flush()
            try:
                fd = stream.fileno()
            except (AttributeError, OSError, io.UnsupportedOperation):
                stream.write(line)  # a stream without a descriptor (a test's capture)
                stream.flush()
                return
            data = line.encode()
            while data:  # a write cut short (a full filesystem) writes the rest or raises
                data = data[os.write(fd, data) :]
            reserve_log_space(fd)
        except Exception:  # logging must never end a stage
            self.handleError(record)


def _level() -> int:
    wanted = os.environ.get(LEVEL_ENV, "")
    if wanted:
        level = logging.getLevelName(wanted.upper())
        if not isinstance(level, int):
            raise ValueError(f"{LEVEL_ENV}={wanted!r} is not a logging level (DEBUG, INFO, ...)")
        return level
    return logging.INFO if process_rank() == 0 else logging.WARNING


def _install() -> None:
    """The handler on the package's root logger, once per process."""
    root = logging.getLogger(ROOT)
    if not any(isinstance(h, _OneWrite) for h in root.handlers):
        handler = _OneWrite()
        handler.setFormatter(_StagePrefix())
        root.addHandler(handler)
        root.propagate = False
    root.setLevel(_level())


def reserve_log_space(fd: int | None = None) -> None:
    """Keep LOG_RESERVE_BYTES allocated past the end of stderr (or `fd`) when it is a regular
    file. Best effort: where the filesystem or the C library cannot allocate ahead, or the
    space is already gone, nothing is reserved and nothing else changes."""
    fallocate = _fallocate()
    try:
        fd = sys.stderr.fileno() if fd is None else fd
        status = os.fstat(fd)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        return
    if fallocate is not None and stat.S_ISREG(status.st_mode):
        fallocate(fd, _FALLOC_FL_KEEP_SIZE, status.st_size, LOG_RESERVE_BYTES)


@functools.cache
def _fallocate():
    """fallocate(2) from the C library the process runs on (Linux), or None."""
    fallocate = getattr(ctypes.CDLL(None, use_errno=True), "fallocate", None)
    if fallocate is not None:
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    return fallocate
