"""Token shards as safetensors files (numpy, no torch), written atomically.

A pair shard holds, for N pairs padded to the longest sequence L of the split:
`pair_id` [N] int64, `prompt_len` [N], `chosen_len` / `rejected_len` [N] (full
lengths, prompt included) and `chosen_ids` / `rejected_ids` [N, L] int32. The
response of row i spans positions [prompt_len[i], *_len[i]).

`PairShardBuilder` collects one split's pairs as flat numpy token streams while a
build runs and writes the padded shard block by block, so neither the pairs' token
lists nor the padded [N, L] arrays are ever held whole. Its bytes equal those of
`write_shard(path, pair_arrays(...))` for the same pairs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from align.data.metadata import read_metadata, single_key_metadata  # noqa: F401  (re-exported)
from align.data.tokenize import TokenizedPair
from align.receipts import atomic_path
from align.utils.weights_hash import read_safetensors_header

PAIR_FORMAT = "align-pairs-v1"
SFT_FORMAT = "align-sft-v1"
# safetensors names and orders tensors by dtype (wider integer first), then by name.
_DTYPE_TAGS = {np.dtype(np.int64): "I64", np.dtype(np.int32): "I32"}
_TAG_DTYPES = {tag: dtype.newbyteorder("<") for dtype, tag in _DTYPE_TAGS.items()}
_HEADER_ALIGN = 8
WRITE_BLOCK_ROWS = 4096


def _padded(rows: Sequence[list[int]], width: int, pad_id: int) -> np.ndarray:
    out = np.full((len(rows), width), pad_id, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


def pair_arrays(
    ids: Sequence[int], pairs: Sequence[TokenizedPair], pad_id: int
) -> dict[str, np.ndarray]:
    chosen = [p.prompt + p.chosen for p in pairs]
    rejected = [p.prompt + p.rejected for p in pairs]
    width = max([1, *map(len, chosen), *map(len, rejected)])
    return {
        "pair_id": np.asarray(ids, dtype=np.int64),
        "prompt_len": np.asarray([len(p.prompt) for p in pairs], dtype=np.int32),
        "chosen_len": np.asarray([len(c) for c in chosen], dtype=np.int32),
        "rejected_len": np.asarray([len(r) for r in rejected], dtype=np.int32),
        "chosen_ids": _padded(chosen, width, pad_id),
        "rejected_ids": _padded(rejected, width, pad_id),
    }


def sft_arrays(rows: Sequence[tuple[list[int], int]], pad_id: int) -> dict[str, np.ndarray]:
    width = max([1, *(len(ids) for ids, _ in rows)])
    return {
        "ids": _padded([ids for ids, _ in rows], width, pad_id),
        "length": np.asarray([len(ids) for ids, _ in rows], dtype=np.int32),
        "prompt_len": np.asarray([p for _, p in rows], dtype=np.int32),
    }


def write_shard(
    path: str | Path, arrays: dict[str, np.ndarray], fmt: str, **metadata: object
) -> None:
    needed = sum(array.nbytes for array in arrays.values())
    with atomic_path(path, needed_bytes=needed) as tmp:
        save_file(arrays, str(tmp), metadata=single_key_metadata({"format": fmt, **metadata}))


def read_shard(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a shard as a read-only view of one memory map of the file.

    Rows are paged in from disk when indexed, so a loader holds only what it batches.
    """
    path = Path(path)
    locations = read_safetensors_header(path)
    unknown = {name: loc.dtype for name, loc in locations.items() if loc.dtype not in _TAG_DTYPES}
    if unknown:
        raise ValueError(
            f"{path}: token shards hold {sorted(_TAG_DTYPES)} tensors, found dtypes {unknown}"
        )
    data = np.memmap(path, dtype=np.uint8, mode="r")
    return {
        name: data[loc.begin : loc.end].view(_TAG_DTYPES[loc.dtype]).reshape(loc.shape)
        for name, loc in locations.items()
    }


@dataclass(frozen=True)
class RowWidths:
    """The longest row that pair shards form in each layout. A batch pads its rows to its
    longest, so the widest batch a stage scores or trains on is exactly this wide."""

    padded: int  # chosen and rejected as two rows: the longer sequence, prompt included
    shared: int  # one prefix-shared row: the prompt, then both responses

    @classmethod
    def of(cls, shards: Iterable[str | Path]) -> RowWidths | None:
        """The widths over every pair shard in `shards`; None when there is none."""
        widths = [cls._of_shard(read_shard(path)) for path in shards]
        if not widths:
            return None
        return cls(max(w.padded for w in widths), max(w.shared for w in widths))

    @classmethod
    def _of_shard(cls, arrays: dict[str, np.ndarray]) -> RowWidths:
        if not len(arrays["pair_id"]):
            return cls(0, 0)
        return cls(
            int(pair_row_widths(arrays, "padded").max()),
            int(pair_row_widths(arrays, "shared").max()),
        )


def pair_row_widths(arrays: dict[str, np.ndarray], layout: str) -> np.ndarray:
    """Each pair's width in a batch of `layout` (align.constants.PAIR_LAYOUTS): its longer
    sequence, prompt included, as two padded rows; the prompt then both responses, shared
    or packed."""
    chosen, rejected = arrays["chosen_len"].astype(np.int64), arrays["rejected_len"]
    if layout != "padded":
        return chosen + rejected - arrays["prompt_len"]
    return np.maximum(chosen, rejected)


def pack_pairs(widths: np.ndarray) -> list[list[int]]:
    """Indices of `widths` grouped into rows no wider than the widest, first fit decreasing:
    the fewest rows this greedy rule finds, fixed by the widths and their order."""
    capacity = int(widths.max())
    rows: list[list[int]] = []
    room: list[int] = []
    for index in np.argsort(-widths, kind="stable"):
        width = int(widths[index])
        fits = next((r for r, left in enumerate(room) if width <= left), None)
        if fits is None:
            rows.append([int(index)])
            room.append(capacity - width)
        else:
            rows[fits].append(int(index))
            room[fits] -= width
    return rows


def layout_rows(widths: np.ndarray, layout: str) -> int:
    """Rows a batch of pairs of these `pair_row_widths` takes in `layout`, each as wide as
    the widest pair."""
    if layout == "padded":
        return 2 * len(widths)
    return len(pack_pairs(widths)) if layout == "packed" else len(widths)


class GrowingArray:
    """A 1-D numpy buffer that doubles its capacity when full."""

    def __init__(self, dtype: type, capacity: int = 1024):
        self._data = np.empty(capacity, dtype=dtype)
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def _reserve(self, extra: int) -> None:
        need = self._size + extra
        if need > len(self._data):
            grown = np.empty(max(need, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self._size] = self._data[: self._size]
            self._data = grown

    def append(self, value: int) -> None:
        self._reserve(1)
        self._data[self._size] = value
        self._size += 1

    def extend(self, values: Sequence[int]) -> None:
        self._reserve(len(values))
        self._data[self._size : self._size + len(values)] = values
        self._size += len(values)

    @property
    def values(self) -> np.ndarray:
        return self._data[: self._size]


class _Tensor:
    """One tensor of a streamed safetensors file: its name, dtype, shape and byte blocks."""

    def __init__(self, name: str, dtype: np.dtype, shape: tuple[int, ...], blocks):
        self.name, self.dtype, self.shape, self.blocks = name, np.dtype(dtype), shape, blocks

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _header(tensors: list[_Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {
            "dtype": _DTYPE_TAGS[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + t.nbytes],
        }
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % _HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text


def write_streamed(path: str | Path, tensors: list[_Tensor], metadata: dict[str, str]) -> str:
    """Write a safetensors file from byte blocks, atomically; return sha256 of its tensor data."""
    ordered = sorted(tensors, key=lambda t: (-t.dtype.itemsize, t.name))
    digest = hashlib.sha256()
    needed = sum(t.nbytes for t in ordered)
    with atomic_path(path, needed_bytes=needed) as tmp, open(tmp, "wb") as fh:
        fh.write(_header(ordered, metadata))
        for t in ordered:
            written = 0
            for block in t.blocks():
                data = np.ascontiguousarray(block, dtype=t.dtype.newbyteorder("<")).tobytes()
                fh.write(data)
                digest.update(data)
                written += len(data)
            if written != t.nbytes:
                raise AssertionError(f"{path}: tensor {t.name} wrote {written} of {t.nbytes} bytes")
    return digest.hexdigest()


class PairShardBuilder:
    """One split's pairs, collected as flat token streams, written as a padded pair shard."""

    def __init__(self) -> None:
        self.pair_id = GrowingArray(np.int64)
        self.prompt_len = GrowingArray(np.int32)
        self.chosen_len = GrowingArray(np.int32)
        self.rejected_len = GrowingArray(np.int32)
        self.chosen_tokens = GrowingArray(np.int32)
        self.rejected_tokens = GrowingArray(np.int32)
        self.truncated = 0

    def __len__(self) -> int:
        return len(self.pair_id)

    def add(self, pid: int, pair: TokenizedPair) -> None:
        self.pair_id.append(pid)
        self.prompt_len.append(len(pair.prompt))
        self.chosen_len.append(len(pair.prompt) + len(pair.chosen))
        self.rejected_len.append(len(pair.prompt) + len(pair.rejected))
        self.chosen_tokens.extend(pair.prompt + pair.chosen)
        self.rejected_tokens.extend(pair.prompt + pair.rejected)
        self.truncated += pair.truncated

    @property
    def width(self) -> int:
        lengths = [self.chosen_len.values, self.rejected_len.values]
        return max([1, *(int(a.max()) for a in lengths if len(a))])

    def summary(self) -> dict[str, object]:
        """Counts and token totals of the split (responses counted with their eos)."""
        prompt = self.prompt_len.values.astype(np.int64)
        chosen = self.chosen_len.values - prompt
        rejected = self.rejected_len.values - prompt
        return {
            "pairs": len(self),
            "truncated_pairs": self.truncated,
            "prompt_tokens": int(prompt.sum()),
            "chosen_tokens": int(chosen.sum()),
            "rejected_tokens": int(rejected.sum()),
            "chosen_longer": int((chosen > rejected).sum()),
            "chosen_longer_fraction": float((chosen > rejected).mean()) if len(self) else 0.0,
        }

    def _padded_blocks(self, tokens: GrowingArray, lengths: GrowingArray, pad_id: int):
        width, flat, lens = self.width, tokens.values, lengths.values.astype(np.int64)
        ends = np.cumsum(lens)

        def blocks() -> Iterator[np.ndarray]:
            for start in range(0, len(lens), WRITE_BLOCK_ROWS):
                stop = min(start + WRITE_BLOCK_ROWS, len(lens))
                block = np.full((stop - start, width), pad_id, dtype=np.int32)
                # Row-major boolean assignment fills each row's prefix in stream order.
                block[np.arange(width)[None, :] < lens[start:stop, None]] = flat[
                    ends[start] - lens[start] : ends[stop - 1]
                ]
                yield block

        return blocks

    def write(self, path: str | Path, pad_id: int, **metadata: object) -> str:
        """Write the shard atomically; return the sha256 of its token data."""
        n, width = len(self), self.width

        def whole(array: GrowingArray):
            return lambda: iter([array.values])

        tensors = [
            _Tensor("pair_id", np.int64, (n,), whole(self.pair_id)),
            _Tensor("prompt_len", np.int32, (n,), whole(self.prompt_len)),
            _Tensor("chosen_len", np.int32, (n,), whole(self.chosen_len)),
            _Tensor("rejected_len", np.int32, (n,), whole(self.rejected_len)),
            _Tensor(
                "chosen_ids",
                np.int32,
                (n, width),
                self._padded_blocks(self.chosen_tokens, self.chosen_len, pad_id),
            ),
            _Tensor(
                "rejected_ids",
                np.int32,
                (n, width),
                self._padded_blocks(self.rejected_tokens, self.rejected_len, pad_id),
            ),
        ]
        metadata = single_key_metadata({"format": PAIR_FORMAT, **metadata})
        return write_streamed(path, tensors, metadata)
