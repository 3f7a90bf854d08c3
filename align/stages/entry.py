"""What every stage entry shares: argument parsing, the command line it ran, receipts.

A stage is `workflow/scripts/<stage>.py CONFIG [CONFIG ...] [--k=v ...] [--flag]`.
Config paths end in .toml; every other argument is an override or a declared flag.
Imports nothing heavy.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from align.config import Loaded
from align.exit_codes import ConfigError
from align.log import stage_logger
from align.receipts import hash_json, make_receipt, now_iso, write_json_atomic


@dataclass
class StageArgs:
    configs: list[Path]
    overrides: list[str]
    flags: set[str] = field(default_factory=set)


def parse_stage_args(
    argv: list[str], flags: tuple[str, ...] = (), n_configs: int | None = 1
) -> StageArgs:
    """Split argv into config files, overrides and the stage's declared flags."""
    configs, overrides, seen = [], [], set()
    for token in argv:
        if token.startswith("--") and token[2:] in flags:
            seen.add(token[2:])
        elif token.endswith(".toml") and "=" not in token:
            configs.append(Path(token))
        else:
            overrides.append(token)
    if not configs or (n_configs is not None and len(configs) != n_configs):
        expected = "one config file" if n_configs == 1 else "config files"
        raise ConfigError(
            f"usage: expected {expected} (.toml) then --key=value overrides, got {argv!r}"
        )
    return StageArgs(configs, overrides, seen)


def is_main_process() -> bool:
    """Rank 0 under torchrun, or a process launched alone: the one that writes receipts."""
    return os.environ.get("RANK", "0") == "0"


def command_line() -> str:
    """The exact command that ran, printed to the log so a rule can be rerun by hand."""
    return shlex.join([sys.executable, *sys.argv])


class Stage:
    """One run of a stage: its start time, and the receipt it writes at the end."""

    def __init__(self, name: str):
        self.name = name
        self.started_at = now_iso()
        # Where the trainer's max_wall_seconds counts from: the job's budget.
        self.started = time.monotonic()
        self.log = stage_logger(name)
        if is_main_process():
            self.log.info(command_line())

    def receipt(
        self,
        loaded: Loaded | list[Loaded] | None,
        status: str,
        *,
        inputs: dict[str, str] | None = None,
        outputs: dict[str, str] | None = None,
        figures: dict[str, Any] | None = None,
        **extra: Any,
    ) -> dict[str, Any]:
        configs = [] if loaded is None else loaded if isinstance(loaded, list) else [loaded]
        return make_receipt(
            self.name,
            status,
            config_hash=hash_json([c.config_hash for c in configs])
            if len(configs) > 1
            else (configs[0].config_hash if configs else None),
            overrides=configs[0].overrides if configs else None,
            inputs=inputs,
            outputs=outputs,
            started_at=self.started_at,
            figures=figures,
            config_source=[str(c.source) for c in configs],
            command=command_line(),
            **extra,
        )

    def write(self, path: str | Path, receipt: dict[str, Any]) -> None:
        write_json_atomic(path, receipt)
