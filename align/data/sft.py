"""SFT text: prompt/response rows, split by prompt hash, tokenized into in-memory shards.

Rows are read within the bounds of align.data.bounds for the SFT seq_len. A row whose
rendered prompt and response hold more characters than the row limit is removed before
it is tokenized and counted as `row_over_length`, as the preference build counts it: it
has more than 16 x seq_len tokens, so truncation would train on a fragment of it.
"""

from __future__ import annotations

from align.config import SftDataConfig
from align.data.bounds import RowBounds
from align.data.formats import PreferenceRecord, expand_files, iter_raw_rows
from align.data.shards import sft_arrays
from align.data.split import split_of
from align.data.tokenize import PromptRenderer, tokenize_sft
from align.exit_codes import BadInputData
from align.paths import SPLITS

SFT_FILTERS = ("row_over_length",)


def read_sft_splits(
    cfg: SftDataConfig, bounds: RowBounds, renderer: PromptRenderer
) -> tuple[dict[str, tuple[list[str], list[str], list[str]]], dict[str, int]]:
    """({split: (prompts, rendered prompts, responses)}, {filter: rows removed}) from rows
    with string `prompt` and `response`; a row over `bounds`' row limit is removed."""
    splits: dict[str, tuple[list[str], list[str], list[str]]] = {s: ([], [], []) for s in SPLITS}
    removed = dict.fromkeys(SFT_FILTERS, 0)
    for path in expand_files(cfg.files):
        for row in iter_raw_rows(path, bounds):
            prompt, response = row.get("prompt", str), row.get("response", str)
            if not response.strip():
                raise BadInputData(f"{row.where()}: column 'response' is empty")
            text = renderer.text(PreferenceRecord(prompt, "", "", row.source, row.row))
            if bounds.over(len(text) + len(response)):
                removed["row_over_length"] += 1
                continue
            prompts, texts, responses = splits[split_of(prompt, cfg.held_fraction, cfg.split_seed)]
            prompts.append(prompt)
            texts.append(text)
            responses.append(response)
    for split, (prompts, _, _) in splits.items():
        if not prompts:
            raise BadInputData(
                f"SFT data {cfg.files}: split {split!r} is empty (held_fraction={cfg.held_fraction})"
            )
    return splits, removed


def tokenize_sft_splits(cfg: SftDataConfig, tokenizer) -> tuple[dict[str, dict], dict[str, int]]:
    """({split: sft arrays} ready for `SftShard`, {filter: rows removed})."""
    bounds = RowBounds.of(tokenizer, cfg.seq_len)
    splits, removed = read_sft_splits(cfg, bounds, PromptRenderer(tokenizer))
    arrays = {
        split: sft_arrays(
            tokenize_sft(prompts, responses, tokenizer, cfg.seq_len, texts), tokenizer.pad_id
        )
        for split, (prompts, texts, responses) in splits.items()
    }
    return arrays, removed
