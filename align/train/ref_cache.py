"""The reference log-prob cache and its six-component key (no torch).

A cache file holds per-pair summed reference log-probs, looked up by pair id, and
in its safetensors metadata the key it was built under: checkpoint weight bytes,
tokenizer, shard content, seq_len + truncation, dtype and forward_impl. A reader
recomputes the key it expects and refuses any difference, naming the component.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from align.data.metadata import read_metadata, single_key_metadata
from align.exit_codes import GateRefused
from align.model.tokenizer_hash import tokenizer_hash
from align.model.weights_hash import weights_hash
from align.receipts import atomic_path, hash_file

KEY_COMPONENTS = (
    "checkpoint_weights",
    "tokenizer",
    "shard",
    "seq_len_truncation",
    "dtype",
    "forward_impl",
)
DTYPE_TAGS = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
GATE = "ref_cache"
CACHE_FORMAT = "align-ref-cache-v1"


def forward_impl_name(
    attn_implementation: str, dtype: str, batch_size: int, padding: str = "padded"
) -> str:
    """A name that fully describes a forward path, e.g. `sdpa-fp32-b16-padded`."""
    return f"{attn_implementation}-{DTYPE_TAGS[dtype]}-b{batch_size}-{padding}"


def parse_forward_impl(name: str) -> dict[str, object]:
    """Invert `forward_impl_name`: {attn_implementation, dtype, batch_size, padding}."""
    parts = name.split("-")
    tags = {tag: dtype for dtype, tag in DTYPE_TAGS.items()}
    if (
        len(parts) != 4
        or parts[1] not in tags
        or not parts[2].startswith("b")
        or not parts[2][1:].isdigit()
    ):
        raise ValueError(
            f"forward_impl {name!r} is not of the form <attn>-<fp32|bf16|fp16>-b<batch>-<padding>"
        )
    return {
        "attn_implementation": parts[0],
        "dtype": tags[parts[1]],
        "batch_size": int(parts[2][1:]),
        "padding": parts[3],
    }


def expected_key(
    checkpoint: str | Path,
    shard: str | Path,
    seq_len: int,
    truncation: str,
    dtype: str,
    forward_impl: str,
    checkpoint_weights: str | None = None,
) -> dict[str, str]:
    """The six components; `checkpoint_weights` skips re-hashing a checkpoint already verified."""
    return {
        "checkpoint_weights": checkpoint_weights or weights_hash(checkpoint),
        "tokenizer": tokenizer_hash(checkpoint),
        "shard": hash_file(shard),
        "seq_len_truncation": f"{seq_len}:{truncation}",
        "dtype": dtype,
        "forward_impl": forward_impl,
    }


def write_ref_cache(
    path: str | Path,
    pair_ids: np.ndarray,
    chosen: np.ndarray,
    rejected: np.ndarray,
    key: dict[str, str],
) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    order = np.argsort(pair_ids, kind="stable")
    arrays = {
        "pair_id": np.ascontiguousarray(pair_ids[order], dtype=np.int64),
        "chosen_logps": np.ascontiguousarray(chosen[order], dtype=np.float32),
        "rejected_logps": np.ascontiguousarray(rejected[order], dtype=np.float32),
    }
    with atomic_path(path) as tmp:
        save_file(
            arrays, str(tmp), metadata=single_key_metadata({"format": CACHE_FORMAT, "key": key})
        )


def read_cache_key(path: str | Path, gate: str = GATE) -> dict[str, str]:
    p = Path(path)
    if not p.exists():
        raise GateRefused(gate, f"{p}: reference cache missing")
    metadata = read_metadata(p)
    if metadata.get("format") != CACHE_FORMAT or "key" not in metadata:
        raise GateRefused(
            gate, f"{p}: expected a reference cache ({CACHE_FORMAT}) with a key in its metadata"
        )
    return metadata["key"]


def check_key(path: str | Path, expected: dict[str, str], gate: str = GATE) -> None:
    """Refuse a cache whose stored key differs from `expected` in any component."""
    found = read_cache_key(path, gate)
    for component in KEY_COMPONENTS:
        if found.get(component) != expected[component]:
            raise GateRefused(
                gate,
                f"{path}: key component {component!r} expected {expected[component]!r}, found {found.get(component)!r}",
            )


def load_ref_cache(
    path: str | Path, expected: dict[str, str], pair_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Verify the key, then return (chosen, rejected) log-probs aligned to `pair_ids`."""
    import numpy as np
    from safetensors import safe_open

    check_key(path, expected)
    with safe_open(str(path), framework="numpy") as f:
        cached_ids = f.get_tensor("pair_id")
        chosen = f.get_tensor("chosen_logps")
        rejected = f.get_tensor("rejected_logps")
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
