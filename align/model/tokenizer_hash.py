"""Which files define a checkpoint's tokenization, and their hash (stdlib only: gates use it)."""

from __future__ import annotations

import os
from pathlib import Path

from align.receipts import hash_files

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"


def tokenizer_files(checkpoint_dir: str | os.PathLike) -> list[Path]:
    """The files that define a checkpoint's tokenization; the optional ones only if present."""
    directory = Path(checkpoint_dir)
    files = [directory / TOKENIZER_FILE, directory / CONFIG_FILE]
    for optional in (CHAT_TEMPLATE_FILE, SPECIAL_TOKENS_MAP_FILE):
        if (directory / optional).is_file():
            files.append(directory / optional)
    return files


def tokenizer_hash(checkpoint_dir: str | os.PathLike) -> str:
    """sha256 over the content of a checkpoint's tokenizer files."""
    return hash_files(tokenizer_files(checkpoint_dir), root=checkpoint_dir)
