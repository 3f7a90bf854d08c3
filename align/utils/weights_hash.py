"""Locating a checkpoint's safetensors tensors, and the content hash of its weights
(or of the tensors of any one safetensors file, such as a reference cache).

Stdlib only: the safetensors header (8-byte little-endian length, then JSON with
dtype, shape and data_offsets per tensor) is parsed here directly, so a gate can
fingerprint weights without importing torch. The hash covers tensor names,
dtypes, shapes and bytes, and nothing about how the tensors are split into files.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
HASH_VERSION = b"align-weights-sha256-v1\n"
CHUNK_BYTES = 1 << 20
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's raw bytes lie: file and absolute byte range [begin, end)."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def checkpoint_layout(checkpoint_dir: str | Path) -> dict[Path, frozenset[str] | None]:
    """Each safetensors file of the checkpoint, with the tensor names its index assigns to it.

    The names are None for a single-file checkpoint (there is no index to check against).
    """
    root = Path(checkpoint_dir)
    single, index = root / SINGLE_FILE_NAME, root / INDEX_FILE_NAME
    if single.is_file() and index.is_file():
        raise ValueError(
            f"{root} holds both {SINGLE_FILE_NAME} and {INDEX_FILE_NAME}; which is meant?"
        )
    if single.is_file():
        return {single: None}
    if not index.is_file():
        raise FileNotFoundError(f"no {SINGLE_FILE_NAME} or {INDEX_FILE_NAME} in {root}")
    names_by_file: dict[str, set[str]] = defaultdict(set)
    for name, file_name in read_weight_map(index).items():
        names_by_file[file_name].add(name)
    layout: dict[Path, frozenset[str] | None] = {}
    for file_name in sorted(names_by_file):
        shard = root / file_name
        if not shard.is_file():
            raise FileNotFoundError(f"shard {shard} listed in {index} is missing")
        layout[shard] = frozenset(names_by_file[file_name])
    return layout


def read_safetensors_header(path: Path) -> dict[str, TensorLocation]:
    """Parse one safetensors file's header into tensor locations, validating the offsets."""
    file_size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{path} is too short to be a safetensors file")
        (header_bytes,) = struct.unpack("<Q", prefix)
        if header_bytes > min(file_size - 8, _MAX_HEADER_BYTES):
            raise ValueError(f"{path} declares a {header_bytes}-byte header that cannot be right")
        header = json.loads(handle.read(header_bytes))
    header.pop("__metadata__", None)
    data_start = 8 + header_bytes
    locations = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        if not 0 <= begin <= end <= file_size - data_start:
            raise ValueError(f"tensor {name!r} in {path} has data_offsets outside the file")
        locations[name] = TensorLocation(
            path, entry["dtype"], tuple(entry["shape"]), data_start + begin, data_start + end
        )
    return locations


def checkpoint_tensors(checkpoint_dir: str | Path) -> dict[str, TensorLocation]:
    """Every tensor of the checkpoint across its files, checked against the shard index."""
    tensors: dict[str, TensorLocation] = {}
    for path, indexed_names in checkpoint_layout(checkpoint_dir).items():
        found = read_safetensors_header(path)
        if indexed_names is not None:
            _check_shard_matches_index(path, indexed_names, set(found))
        duplicated = sorted(set(found) & set(tensors))
        if duplicated:
            raise ValueError(f"tensors {duplicated} in {path} also appear in another shard")
        tensors.update(found)
    return tensors


def weights_hash(checkpoint_dir: str | Path) -> str:
    """sha256 hex digest of the checkpoint's tensors, independent of file names and sharding."""
    return tensors_hash(checkpoint_tensors(checkpoint_dir))


def file_tensors_hash(path: str | Path) -> str:
    """The same hash over the tensors of one safetensors file (its metadata excluded)."""
    return tensors_hash(read_safetensors_header(Path(path)))


def tensors_hash(tensors: dict[str, TensorLocation]) -> str:
    """sha256 over each tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.sha256(HASH_VERSION)
    with ExitStack() as stack:
        handles: dict[Path, BinaryIO] = {}
        for name in sorted(tensors):
            location = tensors[name]
            if location.path not in handles:
                handles[location.path] = stack.enter_context(location.path.open("rb"))
            _describe(
                digest.update, name, location.dtype, location.shape, location.end - location.begin
            )
            _feed_bytes(digest.update, handles[location.path], location.begin, location.end)
    return digest.hexdigest()


def raw_tensors_hash(tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> str:
    """`tensors_hash` of tensors held in memory: name -> (safetensors dtype, shape, little-endian bytes)."""
    digest = hashlib.sha256(HASH_VERSION)
    for name in sorted(tensors):
        dtype, shape, data = tensors[name]
        _describe(digest.update, name, dtype, shape, len(data))
        digest.update(data)
    return digest.hexdigest()


def _describe(
    update: Callable[[bytes], None], name: str, dtype: str, shape: tuple[int, ...], nbytes: int
) -> None:
    update(json.dumps([name, dtype, list(shape)]).encode("utf-8") + b"\n")
    update(struct.pack("<Q", nbytes))


def _feed_bytes(update: Callable[[bytes], None], handle: BinaryIO, begin: int, end: int) -> None:
    handle.seek(begin)
    remaining = end - begin
    while remaining:
        chunk = handle.read(min(CHUNK_BYTES, remaining))
        if not chunk:
            raise ValueError(f"{handle.name} ended before byte {end}")
        update(chunk)
        remaining -= len(chunk)


def read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file map; shards must lie beside the index."""
    with index.open(encoding="utf-8") as handle:
        weight_map = json.load(handle).get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(file_name, str) for file_name in weight_map.values()
    ):
        raise ValueError(f"{index} has no weight_map of tensor name -> shard file")
    for file_name in set(weight_map.values()):
        if os.path.basename(file_name) != file_name:
            raise ValueError(f"{index} names shard {file_name!r} outside the checkpoint directory")
    return weight_map


def _check_shard_matches_index(path: Path, indexed: frozenset[str], found: set[str]) -> None:
    missing = sorted(indexed - found)
    if missing:
        raise ValueError(f"tensors {missing} listed in the index are not in shard {path}")
    unlisted = sorted(found - indexed)
    if unlisted:
        raise ValueError(f"tensors {unlisted} in shard {path} are not listed in the index")


def weights_fingerprint(checkpoint_dir: str | Path) -> dict[str, list[int]]:
    """(size, mtime_ns) of every weight file: cheap evidence that a hashed checkpoint is unchanged."""
    return {
        path.name: [path.stat().st_size, path.stat().st_mtime_ns]
        for path in sorted(checkpoint_layout(checkpoint_dir))
    }


def read_safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, read from its header alone."""
    with open(path, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return header.get("__metadata__") or {}
