"""Wall time of each gate's refusal, interpreter start included, on a finished run.

Usage: python benchmarks/gate_latency.py [RESULTS_DIR=results]  (after `make arms`)
Copies the results directory, breaks one gate at a time, and times
`workflow/scripts/dpo.py --run.results_dir=<copy>` until it exits 3; the target for
gates 1-4 is under 0.3 s. Also times a run with every gate passing (--gates-only) as
the baseline. Receipts name their files relative to the results directory, so the
copy is checked on its own bytes.
"""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from align.utils.weights_hash import read_safetensors_header

REPO = Path(__file__).resolve().parents[1]
DPO = REPO / "workflow" / "scripts" / "dpo.py"
ARM = REPO / "config" / "arms" / "argilla.toml"
REPEATS = 5


def _edit(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def break_sft_gate(work: Path) -> list[str]:
    _edit(work / "results/sft/gate.json", lambda r: r.update(passed=False))
    return []


def break_manifest(work: Path) -> list[str]:
    return ["--data.expected_train_pairs=1"]


def break_ref_cache(work: Path) -> list[str]:
    caches = next((work / "results/argilla/ref").iterdir())
    shutil.copyfile(caches / "held.safetensors", caches / "train.safetensors")
    return []


def break_ref_cache_bytes(work: Path) -> list[str]:
    """One bit of the held cache's log-probs: its key still matches, its bytes do not."""
    cache = next((work / "results/argilla/ref").iterdir()) / "held.safetensors"
    begin = read_safetensors_header(cache)["chosen_logps"].begin
    data = bytearray(cache.read_bytes())
    data[begin] ^= 0x01
    cache.write_bytes(bytes(data))
    return []


def break_path_bias(work: Path) -> list[str]:
    (work / "results/argilla/path_bias.json").unlink()
    return []


def all_pass(work: Path) -> list[str]:
    return ["--gates-only"]


CASES = (
    ("sft_gate", break_sft_gate, 3),
    ("manifest", break_manifest, 3),
    ("ref_cache", break_ref_cache, 3),
    ("ref_cache bytes", break_ref_cache_bytes, 3),
    ("path_bias", break_path_bias, 3),
    ("all gates pass", all_pass, 0),
)


def time_case(results: Path, breaker, code: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        shutil.copytree(results, work / "results")
        args = [f"--run.results_dir={work / 'results'}", *breaker(work)]
        times = []
        for _ in range(REPEATS):
            started = time.perf_counter()
            run = subprocess.run(
                [sys.executable, str(DPO), str(ARM), *args],
                cwd=work,
                capture_output=True,
                text=True,
            )
            times.append(time.perf_counter() - started)
            if run.returncode != code:
                raise SystemExit(f"expected exit {code}, got {run.returncode}: {run.stderr[-500:]}")
        return statistics.median(times)


def main() -> None:
    results = Path(sys.argv[1] if len(sys.argv) > 1 else REPO / "results").resolve()
    baseline = time_case(results, all_pass, 0)
    print(f"{'gate broken':<16} {'median s':>9} {'vs all-pass':>12}")
    for name, breaker, code in CASES:
        seconds = time_case(results, breaker, code)
        print(f"{name:<16} {seconds:>9.3f} {seconds / baseline:>11.2f}x")


if __name__ == "__main__":
    main()
