"""Write the embedded tiny default: raw data, tokenizer and random base model."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from align.config import TinyConfig, load_config
from align.exit_codes import run_with_exit_codes
from align.receipts import PASSED, hash_file
from align.stages.entry import Stage, parse_stage_args


def main() -> None:
    args = parse_stage_args(sys.argv[1:])
    loaded = load_config(args.configs[0], TinyConfig, args.overrides)
    cfg = loaded.cfg
    stage = Stage("tiny_default")
    from align.data.synthetic import default_texts, write_default_data
    from align.model.tiny import make_tiny_model
    from align.model.tokenizer import train_bpe_tokenizer

    out = Path(cfg.out_dir)
    files = write_default_data(out / "data", cfg.seed, cfg.n_argilla, cfg.n_steppairs, cfg.n_sft)
    tokenizer_dir = out / "tokenizer"
    train_bpe_tokenizer(default_texts(list(files.values())), cfg.vocab_size, tokenizer_dir)
    base = make_tiny_model(out / "base", tokenizer_dir, cfg.seed, **dataclasses.asdict(cfg.model))
    outputs = {str(p): hash_file(p) for p in [*files.values(), *sorted(base.iterdir())]}
    stage.write(out / "receipt.json", stage.receipt(loaded, PASSED, outputs=outputs))


if __name__ == "__main__":
    run_with_exit_codes(main, "tiny_default")
