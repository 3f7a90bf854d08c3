"""The reference log-prob cache, its six-component key, and its part files (no torch).

A cache file holds per-pair summed reference log-probs, looked up by pair id, and
in its safetensors metadata the key it was built under: checkpoint weight bytes,
tokenizer, shard content, seq_len + truncation, dtype and forward_impl. A reader
recomputes the key it expects and refuses any difference, naming the component.
The metadata also records the hash of the cache's own tensor bytes (and the
ref_cache receipt records it again), so a flipped byte in the log-probs is refused
by the gate and again by the loader, rather than trained against.

While a cache is computed, each finished slice of rows is a part file in
`<cache>.parts/` that carries the same key and the rows it covers, so a restarted
precompute can tell which slices it may reuse (align.stages.ref_precompute).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import numpy as np

from align.constants import PAIR_LAYOUTS
from align.data.metadata import read_metadata, single_key_metadata
from align.exit_codes import GateRefused
from align.model.tokenizer_hash import tokenizer_hash
from align.receipts import atomic_path, hash_file
from align.utils.weights_hash import file_tensors_hash, raw_tensors_hash, weights_hash


@dataclass(frozen=True)
class CacheKey:
    """What a cache was computed from: any difference makes it another cache."""

    # Hash of the reference checkpoint's weight bytes.
    checkpoint_weights: str
    # Hash of the tokenizer files the shard was tokenized with.
    tokenizer: str
    # Hash of the pair shard's file.
    shard: str
    # `seq_len:truncation`, how rows were cut.
    seq_len_truncation: str
    # The dtype the reference computed in.
    dtype: str
    # The forward path (forward_impl_name): attention, dtype, batch and layout.
    forward_impl: str

    @classmethod
    def of(cls, stored: Any, where: str | Path, gate: str) -> Self:
        """The key as a file's metadata stores it; a missing or foreign component is refused."""
        if not isinstance(stored, dict) or set(stored) != set(KEY_COMPONENTS):
            found = sorted(stored) if isinstance(stored, dict) else type(stored).__name__
            raise GateRefused(gate, f"{where}: key expected {list(KEY_COMPONENTS)}, found {found}")
        return cls(**{name: str(stored[name]) for name in KEY_COMPONENTS})

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    def mismatch(self, expected: CacheKey) -> str | None:
        """The first component that differs, as `component 'x' expected .., found ..`."""
        for component in KEY_COMPONENTS:
            found, wanted = getattr(self, component), getattr(expected, component)
            if found != wanted:
                return f"key component {component!r} expected {wanted!r}, found {found!r}"
        return None


KEY_COMPONENTS = tuple(f.name for f in dataclasses.fields(CacheKey))
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
GATE = "ref_cache"
CACHE_FORMAT = "align-ref-cache-v1"
PART_FORMAT = "align-ref-cache-part-v1"
PART_SUFFIX = ".safetensors"
# The metadata field (and ref_cache receipt field) with the hash of the cache's tensors.
TENSORS_HASH = "tensors_hash"
_SAFETENSORS_DTYPES = {"int64": "I64", "float32": "F32"}


def forward_impl_name(
    attn_implementation: str, dtype: str, batch_size: int, layout: str = "padded"
) -> str:
    """A name that fully describes a forward path, e.g. `sdpa-fp32-b16-padded`; the last
    part is the batch layout (align.constants.PAIR_LAYOUTS)."""
    return f"{attn_implementation}-{DTYPE_TAGS[dtype]}-b{batch_size}-{layout}"


def ref_forward_impl(ref) -> str:
    """The forward path a pre-registration's `[ref]` section builds its cache with."""
    return forward_impl_name(ref.attn_implementation, ref.dtype, ref.batch_size, ref.layout)


def parse_forward_impl(name: str) -> dict[str, object]:
    """Invert `forward_impl_name`: {attn_implementation, dtype, batch_size, layout}."""
    parts = name.split("-")
    tags = {tag: dtype for dtype, tag in DTYPE_TAGS.items()}
    if (
        len(parts) != 4
        or parts[1] not in tags
        or not parts[2].startswith("b")
        or not parts[2][1:].isdigit()
        or parts[3] not in PAIR_LAYOUTS
    ):
        raise ValueError(
            f"forward_impl {name!r} is not of the form "
            f"<attn>-<fp32|bf16|fp16>-b<batch>-<{'|'.join(PAIR_LAYOUTS)}>"
        )
    return {
        "attn_implementation": parts[0],
        "dtype": tags[parts[1]],
        "batch_size": int(parts[2][1:]),
        "layout": parts[3],
    }


def expected_key(
    checkpoint: str | Path,
    shard: str | Path,
    seq_len: int,
    truncation: str,
    dtype: str,
    forward_impl: str,
    checkpoint_weights: str | None = None,
) -> CacheKey:
    """The six components; `checkpoint_weights` skips re-hashing a checkpoint already verified."""
    return CacheKey(
        checkpoint_weights=checkpoint_weights or weights_hash(checkpoint),
        tokenizer=tokenizer_hash(checkpoint),
        shard=hash_file(shard),
        seq_len_truncation=f"{seq_len}:{truncation}",
        dtype=dtype,
        forward_impl=forward_impl,
    )


def _arrays(pair_ids: np.ndarray, chosen: np.ndarray, rejected: np.ndarray) -> dict:
    import numpy as np

    return {
        "pair_id": np.ascontiguousarray(pair_ids, dtype=np.int64),
        "chosen_logps": np.ascontiguousarray(chosen, dtype=np.float32),
        "rejected_logps": np.ascontiguousarray(rejected, dtype=np.float32),
    }


def _save(path: str | Path, arrays: dict, metadata: dict[str, object]) -> None:
    from safetensors.numpy import save_file

    needed = sum(array.nbytes for array in arrays.values())
    with atomic_path(path, needed_bytes=needed) as tmp:
        save_file(arrays, str(tmp), metadata=single_key_metadata(metadata))


def arrays_tensors_hash(arrays: dict[str, np.ndarray]) -> str:
    """The hash `file_tensors_hash` gives the file these arrays are saved in."""
    return raw_tensors_hash(
        {
            name: (
                # Another dtype cannot be a cache's; its own name makes the hash differ.
                _SAFETENSORS_DTYPES.get(a.dtype.name, a.dtype.str),
                a.shape,
                a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(),
            )
            for name, a in arrays.items()
        }
    )


def write_ref_cache(
    path: str | Path,
    pair_ids: np.ndarray,
    chosen: np.ndarray,
    rejected: np.ndarray,
    key: CacheKey,
) -> str:
    """Write the cache sorted by pair id, its key and tensor hash in the metadata; returns that hash."""
    import numpy as np

    order = np.argsort(pair_ids, kind="stable")
    arrays = _arrays(pair_ids[order], chosen[order], rejected[order])
    content = arrays_tensors_hash(arrays)
    _save(path, arrays, {"format": CACHE_FORMAT, "key": key.as_dict(), TENSORS_HASH: content})
    return content


def parts_dir(cache: str | Path) -> Path:
    """Where the part files of `cache` live while it is being computed."""
    cache = Path(cache)
    return cache.with_name(cache.name + ".parts")


def part_path(parts: Path, index: int) -> Path:
    return parts / f"slice-{index:06d}{PART_SUFFIX}"


def write_cache_part(
    parts: Path,
    index: int,
    rows: tuple[int, int, int],
    pair_ids: np.ndarray,
    chosen: np.ndarray,
    rejected: np.ndarray,
    key: CacheKey,
) -> Path:
    """Write slice `index`, rows (start, stop, of total), atomically; returns its path."""
    start, stop, total = rows
    path = part_path(parts, index)
    metadata = {
        "format": PART_FORMAT,
        "key": key.as_dict(),
        "slice": {"index": index, "start": start, "stop": stop, "total": total},
    }
    _save(path, _arrays(pair_ids, chosen, rejected), metadata)
    return path


def read_cache_part(path: str | Path) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """(metadata, arrays) of a part file; ValueError when it is not one."""
    from safetensors.numpy import load_file

    try:
        metadata = read_metadata(path)
        arrays = load_file(str(path))
    except Exception as err:  # a foreign or damaged file: the caller reports and discards it
        raise ValueError(f"unreadable ({type(err).__name__}: {err})") from err
    if metadata.get("format") != PART_FORMAT or not {"key", "slice"} <= set(metadata):
        raise ValueError(f"expected a reference cache part ({PART_FORMAT}) with key and slice")
    if set(arrays) != {"pair_id", "chosen_logps", "rejected_logps"}:
        raise ValueError(f"expected pair_id, chosen_logps, rejected_logps, found {sorted(arrays)}")
    return metadata, arrays


def read_cache_key(path: str | Path, gate: str = GATE) -> CacheKey:
    p = Path(path)
    if not p.exists():
        raise GateRefused(gate, f"{p}: reference cache missing")
    metadata = read_metadata(p)
    if metadata.get("format") != CACHE_FORMAT or "key" not in metadata:
        raise GateRefused(
            gate, f"{p}: expected a reference cache ({CACHE_FORMAT}) with a key in its metadata"
        )
    return CacheKey.of(metadata["key"], p, gate)


def check_key(path: str | Path, expected: CacheKey, gate: str = GATE) -> None:
    """Refuse a cache whose stored key differs from `expected` in any component."""
    mismatch = read_cache_key(path, gate).mismatch(expected)
    if mismatch:
        raise GateRefused(gate, f"{path}: {mismatch}")


def check_tensors(path: str | Path, recorded: str, receipt: str | Path, gate: str = GATE) -> None:
    """Refuse a cache whose tensor bytes, or its metadata, disagree with the hash `receipt` records.

    The receipt is the reference: a file edited and re-hashed into its own metadata
    still differs from it. Reads the file's bytes once; no numpy.
    """
    found = file_tensors_hash(path)
    if found != recorded:
        raise GateRefused(
            gate,
            f"{path}: tensor bytes hash expected {recorded[:12]} (recorded by {receipt}), "
            f"found {found[:12]}",
        )
    in_metadata = str(read_metadata(path).get(TENSORS_HASH))
    if in_metadata != recorded:
        raise GateRefused(
            gate,
            f"{path}: metadata {TENSORS_HASH} expected {recorded[:12]} (recorded by "
            f"{receipt}), found {in_metadata[:12]}",
        )


def load_ref_cache(
    path: str | Path, expected: CacheKey, pair_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Verify the key and the loaded bytes, then return (chosen, rejected) aligned to `pair_ids`."""
    import numpy as np
    from safetensors.numpy import load_file

    check_key(path, expected)
    arrays = load_file(str(path))
    recorded = str(read_metadata(path).get(TENSORS_HASH))
    found = arrays_tensors_hash(arrays)
    if found != recorded:
        raise GateRefused(
            GATE,
            f"{path}: tensor bytes hash expected {recorded[:12]} (its metadata), found {found[:12]}",
        )
    cached_ids, chosen, rejected = (
        arrays[name] for name in ("pair_id", "chosen_logps", "rejected_logps")
    )
    index = {int(pid): i for i, pid in enumerate(cached_ids)}
    missing = [int(p) for p in pair_ids if int(p) not in index]
    if missing:
        raise GateRefused(
            GATE, f"{path}: {len(missing)} pair ids missing from the cache (first: {missing[0]})"
        )
    extra = len(index) - len(set(map(int, pair_ids)))
    if extra:
        raise GateRefused(GATE, f"{path}: cache holds {extra} pair ids that the shard does not")
    rows = np.asarray([index[int(p)] for p in pair_ids])
    return chosen[rows], rejected[rows]
