"""The pre-registrations the workflow reads, once per version of each file: the DAG asks
for them on behalf of every job."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from align.config import load_config


def cached_config(path: str | Path, cls: type) -> Any:
    """The config at `path` as `cls`, loaded again only when the file changes (its mtime or
    size); callers read it and never change it. A missing file is refused, naming it."""
    if not Path(path).is_file():
        return load_config(path, cls).cfg
    stat = Path(path).stat()
    return _loaded(str(path), cls, stat.st_mtime_ns, stat.st_size)


@functools.cache
def _loaded(path: str, cls: type, mtime_ns: int, size: int) -> Any:
    return load_config(path, cls).cfg
