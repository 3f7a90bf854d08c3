"""SFT text: prompt/response rows, split by prompt hash, tokenized into in-memory shards."""

from __future__ import annotations

from align.config import SftDataConfig
from align.data.formats import expand_files, iter_raw_rows
from align.data.shards import sft_arrays
from align.data.split import split_of
from align.data.tokenize import tokenize_sft
from align.exit_codes import BadInputData
from align.paths import SPLITS


def read_sft_splits(cfg: SftDataConfig) -> dict[str, tuple[list[str], list[str]]]:
    """{split: (prompts, responses)} from rows with string `prompt` and `response`."""
    splits: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in SPLITS}
    for path in expand_files(cfg.files):
        for row in iter_raw_rows(path):
            prompt, response = row.get("prompt", str), row.get("response", str)
            if not response.strip():
                raise BadInputData(f"{row.where()}: column 'response' is empty")
            prompts, responses = splits[split_of(prompt, cfg.held_fraction, cfg.split_seed)]
            prompts.append(prompt)
            responses.append(response)
    for split, (prompts, _) in splits.items():
        if not prompts:
            raise BadInputData(
                f"SFT data {cfg.files}: split {split!r} is empty (held_fraction={cfg.held_fraction})"
            )
    return splits


def tokenize_sft_splits(cfg: SftDataConfig, tokenizer) -> dict[str, dict]:
    """{split: sft arrays} ready for `SftShard`."""
    return {
        split: sft_arrays(
            tokenize_sft(prompts, responses, tokenizer, cfg.seq_len), tokenizer.pad_id
        )
        for split, (prompts, responses) in read_sft_splits(cfg).items()
    }
