"""Train / held-out split by a stable hash of the normalized prompt.

A prompt's split depends only on its text and the pre-registered seed, so no prompt
can land in two splits and adding rows never moves existing ones.
"""

from __future__ import annotations

import hashlib


def normalize_prompt(prompt: str) -> str:
    return " ".join(prompt.lower().split())


def prompt_unit(prompt: str, seed: int) -> float:
    """A uniform number in [0, 1) fixed by the normalized prompt and the seed."""
    digest = hashlib.sha256(f"{seed}\0{normalize_prompt(prompt)}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of(prompt: str, held_fraction: float, seed: int) -> str:
    """`held` or `train`, by where the prompt's hash falls against the held-out fraction."""
    return "held" if prompt_unit(prompt, seed) < held_fraction else "train"


def pair_digest(prompt: str, chosen: str, rejected: str) -> bytes:
    """sha256 of a pair's content: exact duplicates share it, nothing else does."""
    return hashlib.sha256("\0".join((prompt, chosen, rejected)).encode()).digest()


def pair_id(prompt: str, chosen: str, rejected: str) -> int:
    """A stable 63-bit id of a pair's content; rows are looked up by it, never by position."""
    return id_of_digest(pair_digest(prompt, chosen, rejected))


def id_of_digest(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)
