"""align's metadata in safetensors files: one JSON key, readable without numpy or torch."""

from __future__ import annotations

import json
from pathlib import Path

from align.utils.weights_hash import read_safetensors_metadata


def single_key_metadata(metadata: dict[str, object]) -> dict[str, str]:
    """safetensors writes metadata keys in no fixed order; one key keeps the bytes reproducible."""
    return {"align": json.dumps(metadata, sort_keys=True)}


def read_metadata(path: str | Path) -> dict[str, object]:
    raw = read_safetensors_metadata(path)
    return json.loads(raw["align"]) if "align" in raw else {}
