"""Which files make an HF checkpoint directory: what a rule lists as inputs, what an export carries.

A checkpoint downloaded from the hub or written by transformers has config.json,
its weights as one `model.safetensors` or as `model.safetensors.index.json` plus
every shard that index names, and the tokenizer (`tokenizer.json`,
`tokenizer_config.json`). It may also have files that travel with the weights:
`special_tokens_map.json`, `generation_config.json`, `chat_template.jinja`, and the
sentencepiece `tokenizer.model`. A dry run may plan with a sharded checkpoint whose
shards are not downloaded yet (`planned_checkpoint_files`); nothing else accepts one.
Stdlib only: the Snakefile calls this while it builds the DAG.
"""

from __future__ import annotations

import os
from pathlib import Path

from align.exit_codes import ConfigError
from align.model.tokenizer_hash import (
    CHAT_TEMPLATE_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_FILE,
)
from align.model.tokenizer_hash import CONFIG_FILE as TOKENIZER_CONFIG_FILE
from align.utils.weights_hash import INDEX_FILE_NAME, SINGLE_FILE_NAME, read_weight_map

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
# Present in many checkpoints, absent in others; listed and carried over when present.
COMPANION_FILES = (
    SPECIAL_TOKENS_MAP_FILE,
    CHAT_TEMPLATE_FILE,
    "tokenizer.model",
    GENERATION_CONFIG_FILE,
)
# How a missing shard is named: by the index that lists it.
SHARD_NAMED = f" (named by {INDEX_FILE_NAME})"


class NotACheckpoint(ConfigError):
    """A directory named as a checkpoint lacks files that every checkpoint has."""


def checkpoint_files(directory: str | os.PathLike) -> list[Path]:
    """Every file of the checkpoint in `directory`, refusing one that is not a checkpoint.

    The refusal names everything missing at once: a required file, the weights, or a
    shard that the index names.
    """
    root = Path(directory)
    files, missing = _survey(root)
    if missing:
        raise NotACheckpoint(_not_a_checkpoint(root, missing))
    return files


def planned_checkpoint_files(directory: str | os.PathLike) -> tuple[list[Path], list[str]]:
    """(the files present, the shards missing) of a checkpoint whose weights may not be here.

    What a dry run plans with: a hub checkpoint's small files (config, tokenizer and the
    shard index, which records the weights' total size) downloaded without its shards.
    Anything else missing is refused as by `checkpoint_files`.
    """
    root = Path(directory)
    files, missing = _survey(root)
    shards = [name for name in missing if name.endswith(SHARD_NAMED)]
    others = [name for name in missing if not name.endswith(SHARD_NAMED)]
    if others:
        raise NotACheckpoint(_not_a_checkpoint(root, missing))
    return files, shards


def _survey(root: Path) -> tuple[list[Path], list[str]]:
    """(the checkpoint files present, the names of those missing) of `root`."""
    if not root.is_dir():
        raise NotACheckpoint(f"checkpoint {root}: no such directory")
    required = [root / name for name in (CONFIG_FILE, *TOKENIZER_FILES)]
    missing = [path.name for path in required if not path.is_file()]
    weights, weights_missing = _weight_files(root)
    present = [path for path in required if path.is_file()]
    companions = [root / name for name in COMPANION_FILES if (root / name).is_file()]
    return sorted([*present, *weights, *companions]), missing + weights_missing


def _not_a_checkpoint(root: Path, missing: list[str]) -> str:
    return (
        f"{root} is not a checkpoint directory: missing {', '.join(missing)} "
        f"(expected {CONFIG_FILE}, {SINGLE_FILE_NAME} or {INDEX_FILE_NAME} with every "
        f"shard it names, and {' and '.join(TOKENIZER_FILES)})"
    )


def companion_files(directory: str | os.PathLike) -> list[Path]:
    """The tokenizer and companion files an exported checkpoint copies from its source.

    tokenizer.json must be there; the others are copied when present.
    """
    root = Path(directory)
    if not (root / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{root} has no {TOKENIZER_FILE} to copy")
    names = (*TOKENIZER_FILES, *COMPANION_FILES)
    return [root / name for name in names if (root / name).is_file()]


def _weight_files(root: Path) -> tuple[list[Path], list[str]]:
    """(the weight files present, the names of those missing)."""
    single, index = root / SINGLE_FILE_NAME, root / INDEX_FILE_NAME
    if single.is_file() and index.is_file():
        raise NotACheckpoint(
            f"{root} holds both {SINGLE_FILE_NAME} and {INDEX_FILE_NAME}; remove the one "
            "that is not meant"
        )
    if single.is_file():
        return [single], []
    if not index.is_file():
        return [], [f"{SINGLE_FILE_NAME} (or {INDEX_FILE_NAME})"]
    weight_map = read_weight_map(index)  # a malformed index is refused (exit 3) naming it
    shards = [root / name for name in sorted(set(weight_map.values()))]
    present = [shard for shard in shards if shard.is_file()]
    absent = [f"{s.name}{SHARD_NAMED}" for s in shards if not s.is_file()]
    return [index, *present], absent
