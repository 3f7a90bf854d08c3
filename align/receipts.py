"""Atomic JSON receipts and content hashes.

Every stage's main output is a receipt written here: tmp file, fsync, rename, so
a reader sees either the old receipt or the whole new one. Readers verify the
hashes they depend on with `verify_hash`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import socket
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from align import __version__
from align.exit_codes import GateRefused, writing

# 2: receipts name files relative to the results directory (absolute outside it).
SCHEMA_VERSION = 2
PASSED = "PASSED"
FAILED = "FAILED"
DESCOPED = "DESCOPED"
_CHUNK = 1 << 20


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, needed_bytes: int | None = None) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success fsync it and rename it into place.

    A write that runs out of space raises `NoSpaceLeft` naming `path` (and `needed_bytes`,
    what the caller knows it writes), with the temporary file already gone.
    """
    final = Path(path)
    with writing(final, needed_bytes):
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        try:
            os.chmod(tmp_path, 0o666 & ~_umask())
            yield tmp_path
            with open(tmp_path, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp_path, final)
            _fsync_dir(final.parent)
        finally:
            tmp_path.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as pretty, key-sorted JSON atomically."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    with atomic_path(path, needed_bytes=len(text.encode())) as tmp:
        tmp.write_text(text)


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def hash_file(path: str | os.PathLike) -> str:
    """sha256 of a file's bytes, streamed."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def hash_files(paths: Iterable[str | os.PathLike], root: str | os.PathLike | None = None) -> str:
    """One sha256 over several files: each file's relative name and content hash, sorted."""
    digest = hashlib.sha256()
    entries = []
    for p in paths:
        p = Path(p)
        name = str(p.relative_to(root)) if root is not None else p.name
        entries.append((name, hash_file(p)))
    for name, h in sorted(entries):
        digest.update(f"{name}\0{h}\n".encode())
    return digest.hexdigest()


def hash_json(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (sorted keys, no whitespace)."""
    return sha256_bytes(
        json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    )


def now_iso() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds")


def make_receipt(
    stage: str,
    status: str,
    *,
    config_hash: str | None,
    overrides: dict[str, Any] | None,
    inputs: dict[str, str] | None,
    outputs: dict[str, str] | None,
    started_at: str,
    figures: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The common receipt envelope; `figures` holds the stage's own numbers."""
    if status not in (PASSED, FAILED, DESCOPED):
        raise ValueError(f"receipt status must be PASSED, FAILED or DESCOPED, got {status!r}")
    receipt = {
        "schema_version": SCHEMA_VERSION,
        "stage": stage,
        "status": status,
        "config_hash": config_hash,
        "overrides": overrides or {},
        "inputs": inputs or {},
        "outputs": outputs or {},
        "package_version": __version__,
        "host": socket.gethostname(),
        "started_at": started_at,
        "finished_at": now_iso(),
        "figures": figures or {},
    }
    receipt.update(extra)
    return receipt


def load_receipt(path: str | os.PathLike, gate: str, stage: str | None = None) -> dict[str, Any]:
    """Read a receipt for `gate`; refuse a missing, unreadable or foreign-schema one."""
    p = Path(path)
    if not p.exists():
        raise GateRefused(
            gate, f"{p}: receipt missing (expected the output of stage {stage or gate})"
        )
    try:
        receipt = json.loads(p.read_text())
    except (OSError, ValueError) as err:
        raise GateRefused(gate, f"{p}: unreadable receipt ({err})") from err
    if not isinstance(receipt, dict):
        raise GateRefused(
            gate, f"{p}: receipt expected a JSON object, found {type(receipt).__name__}"
        )
    if receipt.get("schema_version") != SCHEMA_VERSION:
        raise GateRefused(
            gate,
            f"{p}: schema_version expected {SCHEMA_VERSION}, found {receipt.get('schema_version')!r}",
        )
    if stage is not None and receipt.get("stage") != stage:
        raise GateRefused(gate, f"{p}: stage expected {stage!r}, found {receipt.get('stage')!r}")
    return receipt


def verify_hash(gate: str, path: str | os.PathLike, expected: str) -> None:
    """Refuse when the file at `path` no longer has the content hash a receipt recorded."""
    p = Path(path)
    if not p.exists():
        raise GateRefused(gate, f"{p}: file missing (receipt recorded hash {expected[:12]})")
    found = hash_file(p)
    if found != expected:
        raise GateRefused(gate, f"{p}: content hash expected {expected[:12]}, found {found[:12]}")
