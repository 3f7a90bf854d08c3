"""Greedy decoding time of align's cached decoding against transformers' `generate`.

One random Mistral written by transformers, loaded by both; a batch of prompts decoded
greedily to a fixed number of new tokens (no eos), on the CPU or on CUDA. Prints the median
seconds of each and the ratio to transformers, and whether the two decoded the same tokens.

usage: python benchmarks/generation.py [--batch 16] [--prompt 48] [--new 48] [--repeats 3]
                                     [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from align.eval.generation import greedy_generate_batch
from align.model.checkpoint import load_pretrained

SIZES = {
    "vocab_size": 384,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


def write_model(directory: Path) -> None:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(**SIZES, pad_token_id=0, eos_token_id=1))
    model.save_pretrained(directory)


def median_seconds(run, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=48)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    # One thread, as each rank of a stage runs: more threads on a busy host mostly wait.
    parser.add_argument("--threads", type=int, default=1)
    ns = parser.parse_args()
    torch.set_num_threads(ns.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from transformers import MistralForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp))
        theirs = MistralForCausalLM.from_pretrained(tmp, dtype=torch.float32).to(device).eval()
        ours = load_pretrained(tmp, device=device).eval()
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(2, SIZES["vocab_size"], (ns.batch, ns.prompt), generator=generator)
    prompts = ids.tolist()

    def transformers_generate():
        with torch.no_grad():
            out = theirs.generate(
                ids.to(device),
                attention_mask=torch.ones_like(ids, device=device),
                max_new_tokens=ns.new,
                min_new_tokens=ns.new,
                do_sample=False,
                pad_token_id=0,
            )
        return out[:, ns.prompt :].tolist()

    def align_decode():
        return [new for new, _ in greedy_generate_batch(ours, prompts, ns.new, -1, 0, device)]

    rows = {
        "transformers generate": median_seconds(transformers_generate, ns.repeats),
        "align": median_seconds(align_decode, ns.repeats),
    }
    base, reference = rows["transformers generate"]
    print(f"{ns.batch} prompts x {ns.prompt} tokens, {ns.new} new, on {device}")
    print(f"{'decoder':<24}{'seconds':>10}{'ratio':>8}  same tokens")
    for name, (seconds, tokens) in rows.items():
        print(f"{name:<24}{seconds:>10.3f}{seconds / base:>8.2f}  {tokens == reference}")


if __name__ == "__main__":
    main()
