"""Reading a file that somebody else wrote: the refusal every malformed one ends in, and
the one reader of a checkpoint's JSON files.

A checkpoint's config.json, tokenizer.json, tokenizer_config.json, special_tokens_map.json,
generation_config.json and shard index are untrusted input. Whatever is wrong with one
(missing, unreadable, not UTF-8, not JSON, nested past the parser's depth, or JSON of the
wrong type) is refused with `UntrustedFileRefused` (exit 3) in one line naming the file
and what was expected, never with a traceback. Stdlib only.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align.exit_codes import GateRefused

# The gate named by a refusal of one of a checkpoint's files.
CHECKPOINT_GATE = "checkpoint"
# No checkpoint's text file comes near this (Mistral's tokenizer.json is under 4 MB, a
# 256k-vocabulary one under 40 MB); a larger one is refused before it is read.
MAX_TEXT_BYTES = 256 << 20


class UntrustedFileRefused(GateRefused, ValueError):
    """A checkpoint's or cache's file is malformed or disagrees with what describes it:
    refused (exit 3) naming the file. Also a ValueError, as every malformed file was before."""

    def __init__(self, gate: str, path: str | Path, message: str):
        super().__init__(gate, f"{path}: {message}")
        self.path = Path(path)


def read_untrusted_text(path: str | Path, what: str, gate: str = CHECKPOINT_GATE) -> str:
    """The UTF-8 text of a file of at most MAX_TEXT_BYTES; `what` says what the file should
    hold, for the refusal."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if size > MAX_TEXT_BYTES:
            raise UntrustedFileRefused(
                gate, path, f"expected {what} of at most {MAX_TEXT_BYTES} bytes, found {size}"
            )
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise UntrustedFileRefused(gate, path, f"expected {what} in UTF-8, found {err}") from None
    except OSError as err:
        raise UntrustedFileRefused(gate, path, f"expected {what}, cannot read it ({err})") from None


def read_json_object(path: str | Path, what: str, gate: str = CHECKPOINT_GATE) -> dict[str, Any]:
    """The JSON object in `path`; anything else is refused naming the file and `what`."""
    path = Path(path)
    return parse_json_object(read_untrusted_text(path, what, gate), path, what, gate)


def parse_json_object(
    text: str | bytes, path: str | Path, what: str, gate: str = CHECKPOINT_GATE
) -> dict[str, Any]:
    """`text` (the contents of `path`) parsed as one JSON object, or refused."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise UntrustedFileRefused(
            gate, path, f"expected {what}, found JSON nested deeper than the parser reads"
        ) from None
    except ValueError as err:  # bad UTF-8 and bad JSON alike
        raise UntrustedFileRefused(gate, path, f"expected {what}, found no JSON ({err})") from None
    if not isinstance(value, dict):
        raise UntrustedFileRefused(gate, path, f"expected {what}, found a JSON {json_type(value)}")
    return value


def json_type(value: object) -> str:
    """JSON's name for the type of a parsed value (object, array, string, ...)."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
