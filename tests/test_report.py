"""The run's report: the summary tables from receipts ("not recorded" where a stage recorded
nothing), `align report`, every figure drawn at its size, and the Snakemake HTML report of
the default pipeline rendered in headless Chromium."""

from __future__ import annotations

import base64
import html
import io
import json
import os
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import run_snakemake
from PIL import Image

from align import cli
from align.paths import ARM_FIGURES, RUN_FIGURES, SPLITS, ReportPaths, RunPaths
from align.receipts import DESCOPED, FAILED, PASSED, write_json_atomic
from align.report.figures import FIGURE_PIXELS
from align.report.summary import gather, render_text
from align.report.summary import selection_labels as labels_of

REPO = Path(__file__).resolve().parents[1]
ARMS = ("argilla", "steppairs", "ultra", "tripped")
PIPELINE_ARMS = ("argilla", "steppairs")


def held(sft: float, policy: float, implicit: float) -> dict:
    def figure(acc: float) -> dict:
        return {
            "n": 100,
            "correct": round(100 * acc),
            "accuracy": acc,
            "ci_low": acc - 0.09,
            "ci_high": acc + 0.08,
            "confidence": 0.95,
        }

    return {
        "sft": figure(sft),
        "policy": figure(policy),
        "policy_implicit_reward": figure(implicit),
    }


def metrics_rows(steps: int, beta: float) -> list[dict]:
    rows = []
    for step in range(steps):
        margin = 0.05 * step
        rows.append(
            {
                "step": step,
                "loss": 0.693 - 0.01 * step,
                "rewards/margins": margin,
                "rewards/chosen": -0.1 * step,
                "rewards/rejected": -0.1 * step - margin,
                "logps/chosen": -70.0 - step,
                "logps/rejected": -72.0 - 1.5 * step,
                "lr": 1e-3,
            }
        )
    return rows


GATES = [
    {"gate": "sft_gate", "status": PASSED, "ms": 0.2},
    {"gate": "manifest", "status": PASSED, "ms": 0.5},
]


def alarm(name: str, step: int, value: float) -> dict:
    return {"name": name, "step": step, "value": value, "band": [0.0, 20.0]}


def signal(steps: int, spike_at: int | None = None) -> list[list[float]]:
    return [[s, 5.0 + (36.0 if s == spike_at else 0.0)] for s in range(steps)]


def generation_checks(terminated: list[float]) -> list[dict]:
    return [
        {"step": 4 * i, "prompts": 8, "terminated_fraction": t, "mean_tokens": 18.0 + 20 * (1 - t)}
        for i, t in enumerate(terminated)
    ]


def run_record(run: str, steps: int, lr: float, rpo_alpha: float, signals: dict, checks) -> dict:
    return {
        "run": run,
        "config": {"lr": lr, "beta": 0.1, "rpo_alpha": rpo_alpha},
        "summary": {"steps": steps, "horizon_steps": 30},
        "signals": signals,
        "bands": {
            "grad_norm": [0.0, 20.0],
            "margin": [None, 5.0],
            "generation_terminated": [0.75, 1.0],
        },
        "generation_checks": checks,
    }


# argilla: a tripwire fired on the first run, the pre-registered rerun passed.
RERUN = {
    "rerun": True,
    "result_run": "rerun",
    "ended_by_tripwire": False,
    "fired": [{"run": "first", **alarm("grad_norm", 7, 41.0)}],
    "runs": [
        run_record(
            "first",
            8,
            1e-3,
            0.0,
            {"grad_norm": signal(8, spike_at=7), "generation_terminated": [[0, 1.0], [4, 0.5]]},
            generation_checks([1.0, 0.5]),
        ),
        run_record(
            "rerun",
            30,
            5e-4,
            0.3,
            {"grad_norm": signal(12), "margin": [[s, 0.1 * s] for s in range(12)]},
            generation_checks([1.0, 1.0, 0.875]),
        ),
    ],
}
# tripped: it fired again on the rerun, which ended training.
ENDED = {
    **RERUN,
    "ended_by_tripwire": True,
    "fired": [*RERUN["fired"], {"run": "rerun", **alarm("grad_norm", 3, 55.0)}],
    "runs": [
        RERUN["runs"][0],
        run_record("rerun", 4, 5e-4, 0.3, {"grad_norm": signal(4, spike_at=3)}, []),
    ],
}


def selection_receipt() -> dict:
    policy = {
        "accuracy": 0.7,
        "ci_low": 0.62,
        "ci_high": 0.77,
        "n": 240,
        "correct": 168,
        "method": "implicit reward",
        "mean_chosen_logp_change": -12.5,
        "mean_rejected_logp_change": -20.0,
        "generation": {
            "prompts": 16,
            "max_new_tokens": 48,
            "mean_tokens": 11.5,
            "terminated_fraction": 1.0,
        },
    }
    comparison = {
        "a": "argilla",
        "b": "sft",
        "diff": 0.2,
        "ci_low": 0.12,
        "ci_high": 0.28,
        "excludes_zero": True,
        "mcnemar": {"a_only": 60, "b_only": 12, "both": 108, "neither": 60, "p_value": 1e-8},
    }
    decision = {
        "rule": "paired_accuracy",
        "default_arm": "argilla",
        "selected": "argilla",
        "branch": "only_eligible_arm",
        "reason": "argilla is the only eligible arm (not eligible: ultra never measured)",
        "eligible": ["argilla"],
        "excluded": {},
    }
    return {
        "schema_version": 1,
        "stage": "select_arms",
        "status": PASSED,
        "gates": GATES,
        "arms": {"argilla": {"status": PASSED, "standing": "eligible", "reason": "passed"}},
        "decision": decision,
        "figures": {
            "eval_set": {
                "name": "union",
                "pairs": 240,
                "sources": {"argilla": 100, "steppairs": 140},
                "duplicates_removed": 0,
                "response_tokens": {"chosen": 10.0, "rejected": 12.0},
            },
            "policies": {"argilla": policy, "sft": {**policy, "mean_chosen_logp_change": 0.0}},
            "comparisons": [comparison],
        },
    }


def probe_receipt(step_times: list[float]) -> dict:
    figures = {
        "median_step_s": statistics.median(step_times),
        "projected_wall_s": 60.0,
        "projected_job_wall_s": 120.0,
        "horizon_steps": 20,
        "peak_rss_mb": 1200.0,
        "step_times": step_times,
    }
    return {"stage": "probe", "figures": figures, "projection": {"node_mb": 1300, "nodes": 1}}


def write_arm(paths: RunPaths, arm: str, status: str = PASSED, **extra) -> None:
    result = {
        "arm": arm,
        "status": status,
        "descoped": False,
        "gates": GATES,
        "config": {"dpo": {"beta": 0.1}},
        "figures": {"held_out": held(0.5, 0.72, 0.8)},
    }
    write_json_atomic(paths.arm(arm).arm_result, {**result, **extra})


def write_metrics(path: Path, steps: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in metrics_rows(steps, 0.1)))


def manifest_entry(paths: RunPaths, arm: str) -> dict:
    shards = {s: {"path": str(paths.arm(arm).shard(s)), "hash": "0" * 64} for s in SPLITS}
    return {"status": PASSED, "counts": {"train": 48, "held": 12}, "shards": shards}


@pytest.fixture
def results(tmp_path) -> Path:
    """argilla rerun after a tripwire (with a probe), steppairs without tripwire section or
    probe, ultra descoped, tripped ended by a tripwire; and the selection."""
    paths = RunPaths.of(tmp_path / "results")
    checks = {"held_nll": {"value": 0.22, "max": 1.5, "passed": True}}
    gate = {"status": PASSED, "checkpoint": "results/sft/checkpoint", "figures": {"checks": checks}}
    write_json_atomic(paths.sft_gate, gate)
    write_json_atomic(paths.manifest, {"arms": {arm: manifest_entry(paths, arm) for arm in ARMS}})
    write_arm(paths, "argilla", tripwire=RERUN)
    write_metrics(paths.arm("argilla").metrics, 8)
    write_metrics(paths.arm("argilla").run_dir / "rerun" / "metrics.jsonl", 30)
    write_json_atomic(paths.arm("argilla").probe, probe_receipt([1.1, 0.6, 0.62, 0.59]))
    write_arm(paths, "steppairs")
    write_metrics(paths.arm("steppairs").metrics, 30)
    write_arm(paths, "tripped", FAILED, tripwire=ENDED, reason="tripwire fired again")
    write_metrics(paths.arm("tripped").metrics, 8)
    write_metrics(paths.arm("tripped").run_dir / "rerun" / "metrics.jsonl", 4)
    descoped = {"arm": "ultra", "status": DESCOPED, "descoped": True, "reason": "kept 12 pairs"}
    write_json_atomic(paths.arm("ultra").arm_result, {**descoped, "gates": GATES})
    write_json_atomic(paths.selection, selection_receipt())
    return paths.results


def section(text: str, title: str) -> list[str]:
    """The lines of one `== title` section of the text summary."""
    body = text.split(f"== {title}", 1)[1]
    return body.split("\n== ", 1)[0].splitlines()


def test_the_summary_says_not_recorded_where_a_stage_recorded_nothing(results):
    text = render_text(gather(results))
    arms = {line.split()[0]: line for line in section(text, "Arms") if line.startswith(ARMS)}
    assert "median 0.610 s/step (4 steps)" in arms["argilla"]
    assert arms["steppairs"].count("not recorded") == 2
    assert "descoped" in arms["ultra"] and "0.720 [0.630, 0.800]" in arms["steppairs"]
    assert "steppairs: tripwire signals not recorded" in text
    assert "selected: argilla (only_eligible_arm)" in text
    assert re.search(r"argilla - sft\s+\+0\.200 \[\+0\.120, \+0\.280\]\s+yes\s+60\s+12", text)
    assert re.search(r"ultra\s+manifest\s+PASSED\s+0\.50", text)


def test_a_rerun_and_a_tripwire_ended_arm_are_told_apart(results):
    text = render_text(gather(results))
    arms = {line.split()[0]: line for line in section(text, "Arms") if line.startswith(ARMS)}
    # The policy's run is the rerun: its 30 steps, not the first run's 8.
    assert re.search(r"argilla\s+PASSED\s+eligible\s+30\s", arms["argilla"])
    assert "1 alarms, rerun (0 on rerun)" in arms["argilla"]
    assert re.search(r"tripped\s+FAILED\s+tripwire_ended\s+4\s", arms["tripped"])
    assert "1 alarms, rerun (1 on rerun); ended by tripwire" in arms["tripped"]
    alarms = section(text, "Tripwire alarms")
    assert any(re.match(r"argilla\s+first run\s+grad_norm\s+7\s+41\s", line) for line in alarms)
    assert any(re.match(r"tripped\s+rerun\s+grad_norm\s+3\s+55\s", line) for line in alarms)


def test_the_first_run_and_the_rerun_are_shown_side_by_side(results):
    text = render_text(gather(results))
    runs = section(text, "Training runs")
    first = next(line for line in runs if re.match(r"argilla\s+first\s", line))
    rerun = next(line for line in runs if re.match(r"argilla\s+rerun\s", line))
    assert any("lr / beta / rpo_alpha" in line for line in runs)  # the rerun's settings
    # Each run: its configuration, steps, final loss / margin / chosen log-prob from its own
    # metrics, what fired, and the terminated fraction of every generation check.
    assert re.search(r"0\.001 / 0\.1 / 0\s+8/30\s+0\.6230\s+\+0\.350\s+-77\.00", first)
    assert "grad_norm at 7" in first and "0: 1.00 / 18.0, 4: 0.50 / 28.0" in first
    assert re.search(r"0\.0005 / 0\.1 / 0\.3\s+30/30\s+0\.4030\s+\+1\.450\s+-99\.00", rerun)
    assert "none" in rerun and "8: 0.88 / 20.5" in rerun and rerun.rstrip().endswith("yes")
    assert "steppairs: training runs not recorded" in text


def test_without_a_selection_the_summary_says_so(results):
    (results / "selection.json").unlink()
    text = render_text(gather(results))
    assert "selection.json: not recorded" in text and "selection: not recorded" in text


def test_align_report_prints_the_summary_and_refuses_a_missing_dir(results, capsys, tmp_path):
    assert cli.main(["report", str(results)]) == 0
    assert capsys.readouterr().out == render_text(gather(results))
    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no such results directory" in capsys.readouterr().err


def png_pixels(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), dtype=np.float64)


def test_every_figure_is_drawn_at_its_size_and_is_not_blank(results):
    assert cli.main(["report", str(results), "--figures"]) == 0
    report = ReportPaths.of(RunPaths.of(results))
    figures = [report.arm_figure(arm, name) for arm in ARMS for name in ARM_FIGURES]
    figures += [report.run_figure(name) for name in RUN_FIGURES]
    for path in figures:
        pixels = png_pixels(path.read_bytes())
        assert pixels.shape[1::-1] == FIGURE_PIXELS, path
        assert pixels.var() > 0, path
    page = report.summary_html.read_text()
    assert "<table>" in page and "argilla is the only eligible arm" in page
    assert page.count("not recorded") >= 3


def test_the_selection_labels_carry_the_decision(results):
    labels = labels_of(results / "selection.json")
    assert labels["selected arm"] == "argilla" and labels["branch"] == "only_eligible_arm"


# --- the default pipeline's HTML report, in a browser ---------------------------------------

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
# Injected into a copy of the report: it shows every image result through the report's own
# view, measures the <img> the app rendered (size and pixel variance on a canvas), and
# writes what it found, with the front page's text, where --dump-dom prints it.
CHECK_SCRIPT = """
<script>
window.addEventListener("load", async () => {
  const pause = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
  await pause(500);
  const found = {front_page: document.querySelector("#app").textContent, images: {}};
  for (const [path, entry] of Object.entries(results)) {
    if (!entry.mime_type.startsWith("image/")) continue;
    app.setView({content: "img", contentPath: entry.data_uri, resultPath: path});
    await pause(200);
    const img = document.querySelector(`#app img[src="${entry.data_uri}"]`);
    if (img === null) { found.images[path] = {shown: false}; continue; }
    // Poll rather than img.decode(): under virtual time a decode promise never settles.
    for (let i = 0; i < 100 && !(img.complete && img.naturalWidth > 0); i++) await pause(100);
    const canvas = document.createElement("canvas");
    canvas.width = img.naturalWidth; canvas.height = img.naturalHeight;
    const ctx = canvas.getContext("2d");
    ctx.drawImage(img, 0, 0);
    const px = ctx.getImageData(0, 0, canvas.width, canvas.height).data;
    let sum = 0, sq = 0;
    for (let i = 0; i < px.length; i += 4) {
      const v = (px[i] + px[i + 1] + px[i + 2]) / 3; sum += v; sq += v * v;
    }
    const n = px.length / 4;
    found.images[path] = {shown: true, width: img.naturalWidth, height: img.naturalHeight,
                          variance: sq / n - (sum / n) ** 2};
  }
  const out = document.createElement("pre");
  out.id = "align-check";
  out.textContent = JSON.stringify(found);
  document.body.appendChild(out);
});
</script>
"""


@pytest.fixture(scope="module")
def pipeline_report(finished_workflow) -> Path:
    """The session's finished default run, taken on to `all` (figures) and the HTML report."""
    work = finished_workflow
    run = run_snakemake(work, "--cores", "2", "all")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    run = run_snakemake(work, "--report", "report.html")
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return work


def embedded_results(report_html: Path) -> dict:
    """The report's result entries (name, caption, labels, data URI) keyed by path."""
    text = report_html.read_text()
    match = re.search(r"var results = (\{.*?\});\n", text, re.S)
    assert match, "no embedded results in the report"
    return json.loads(match.group(1))


def expected_figures() -> set[str]:
    report = ReportPaths.of(RunPaths.of("results"))
    paths = [report.arm_figure(arm, name) for arm in PIPELINE_ARMS for name in ARM_FIGURES]
    return {str(p) for p in paths} | {str(report.run_figure(name)) for name in RUN_FIGURES}


@pytest.mark.slow
def test_the_report_embeds_every_figure_with_a_caption(pipeline_report):
    entries = embedded_results(pipeline_report / "report.html")
    images = {path: e for path, e in entries.items() if e["mime_type"] == "image/png"}
    assert set(images) == expected_figures()
    for path, entry in images.items():
        header, _, payload = entry["data_uri"].partition(",")
        assert header.startswith("data:image/png;") and header.endswith(";base64"), path
        pixels = png_pixels(base64.b64decode(payload))
        assert pixels.shape[1::-1] == FIGURE_PIXELS and pixels.var() > 0, path
        assert len(entry["caption"]) > 100, path
    selection = json.loads((pipeline_report / "results" / "selection.json").read_text())
    labels = entries["results/selection.json"]["labels"]
    assert labels["selected arm"] == (selection["decision"]["selected"] or "none")
    assert "results/report/summary.html" in entries


@pytest.mark.slow
def test_the_report_renders_every_figure_and_the_selection_in_chromium(pipeline_report, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        if os.environ.get("ALIGN_SERVICES") == "required":
            pytest.fail("no chromium, though make test brought the services up")
        pytest.skip("chromium is not installed (make services installs Debian's chromium)")
    page = tmp_path / "report_check.html"
    # The last </body> closes the page; earlier ones sit inside the report's scripts.
    head, body_end, tail = (pipeline_report / "report.html").read_text().rpartition("</body>")
    page.write_text(head + CHECK_SCRIPT + body_end + tail)
    run = subprocess.run(
        [
            chromium,
            *CHROMIUM_FLAGS,
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=60000",
            "--dump-dom",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    match = re.search(r'<pre id="align-check">(.*?)</pre>', run.stdout, re.S)
    assert match, run.stderr[-3000:]
    found = json.loads(html.unescape(match.group(1)))
    assert set(found["images"]) == expected_figures()
    for path, image in found["images"].items():
        assert image["shown"], path
        assert (image["width"], image["height"]) == FIGURE_PIXELS, path
        assert image["variance"] > 0, path
    decision = json.loads((pipeline_report / "results" / "selection.json").read_text())["decision"]
    assert f"Selected arm: {decision['selected'] or 'none'}" in found["front_page"]
    assert decision["reason"][:60] in found["front_page"]
