"""SFT text: prompt/response rows, split by prompt hash, tokenized into in-memory shards.

Rows are read within the bounds of align.data.bounds for the SFT seq_len. A row whose
rendered prompt and response hold more characters than the row limit is removed before
it is tokenized and counted as `row_over_length`, as the preference build counts it: it
has more than 16 x seq_len tokens, so truncation would train on a fragment of it.
"""

from __future__ import annotations

from align.config import SftDataConfig
from align.data.bounds import UNTOKENIZED, RowBounds
from align.data.formats import PreferenceRecord, expand_files, iter_raw_rows
from align.data.shards import sft_arrays
from align.data.split import split_of
from align.data.tokenize import PromptRenderer, tokenize_sft
from align.exit_codes import BadInputData
from align.paths import SPLITS

SFT_FILTERS = ("row_over_length",)


def read_sft_splits(
    cfg: SftDataConfig,
    bounds: RowBounds = UNTOKENIZED,
    renderer: PromptRenderer | None = None,
) -> tuple[dict[str, tuple[list[str], list[str]]], dict[str, int]]:
    """({split: (prompts, responses)}, {filter: rows removed}) from rows with string `prompt`
    and `response`; with a `renderer`, a row over `bounds`' row limit is removed."""
    splits: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in SPLITS}
    removed = dict.fromkeys(SFT_FILTERS, 0)
    for path in expand_files(cfg.files):
        for row in iter_raw_rows(path, bounds):
            prompt, response = row.get("prompt", str), row.get("response", str)
            if not response.strip():
                raise BadInputData(f"{row.where()}: column 'response' is empty")
            if renderer is not None:
                record = PreferenceRecord(prompt, "", "", row.source, row.row)
                if bounds.over(len(renderer.text(record)) + len(response)):
                    removed["row_over_length"] += 1
                    continue
            prompts, responses = splits[split_of(prompt, cfg.held_fraction, cfg.split_seed)]
            prompts.append(prompt)
            responses.append(response)
    for split, (prompts, _) in splits.items():
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
            tokenize_sft(prompts, responses, tokenizer, cfg.seq_len), tokenizer.pad_id
        )
        for split, (prompts, responses) in splits.items()
    }
    return arrays, removed
