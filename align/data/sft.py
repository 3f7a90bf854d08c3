"""SFT text: prompt/response rows, split by prompt hash, tokenized into in-memory shards.

Rows are read within the bounds of align.data.bounds for the SFT seq_len. A row whose
rendered prompt and response hold more characters than the row limit is refused
(exit 4), not cut: SFT has no filter counts to report a removal in, and a row that long
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


def read_sft_splits(
    cfg: SftDataConfig,
    bounds: RowBounds = UNTOKENIZED,
    renderer: PromptRenderer | None = None,
) -> dict[str, tuple[list[str], list[str]]]:
    """{split: (prompts, responses)} from rows with string `prompt` and `response`; with a
    `renderer`, a row over `bounds`' row limit is refused."""
    splits: dict[str, tuple[list[str], list[str]]] = {s: ([], []) for s in SPLITS}
    for path in expand_files(cfg.files):
        for row in iter_raw_rows(path, bounds):
            prompt, response = row.get("prompt", str), row.get("response", str)
            if not response.strip():
                raise BadInputData(f"{row.where()}: column 'response' is empty")
            if renderer is not None:
                record = PreferenceRecord(prompt, "", "", row.source, row.row)
                chars = len(renderer.text(record)) + len(response)
                if bounds.over(chars):
                    raise BadInputData(
                        f"{row.where()}: expected a rendered prompt and response of at most "
                        f"{bounds.chars} characters ({bounds.basis}), found {chars}"
                    )
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
    bounds = RowBounds.of(tokenizer, cfg.seq_len)
    splits = read_sft_splits(cfg, bounds, PromptRenderer(tokenizer))
    return {
        split: sft_arrays(
            tokenize_sft(prompts, responses, tokenizer, cfg.seq_len), tokenizer.pad_id
        )
        for split, (prompts, responses) in splits.items()
    }
