"""Throughput and peak memory of the data build on a 100k-pair argilla-format JSONL.

Writes N distinct argilla rows with the synthetic row builders (exact shares of
ties, low scores and GSM8K rows, so those filters remove 21%), then builds them as
the `argilla` arm with the tiny tokenizer (resources/tiny/tokenizer, or one
trained on the fly when it is absent). Each method runs in a fresh subprocess that
reports its wall time and VmHWM (peak RSS); the parent checks the same peak with
getrusage(RUSAGE_CHILDREN). Methods:

  streaming   align.data.build: per-split numpy token buffers, shards streamed to disk
  template    the same with a Mistral chat template rendered for every prompt
  lists       the earlier layout as a peer: every pair's token lists held as Python
              objects, then padded arrays built and written with safetensors.numpy

The streaming build must stay under 2 GiB of peak RSS; the script exits 1 otherwise.

Run: .venv/bin/python benchmarks/build_manifest.py [--pairs 100000]   (about a minute on two cores)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGILLA_TOML = ROOT / "config" / "arms" / "argilla.toml"
TINY_TOKENIZER = ROOT / "resources" / "tiny" / "tokenizer"
RSS_LIMIT_BYTES = 2 << 30
METHODS = ("streaming", "template", "lists")
ROWS_PER_CHUNK = 10_000
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% endif %}{% endfor %}"
)


def write_rows(path: Path, n: int, seed: int) -> None:
    from align.data.synthetic import argilla_rows

    rng = random.Random(f"benchmark:{seed}")
    with open(path, "w", encoding="utf-8") as fh:
        for start in range(0, n, ROWS_PER_CHUNK):
            rows = argilla_rows(rng, min(ROWS_PER_CHUNK, n - start))
            for i, row in enumerate(rows, start=start):
                # The arithmetic table is small; a row number keeps every pair distinct.
                row["input"] = f"{row['input']} (#{i})"
                fh.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")


def tokenizer_dir(work: Path) -> Path:
    if (TINY_TOKENIZER / "tokenizer.json").is_file():
        return TINY_TOKENIZER
    from align.data.synthetic import default_texts, write_default_data
    from align.model.tokenizer import train_bpe_tokenizer

    files = write_default_data(work / "tiny-data", seed=0)
    return train_bpe_tokenizer(default_texts(files), 384, work / "tokenizer")


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def child(method: str, data: Path, tokenizer_path: Path, out: Path) -> None:
    from align.config import ArmConfig, load_config
    from align.model.tokenizer import AlignTokenizer, load_tokenizer
    from align.paths import ArmPaths

    overrides = [
        f"--data.files={json.dumps([str(data)])}",
        "--expected_train_pairs=none",
        "--expected_held_pairs=none",
        "--min_pairs=1",
    ]
    cfg = load_config(ARGILLA_TOML, ArmConfig, overrides).cfg
    tokenizer = load_tokenizer(tokenizer_path)
    if method == "template":
        tokenizer = AlignTokenizer(
            tokenizer.backend,
            json.loads((tokenizer_path / "tokenizer_config.json").read_text()),
            chat_template=MISTRAL_TEMPLATE,
        )
    started, cpu_started = time.perf_counter(), time.process_time()
    if method == "lists":
        counts = build_with_lists(cfg, tokenizer, ArmPaths(out, cfg.arm))
    else:
        from align.data.build import build_arm

        counts = build_arm(cfg, tokenizer, ArmPaths(out, cfg.arm))["counts"]
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    result = {"seconds": seconds, "cpu": cpu, "read": counts["read"], "kept": counts["kept"]}
    print(json.dumps({**result, "peak_rss": peak_rss_bytes()}))


def build_with_lists(cfg, tokenizer, paths) -> dict:
    """Every pair's tokens as Python lists until the end, then padded arrays and save_file."""
    from align.data.build import batched
    from align.data.filters import FilterCounts, active_reasons, classify, prompt_over_budget
    from align.data.formats import expand_files, iter_records
    from align.data.shards import PAIR_FORMAT, pair_arrays, write_shard
    from align.data.split import pair_id, split_of
    from align.data.tokenize import tokenize_pairs

    data = cfg.data
    counts = FilterCounts(active_reasons(data))
    kept: dict[str, tuple[list, list]] = {"train": ([], []), "held": ([], [])}
    records = classify(iter_records(expand_files(data.files), data.format), data.filters)
    for chunk in batched(records, 1024):
        good = [record for record, reason in chunk if reason is None]
        for reason in (reason for _, reason in chunk if reason is not None):
            counts.add(reason)
        for record, pair in zip(good, tokenize_pairs(good, tokenizer, data.seq_len), strict=True):
            over = prompt_over_budget(pair.prompt_tokens, data.max_prompt_tokens)
            counts.add("prompt_over_budget" if over else None)
            if over:
                continue
            ids, pairs = kept[split_of(record.prompt, data.held_fraction, data.split_seed)]
            ids.append(pair_id(record.prompt, record.chosen, record.rejected))
            pairs.append(pair)
    for split, (ids, pairs) in kept.items():
        write_shard(paths.shard(split), pair_arrays(ids, pairs, tokenizer.pad_id), PAIR_FORMAT)
    return counts.as_dict()


def run_method(method: str, data: Path, tokenizer_path: Path, work: Path) -> dict:
    out = work / f"results-{method}"
    command = [
        sys.executable,
        __file__,
        "--child",
        method,
        str(data),
        str(tokenizer_path),
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{method} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--child", nargs=4, metavar=("METHOD", "DATA", "TOKENIZER", "OUT"))
    args = parser.parse_args()
    if args.child:
        method, data, tokenizer_path, out = args.child
        child(method, Path(data), Path(tokenizer_path), Path(out))
        return
    with tempfile.TemporaryDirectory(prefix="bench-build-") as tmp:
        work = Path(tmp)
        data = work / "argilla.jsonl"
        started = time.perf_counter()
        write_rows(data, args.pairs, seed=0)
        print(
            f"wrote {args.pairs} argilla rows ({data.stat().st_size / 2**20:.0f} MiB) "
            f"in {time.perf_counter() - started:.1f} s; {os.cpu_count()} CPUs",
            flush=True,
        )
        tokenizer_path = tokenizer_dir(work)
        results = {m: run_method(m, data, tokenizer_path, work) for m in args.methods}
    children_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    header = f"{'method':<10} {'rows':>8} {'kept':>8} {'wall s':>7} {'rows/s':>8} {'cpu s':>7}"
    print(f"\n{header} {'rows/cpu-s':>10} {'peak RSS':>10}")
    for method, r in results.items():
        print(
            f"{method:<10} {r['read']:>8} {r['kept']:>8} {r['seconds']:>7.2f} "
            f"{r['read'] / r['seconds']:>8.0f} {r['cpu']:>7.2f} {r['read'] / r['cpu']:>10.0f} "
            f"{r['peak_rss'] / 2**20:>6.0f} MiB"
        )
    if "streaming" in results and "lists" in results:
        s, peer = results["streaming"], results["lists"]
        print(
            f"\nstreaming / lists: wall {s['seconds'] / peer['seconds']:.2f}x, "
            f"cpu {s['cpu'] / peer['cpu']:.2f}x, "
            f"peak RSS {s['peak_rss'] / peer['peak_rss']:.2f}x"
        )
    print(f"largest child peak RSS (getrusage): {children_peak / 2**20:.0f} MiB")
    streaming_peak = results.get("streaming", {}).get("peak_rss", 0)
    if streaming_peak > RSS_LIMIT_BYTES:
        print(f"FAIL: streaming peak RSS {streaming_peak / 2**20:.0f} MiB over 2 GiB")
        sys.exit(1)


if __name__ == "__main__":
    main()
