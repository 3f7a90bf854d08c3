"""Locating a checkpoint's safetensors tensors, and the content hash of its weights
(or of the tensors of any one safetensors file, such as a reference cache).

Stdlib only: the safetensors header (8-byte little-endian length, then JSON with
dtype, shape and data_offsets per tensor) is parsed here directly, so a gate can
fingerprint weights without importing torch. The hash covers tensor names,
dtypes, shapes and bytes, and nothing about how the tensors are split into files.

Every safetensors file is untrusted input: its header is bounded by the file size and
checked entry by entry (dtype, shape, offsets that tile the data exactly, as the
safetensors library itself demands) before anything reads or allocates from it. A bad
one is refused with `UntrustedFileRefused` (exit 3), naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from align.utils.untrusted import (
    CHECKPOINT_GATE,
    UntrustedFileRefused,
    parse_json_object,
    read_json_object,
)

SINGLE_FILE_NAME = "model.safetensors"
INDEX_FILE_NAME = "model.safetensors.index.json"
HASH_VERSION = b"align-weights-sha256-v1\n"
CHUNK_BYTES = 1 << 20
INDEX_EXPECTED = "a JSON object whose weight_map maps tensor names to shard files"
# The safetensors library's own ceiling on a header.
_MAX_HEADER_BYTES = 100 << 20
# Bytes per element of every safetensors dtype of whole bytes.
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def _refuse(path: Path, message: str) -> UntrustedFileRefused:
    return UntrustedFileRefused("safetensors", path, message)


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
    """Parse one safetensors file's header into tensor locations, validating every entry."""
    return _parse_header(Path(path))[1]


def _parse_header(path: Path) -> tuple[dict[str, str], dict[str, TensorLocation]]:
    """(metadata, tensor locations) of one safetensors file, its header checked in full."""
    header, data_start, file_size = _read_header_object(path)
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise _refuse(path, f"__metadata__ {metadata!r:.200} is not an object of strings")
    data_bytes = file_size - data_start
    locations = {
        name: _tensor_location(path, name, entry, data_start, data_bytes)
        for name, entry in header.items()
    }
    _check_tiling(path, locations, data_start, data_bytes)
    return metadata, locations


def _read_header_object(path: Path) -> tuple[dict[str, Any], int, int]:
    """(the header's JSON object, where the data begins, the file size); the declared
    length is bounded by the file before a byte of the header is read."""
    file_size = path.stat().st_size
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise _refuse(path, f"{file_size} bytes is too short for a safetensors file")
        (header_bytes,) = struct.unpack("<Q", prefix)
        limit = min(file_size - 8, _MAX_HEADER_BYTES)
        if header_bytes > limit:
            raise _refuse(
                path,
                f"header length expected at most {limit} bytes (file size {file_size}), "
                f"found {header_bytes}",
            )
        raw = handle.read(header_bytes)
    header = parse_json_object(raw, path, "a header of one JSON object", gate="safetensors")
    return header, 8 + header_bytes, file_size


def _tensor_location(
    path: Path, name: str, entry: object, data_start: int, data_bytes: int
) -> TensorLocation:
    """One header entry checked: a known dtype, a shape of counts, offsets inside the data
    that span exactly the bytes the dtype and shape need."""
    if not isinstance(entry, dict):
        raise _refuse(path, f"tensor {name!r} expected an object, found {type(entry).__name__}")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _DTYPE_BYTES:
        raise _refuse(path, f"tensor {name!r} dtype {dtype!r:.100} is not a safetensors dtype")
    if not isinstance(shape, list) or not all(map(_is_count, shape)):
        raise _refuse(path, f"tensor {name!r} shape {shape!r:.200} is not a list of counts")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_count, offsets))):
        raise _refuse(path, f"tensor {name!r} data_offsets {offsets!r:.200} is not [begin, end]")
    begin, end = offsets
    if not begin <= end <= data_bytes:
        raise _refuse(
            path,
            f"tensor {name!r} has data_offsets {offsets} outside the file "
            f"({data_bytes} data bytes)",
        )
    nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
    if nbytes != end - begin:
        raise _refuse(
            path,
            f"tensor {name!r} of dtype {dtype} and shape {shape} needs {nbytes} bytes, "
            f"its data_offsets span {end - begin}",
        )
    return TensorLocation(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_tiling(
    path: Path, locations: dict[str, TensorLocation], data_start: int, data_bytes: int
) -> None:
    """The tensors tile the data with no hole, overlap or trailing byte (safetensors' rule)."""
    covered = 0
    for name, location in sorted(locations.items(), key=lambda item: item[1].begin):
        if location.begin - data_start != covered:
            raise _refuse(
                path,
                f"tensor {name!r} expected to begin at data byte {covered}, found "
                f"{location.begin - data_start} (holes and overlaps are refused)",
            )
        covered = location.end - data_start
    if covered != data_bytes:
        raise _refuse(path, f"tensors expected to end at data byte {data_bytes}, found {covered}")


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def checkpoint_tensors(checkpoint_dir: str | Path) -> dict[str, TensorLocation]:
    """Every tensor of the checkpoint across its files, checked against the shard index."""
    tensors: dict[str, TensorLocation] = {}
    for path, indexed_names in checkpoint_layout(checkpoint_dir).items():
        found = read_safetensors_header(path)
        if indexed_names is not None:
            _check_shard_matches_index(path, indexed_names, set(found))
        duplicated = sorted(set(found) & set(tensors))
        if duplicated:
            raise UntrustedFileRefused(
                "checkpoint", path, f"tensors {duplicated} also appear in another shard"
            )
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
            raise _refuse(Path(handle.name), f"ended before byte {end}")
        update(chunk)
        remaining -= len(chunk)


def read_weight_map(index: Path) -> dict[str, str]:
    """The index's tensor name -> shard file map; shards must lie beside the index."""
    content = read_json_object(index, INDEX_EXPECTED)
    weight_map = content.get("weight_map")
    if not isinstance(weight_map, dict) or not all(
        isinstance(file_name, str) for file_name in weight_map.values()
    ):
        raise UntrustedFileRefused(
            CHECKPOINT_GATE, index, f"expected {INDEX_EXPECTED}, found no such weight_map"
        )
    for file_name in set(weight_map.values()):
        if os.path.basename(file_name) != file_name:
            raise UntrustedFileRefused(
                CHECKPOINT_GATE,
                index,
                f"names shard {file_name!r} outside the checkpoint directory",
            )
    return weight_map


def _check_shard_matches_index(path: Path, indexed: frozenset[str], found: set[str]) -> None:
    missing = sorted(indexed - found)
    if missing:
        raise UntrustedFileRefused(
            "checkpoint", path, f"tensors {missing} listed in the index are not in this shard"
        )
    unlisted = sorted(found - indexed)
    if unlisted:
        raise UntrustedFileRefused(
            "checkpoint", path, f"tensors {unlisted} in this shard are not listed in the index"
        )


def weights_fingerprint(checkpoint_dir: str | Path) -> dict[str, list[int]]:
    """(size, mtime_ns) of every weight file: cheap evidence that a hashed checkpoint is unchanged."""
    return {
        path.name: [path.stat().st_size, path.stat().st_mtime_ns]
        for path in sorted(checkpoint_layout(checkpoint_dir))
    }


def read_safetensors_metadata(path: str | Path) -> dict[str, str]:
    """The `__metadata__` of a safetensors file, read from its header alone (checked in full)."""
    return _parse_header(Path(path))[0]
