"""Section 13: paired statistics against hand-computed cases, every branch of the selection
rule, descoped and tripwire-ended arms, the selection's gates, and the stage end to end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_models import TINY_SIZES

from align.config import GenerationBandConfig, PairedEvalConfig, SelectionConfig, load_config
from align.data.manifest import Manifest
from align.eval.generation import generation_prompts
from align.eval.sanity import GenerationBand
from align.exit_codes import GATE_REFUSED, ConfigError, GateRefused
from align.paths import RunPaths
from align.receipts import (
    DESCOPED,
    FAILED,
    PASSED,
    SCHEMA_VERSION,
    hash_file,
    read_json,
    write_json_atomic,
)
from align.stages import paired
from align.stages import select as sel
from align.stages.arm_result import ArmResult

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
SELECT_SCRIPT = ROOT / "workflow" / "scripts" / "select_arms.py"
PAIRED = PairedEvalConfig(n_boot=2000, seed=5, confidence=0.95)


def table(both: int, a_only: int, b_only: int, neither: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-pair correctness of two policies with the given 2x2 counts."""
    a = [True] * both + [True] * a_only + [False] * b_only + [False] * neither
    b = [True] * both + [False] * a_only + [True] * b_only + [False] * neither
    return np.array(a), np.array(b)


# --- McNemar -------------------------------------------------------------------------------


def test_mcnemar_exact_on_a_known_table():
    # 10 vs 2 discordant pairs: two-sided exact p = 2 * P(X <= 2 | 12, 1/2)
    # = 2 * (C(12,0) + C(12,1) + C(12,2)) / 2^12 = 2 * 79 / 4096.
    a, b = table(both=20, a_only=10, b_only=2, neither=5)
    result = paired.mcnemar_exact(a, b)
    assert (result["both"], result["a_only"], result["b_only"], result["neither"]) == (20, 10, 2, 5)
    assert result["p_value"] == pytest.approx(158 / 4096, rel=1e-12)


def test_mcnemar_is_symmetric_and_ignores_concordant_pairs():
    a, b = table(both=3, a_only=5, b_only=0, neither=90)
    forward, backward = paired.mcnemar_exact(a, b), paired.mcnemar_exact(b, a)
    assert forward["p_value"] == backward["p_value"] == pytest.approx(2 / 32)
    assert (backward["a_only"], backward["b_only"]) == (0, 5)


def test_mcnemar_without_discordant_pairs_is_one():
    a, b = table(both=7, a_only=0, b_only=0, neither=3)
    assert paired.mcnemar_exact(a, b)["p_value"] == 1.0


# --- paired bootstrap ----------------------------------------------------------------------


def correlated_pairs(rng, n: int, p_a: float, p_b: float, share: float):
    """Correct/incorrect of two policies whose errors are correlated; marginals exactly p_a, p_b."""
    u = rng.random(n)
    v = np.where(rng.random(n) < share, u, rng.random(n))
    return u < p_a, v < p_b


def test_bootstrap_interval_covers_the_true_difference_at_about_the_nominal_rate():
    rng = np.random.default_rng(2024)
    true_diff, covered, sims = 0.7 - 0.6, 0, 200
    for sim in range(sims):
        a, b = correlated_pairs(rng, 150, 0.7, 0.6, share=0.6)
        ci = paired.paired_bootstrap(a, b, n_boot=1000, seed=sim, confidence=0.95)
        covered += ci["ci_low"] <= true_diff <= ci["ci_high"]
    assert 0.9 <= covered / sims <= 0.99, covered / sims


def test_bootstrap_is_seeded_centred_and_independent_of_the_block_size(monkeypatch):
    a, b = correlated_pairs(np.random.default_rng(0), 120, 0.8, 0.55, share=0.5)
    first = paired.paired_bootstrap(a, b, 500, seed=3, confidence=0.9)
    assert first == paired.paired_bootstrap(a, b, 500, seed=3, confidence=0.9)
    # Percentiles of a discrete statistic can tie across seeds; over several they cannot all.
    others = {tuple(paired.paired_bootstrap(a, b, 500, s, 0.9).values()) for s in range(4, 9)}
    assert len(others) > 1
    assert first["diff"] == pytest.approx(a.mean() - b.mean())
    assert first["ci_low"] < first["diff"] < first["ci_high"]
    monkeypatch.setattr(paired, "BOOTSTRAP_BLOCK_DRAWS", 7 * 120 + 5)
    assert paired.paired_bootstrap(a, b, 500, seed=3, confidence=0.9) == first


def test_pairing_narrows_the_interval_when_policies_agree_on_most_pairs():
    # The same accuracies, once nearly always agreeing and once independent: only a
    # paired interval can tell the first difference apart from 0.
    a, b = table(both=140, a_only=12, b_only=0, neither=48)
    agreeing = paired.paired_bootstrap(a, b, 2000, seed=1, confidence=0.95)
    assert agreeing["ci_low"] > 0
    shuffled = np.random.default_rng(9).permutation(b)
    independent = paired.paired_bootstrap(a, shuffled, 2000, seed=1, confidence=0.95)
    assert independent["ci_high"] - independent["ci_low"] > agreeing["ci_high"] - agreeing["ci_low"]


def test_every_pair_of_policies_is_compared_once_with_its_statistics():
    correct = {
        "argilla": table(20, 10, 2, 5)[0],
        "steppairs": table(20, 10, 2, 5)[1],
        sel.SFT: np.zeros(37, dtype=bool),
    }
    comparisons = paired.all_comparisons(correct, PAIRED)
    assert [(c["a"], c["b"]) for c in comparisons] == [
        ("argilla", "steppairs"),
        ("argilla", sel.SFT),
        ("steppairs", sel.SFT),
    ]
    first = comparisons[0]
    assert first["diff"] == pytest.approx(8 / 37)
    assert first["mcnemar"]["p_value"] == pytest.approx(158 / 4096)
    assert first["excludes_zero"] == (first["ci_low"] > 0)
    assert (first["n_boot"], first["seed"], first["confidence"]) == (2000, 5, 0.95)


# --- the common set and per-pair correctness -----------------------------------------------


def shard_arrays(pair_ids, width: int, prompt=(5, 6), chosen=(7,), rejected=(8, 9)):
    n = len(pair_ids)
    row_c, row_r = [*prompt, *chosen], [*prompt, *rejected]
    ids_c = np.full((n, width), 3, dtype=np.int32)
    ids_r = np.full((n, width), 3, dtype=np.int32)
    ids_c[:, : len(row_c)] = row_c
    ids_r[:, : len(row_r)] = row_r
    return {
        "pair_id": np.asarray(pair_ids, dtype=np.int64),
        "prompt_len": np.full(n, len(prompt), dtype=np.int32),
        "chosen_len": np.full(n, len(row_c), dtype=np.int32),
        "rejected_len": np.full(n, len(row_r), dtype=np.int32),
        "chosen_ids": ids_c,
        "rejected_ids": ids_r,
    }


def test_union_dedupes_by_pair_id_keeps_the_first_and_pads_to_the_widest():
    narrow = shard_arrays([1, 2, 3], width=4)
    wide = shard_arrays([3, 4, 4], width=6, prompt=(10, 11, 12))
    union, info = paired.union_pairs({"a": narrow, "b": wide}, pad_id=0)
    assert union["pair_id"].tolist() == [1, 2, 3, 4]
    assert union["chosen_ids"].shape == union["rejected_ids"].shape == (4, 6)
    assert union["chosen_ids"][0].tolist() == [5, 6, 7, 3, 0, 0]
    assert union["prompt_len"].tolist() == [2, 2, 2, 3]
    assert info == {"sources": {"a": 3, "b": 1}, "pairs": 4, "duplicates_removed": 2}


def test_generation_prompts_are_the_first_distinct_ones():
    union, _ = paired.union_pairs(
        {"a": shard_arrays([1, 2], 4), "b": shard_arrays([3], 6, prompt=(10, 11, 12))}, 0
    )
    assert generation_prompts(union, 5) == [[5, 6], [10, 11, 12]]
    assert generation_prompts(union, 1) == [[5, 6]]
    assert paired.response_lengths(union) == {"chosen": 1.0, "rejected": 2.0}


FLOAT32 = {"compute": "float32", "master": "float32"}


def test_arms_are_judged_by_implicit_reward_and_the_sft_policy_by_its_own_preference():
    sft = paired.PolicyScores(
        np.array([-5.0, -5, -5]), np.array([-4.0, -6, -5]), [3, 5], [True, True], FLOAT32
    )
    # Margins against SFT: (-6+5) - (-6+4) = 1 > 0; (-9+5) - (-3+6) = -7; tie 0 -> wrong.
    arm = paired.PolicyScores(
        np.array([-6.0, -9, -7]), np.array([-6.0, -3, -7]), [9, 11], [True, False], FLOAT32
    )
    correct = paired.correctness({sel.SFT: sft, "argilla": arm})
    assert correct[sel.SFT].tolist() == [False, True, False]
    assert correct["argilla"].tolist() == [True, False, False]
    figures = paired.policy_figures({"argilla": arm, sel.SFT: sft}, PAIRED, max_new_tokens=16)
    policy = figures["policies"]["argilla"]
    assert policy["correct"] == 1 and policy["n"] == 3
    assert policy["method"] == paired.ARM_METHOD
    assert figures["policies"][sel.SFT]["method"] == paired.SFT_METHOD
    assert policy["mean_chosen_logp_change"] == pytest.approx(-7 / 3)
    assert policy["generation"] == {
        "prompts": 2,
        "max_new_tokens": 16,
        "mean_tokens": 10.0,
        "terminated_fraction": 0.5,
    }
    assert figures["policies"][sel.SFT]["mean_chosen_logp_change"] == 0.0
    assert policy["precision"] == FLOAT32
    assert len(figures["comparisons"]) == 1


# --- arm standing ---------------------------------------------------------------------------


def arm_result(arm: str, status: str = PASSED, **extra) -> ArmResult:
    return ArmResult.of({"arm": arm, "status": status, "descoped": status == DESCOPED, **extra})


def tripwire(ended: bool, rerun: bool, alarms=("loss_spike",)) -> dict:
    runs = ["first", "rerun"] if rerun else ["first"]
    fired = [
        {"run": run, "name": n, "step": 12, "value": 9.0, "band": [0.0, 2.0]}
        for run in runs
        if run == "first" or ended
        for n in alarms
    ]
    return {
        "rerun": rerun,
        "result_run": runs[-1],
        "ended_by_tripwire": ended,
        "fired": fired,
        "runs": [{"run": run, "signals": {}, "bands": {}} for run in runs],
    }


def test_a_descoped_arm_was_never_measured():
    standing = sel.arm_standing(arm_result("a", DESCOPED, reason="kept 12 pairs"))
    assert standing["standing"] == sel.NEVER_MEASURED and standing["measured"] is False
    assert standing["reason"].startswith("never measured") and "kept 12 pairs" in standing["reason"]
    assert standing["tripwire"] == sel.NOT_RECORDED


def test_a_tripwire_ended_arm_was_measured_badly_even_with_a_passed_status():
    standing = sel.arm_standing(arm_result("a", tripwire=tripwire(ended=True, rerun=True)))
    assert standing["standing"] == sel.TRIPWIRE_ENDED and standing["measured"] is True
    assert standing["reason"].startswith("measured badly") and "loss_spike" in standing["reason"]
    assert standing["rerun"] is True and standing["alarms"] == ["loss_spike"]


def test_a_failed_arm_was_measured_badly():
    standing = sel.arm_standing(arm_result("a", FAILED, reason="nan loss"))
    assert standing["standing"] == sel.FAILED_ARM
    assert standing["reason"] == "measured badly: arm result FAILED (nan loss)"


def test_a_passed_arm_is_eligible_and_a_passed_rerun_says_so():
    plain = sel.arm_standing(arm_result("a"))
    assert (plain["standing"], plain["reason"], plain["tripwire"]) == (
        sel.ELIGIBLE,
        "passed",
        sel.NOT_RECORDED,
    )
    rerun = sel.arm_standing(arm_result("a", tripwire=tripwire(ended=False, rerun=True)))
    assert rerun["standing"] == sel.ELIGIBLE and "rerun passed" in rerun["reason"]
    assert rerun["tripwire"] == "recorded"


def test_an_unknown_status_is_refused():
    with pytest.raises(GateRefused, match="unknown status 'DONE'"):
        sel.arm_standing(arm_result("a", "DONE"))


# --- the selection rule, every branch ------------------------------------------------------


def comparison(a: str, b: str, diff: float, low: float, high: float) -> dict:
    return {
        "a": a,
        "b": b,
        "accuracy_a": 0.5 + diff / 2,
        "accuracy_b": 0.5 - diff / 2,
        "diff": diff,
        "ci_low": low,
        "ci_high": high,
        "confidence": 0.95,
        "excludes_zero": low > 0 or high < 0,
    }


ELIGIBLE = {"standing": sel.ELIGIBLE, "reason": "passed"}
DESCOPED_ARM = {"standing": sel.NEVER_MEASURED, "reason": "never measured: descoped (few pairs)"}
TRIPPED = {"standing": sel.TRIPWIRE_ENDED, "reason": "measured badly: training ended by a tripwire"}


def decide(standings, comparisons, default="argilla"):
    return sel.decide("paired_accuracy", default, standings, comparisons)


def test_the_better_arm_is_selected_when_the_interval_excludes_zero():
    standings = {"argilla": ELIGIBLE, "steppairs": ELIGIBLE}
    result = decide(standings, [comparison("argilla", "steppairs", -0.12, -0.2, -0.04)])
    assert (result["selected"], result["branch"]) == ("steppairs", "paired_accuracy")
    assert "steppairs 0.560 vs argilla 0.440, difference +0.120" in result["reason"]
    ahead = decide(standings, [comparison("argilla", "steppairs", 0.1, 0.02, 0.18)], "steppairs")
    assert (ahead["selected"], ahead["branch"]) == ("argilla", "paired_accuracy")


def test_the_default_arm_is_selected_when_the_interval_includes_zero():
    standings = {"argilla": ELIGIBLE, "steppairs": ELIGIBLE}
    result = decide(standings, [comparison("argilla", "steppairs", -0.05, -0.12, 0.02)])
    assert (result["selected"], result["branch"]) == ("argilla", "default_arm")
    assert "includes" not in result["reason"] and "excludes 0" in result["reason"]
    assert "pre-registered default arm argilla" in result["reason"]


def test_comparisons_with_the_sft_policy_do_not_decide_between_arms():
    standings = {"argilla": ELIGIBLE, "steppairs": ELIGIBLE}
    result = decide(
        standings,
        [
            comparison("argilla", "steppairs", 0.01, -0.05, 0.07),
            comparison("steppairs", sel.SFT, 0.3, 0.2, 0.4),
        ],
        default="steppairs",
    )
    assert (result["selected"], result["branch"]) == ("steppairs", "default_arm")


def test_with_three_arms_only_an_arm_beating_every_other_wins():
    standings = {"a": ELIGIBLE, "b": ELIGIBLE, "c": ELIGIBLE}
    beats_one = [
        comparison("a", "b", 0.1, 0.05, 0.15),
        comparison("a", "c", 0.02, -0.03, 0.07),
        comparison("b", "c", -0.08, -0.12, -0.04),
    ]
    assert decide(standings, beats_one, default="b")["branch"] == "default_arm"
    beats_all = [*beats_one[:1], comparison("a", "c", 0.09, 0.04, 0.14), beats_one[2]]
    assert decide(standings, beats_all, default="b")["selected"] == "a"


def test_an_inconclusive_comparison_with_an_ineligible_default_selects_nothing():
    standings = {"a": DESCOPED_ARM, "b": ELIGIBLE, "c": ELIGIBLE}
    result = decide(standings, [comparison("b", "c", 0.01, -0.04, 0.06)], default="a")
    assert (result["selected"], result["branch"]) == (None, "inconclusive_default_not_eligible")
    assert "default arm a is not eligible (never measured" in result["reason"]


def test_the_only_eligible_arm_is_selected_and_the_others_named_with_why():
    descoped = decide({"argilla": DESCOPED_ARM, "steppairs": ELIGIBLE}, [])
    assert (descoped["selected"], descoped["branch"]) == ("steppairs", "only_eligible_arm")
    assert descoped["excluded"] == {"argilla": DESCOPED_ARM["reason"]}
    assert "argilla never measured" in descoped["reason"]
    tripped = decide({"argilla": ELIGIBLE, "steppairs": TRIPPED}, [])
    assert tripped["selected"] == "argilla" and "steppairs measured badly" in tripped["reason"]


def test_no_eligible_arm_selects_nothing_and_says_why():
    result = decide({"argilla": DESCOPED_ARM, "steppairs": TRIPPED}, [])
    assert (result["selected"], result["branch"]) == (None, "no_eligible_arm")
    assert "never measured" in result["reason"] and "measured badly" in result["reason"]


# --- generation sanity ----------------------------------------------------------------------

BAND = GenerationBand.of(
    GenerationBandConfig(),
    {"terminated_fraction": 1.0, "mean_tokens": 17.2},
    {"terminated_fraction": 1.0, "mean_tokens": 18.4},
)


def generations(**by_arm: tuple[float, float]) -> dict:
    return {
        arm: {"generation": {"terminated_fraction": t, "mean_tokens": n}}
        for arm, (t, n) in by_arm.items()
    }


def test_an_arm_whose_policy_stops_ending_its_generations_is_ineligible_and_not_selected():
    standings = {
        "argilla": sel.arm_standing(arm_result("argilla")),
        "steppairs": sel.arm_standing(arm_result("steppairs")),
    }
    policies = generations(argilla=(0.9375, 16.5), steppairs=(0.0, 48.0), sft=(1.0, 17.2))
    judged = sel.judge_generations(standings, policies, BAND)
    assert (
        judged["argilla"]["standing"] == sel.ELIGIBLE and judged["argilla"]["generation"]["inside"]
    )
    runaway = judged["steppairs"]
    assert (runaway["standing"], runaway["measured"]) == (sel.INELIGIBLE, True)
    assert "terminated fraction 0.00 below the minimum 0.75" in runaway["reason"]
    assert "mean generation length 48.0 tokens outside [8.6, 27.6]" in runaway["reason"]
    assert runaway["generation"]["terminated_fraction"] == 0.0
    # Its paired accuracy beats argilla's with an interval above 0, and still it is not chosen.
    result = decide(judged, [comparison("steppairs", "argilla", 0.11, 0.03, 0.19)])
    assert (result["selected"], result["branch"]) == ("argilla", "only_eligible_arm")
    assert result["excluded"] == {"steppairs": runaway["reason"]}


def test_with_no_eligible_arm_the_selection_reports_none_with_the_reasons():
    standings = {
        "argilla": sel.arm_standing(arm_result("argilla")),
        "steppairs": sel.arm_standing(arm_result("steppairs", tripwire=tripwire(False, True))),
    }
    policies = generations(argilla=(0.125, 44.8), steppairs=(0.5, 30.0), sft=(1.0, 17.2))
    judged = sel.judge_generations(standings, policies, BAND)
    assert {arm: s["standing"] for arm, s in judged.items()} == dict.fromkeys(
        standings, sel.INELIGIBLE
    )
    result = decide(judged, [comparison("argilla", "steppairs", 0.05, -0.02, 0.12)])
    assert (result["selected"], result["branch"]) == (None, "no_eligible_arm")
    assert "argilla measured, but its greedy generations leave" in result["reason"]
    assert "terminated fraction 0.12 below the minimum 0.75" in result["reason"]
    assert "steppairs measured, but" in result["reason"]
    assert "mean generation length 30.0 tokens outside" in result["reason"]


def test_arms_already_excluded_keep_their_reason_and_unscored_arms_are_unchanged():
    standings = {
        "argilla": sel.arm_standing(arm_result("argilla", tripwire=tripwire(True, True))),
        "ultra": sel.arm_standing(arm_result("ultra", DESCOPED, reason="kept 12 pairs")),
    }
    judged = sel.judge_generations(standings, generations(argilla=(0.0, 48.0)), BAND)
    assert judged["argilla"]["standing"] == sel.TRIPWIRE_ENDED
    assert judged["argilla"]["generation"]["inside"] is False
    assert judged["ultra"] == standings["ultra"]


def test_a_comparison_reads_the_same_from_either_side():
    forward = comparison("a", "b", 0.1, 0.02, 0.2)
    flipped = sel.oriented([forward], "b", "a")
    assert (flipped["diff"], flipped["ci_low"], flipped["ci_high"]) == (-0.1, -0.2, -0.02)
    assert (flipped["accuracy_a"], flipped["accuracy_b"]) == (
        forward["accuracy_b"],
        forward["accuracy_a"],
    )
    with pytest.raises(ValueError, match="no paired comparison of a and c"):
        sel.oriented([forward], "a", "c")


def test_an_unknown_rule_is_refused():
    with pytest.raises(ConfigError, match="rule expected one of"):
        sel.decide("best_loss", "a", {"a": ELIGIBLE}, [])


# --- the pre-registration ------------------------------------------------------------------


def test_the_shipped_pre_registration_loads_and_checks():
    cfg = load_config(ROOT / "config" / "selection.toml", SelectionConfig).cfg
    sel.check_selection_config(cfg, ["argilla", "steppairs"], "selection.toml")
    assert (cfg.rule, cfg.default_arm, cfg.paired.eval_set) == (
        "paired_accuracy",
        "argilla",
        "union",
    )


@pytest.mark.parametrize(
    ("edit", "arms", "message"),
    [
        ({"rule": "best_loss"}, ["argilla"], "key 'rule' expected one of"),
        ({"default_arm": "ultra"}, ["argilla"], "key 'default_arm' expected one of"),
        ({}, ["argilla", "sft"], "arm name 'sft'"),
    ],
)
def test_a_pre_registration_the_rule_cannot_use_is_refused(edit, arms, message):
    cfg = SelectionConfig(default_arm="argilla")
    for key, value in edit.items():
        setattr(cfg, key, value)
    with pytest.raises(ConfigError, match=message):
        sel.check_selection_config(cfg, arms, "selection.toml")


def test_a_zero_bootstrap_count_and_an_unknown_key_are_refused(tmp_path):
    toml = tmp_path / "selection.toml"
    toml.write_text('rule = "paired_accuracy"\n[paired]\nn_boot = 0\n')
    with pytest.raises(ConfigError, match=r"'paired\.n_boot' expected an integer >= 1"):
        load_config(toml, SelectionConfig)
    toml.write_text('rule = "paired_accuracy"\n[paired]\nnboot = 5\n')
    with pytest.raises(ConfigError, match=r"unknown key 'paired\.nboot'"):
        load_config(toml, SelectionConfig)


# --- a fabricated run: the selection's gates and the stage end to end ----------------------

ARMS = ("alpha", "beta", "gamma")


def write_arm_toml(directory: Path, arm: str) -> Path:
    path = directory / f"{arm}.toml"
    path.write_text(f'arm = "{arm}"\n')
    return path


def held_shard(tokenizer, rng, n: int) -> dict[str, np.ndarray]:
    from align.data.shards import pair_arrays
    from align.data.tokenize import TokenizedPair

    def tokens(low: int, high: int) -> list[int]:
        return rng.integers(10, 250, size=rng.integers(low, high)).tolist()

    pairs = [
        TokenizedPair(
            prompt=tokens(2, 6),
            chosen=[*tokens(1, 5), tokenizer.eos_id],
            rejected=[*tokens(1, 5), tokenizer.eos_id],
            truncated=False,
        )
        for _ in range(n)
    ]
    return pair_arrays(rng.integers(0, 2**62, size=n).tolist(), pairs, tokenizer.pad_id)


@pytest.fixture(scope="module")
def fabricated_run(tmp_path_factory) -> Path:
    """A results dir as the workflow leaves it before select_arms, with tiny random models:
    alpha passed, beta was ended by a tripwire, gamma was descoped. Receipts name paths
    relative to the results directory, as the workflow's do."""
    from align.data.shards import PAIR_FORMAT, write_shard
    from align.model.tiny import make_tiny_model
    from align.model.tokenizer import load_tokenizer, train_bpe_tokenizer
    from align.utils.weights_hash import weights_hash

    work = tmp_path_factory.mktemp("selection_run")
    paths = RunPaths.of("results")
    tok_dir = train_bpe_tokenizer(["a chosen answer", "a rejected answer"] * 20, 300, work / "tok")
    tokenizer = load_tokenizer(tok_dir)
    make_tiny_model(work / paths.sft_checkpoint, tok_dir, seed=0, **TINY_SIZES)
    receipt = {"schema_version": SCHEMA_VERSION, "status": PASSED}
    write_json_atomic(
        work / paths.sft_gate,
        {
            **receipt,
            "stage": "sft_gate",
            "passed": True,
            "checkpoint": recorded(paths.sft_checkpoint),
            "checkpoint_hash": weights_hash(work / paths.sft_checkpoint),
        },
    )
    rng = np.random.default_rng(0)
    arms = {}
    for arm in ARMS:
        shard = paths.arm(arm).shard("held")
        write_shard(work / shard, held_shard(tokenizer, rng, 24), PAIR_FORMAT, arm=arm)
        held = {"path": recorded(shard), "hash": hash_file(work / shard)}
        arms[arm] = {"status": PASSED, "counts": {"train": 0, "held": 24}, "shards": {"held": held}}
    pins = {"pad_id": tokenizer.pad_id, "eos_id": tokenizer.eos_id, "bos_id": tokenizer.bos_id}
    write_json_atomic(
        work / paths.manifest, {**receipt, "stage": "build_manifest", "arms": arms, "pins": pins}
    )
    for seed, arm in enumerate(ARMS[:2], start=1):
        policy = paths.arm(arm).policy_dir
        make_tiny_model(work / policy, tok_dir, seed=seed, **TINY_SIZES)
        extra = {"tripwire": tripwire(ended=True, rerun=True)} if arm == "beta" else {}
        result = {
            **receipt,
            "stage": "dpo",
            "arm": arm,
            "descoped": False,
            "checkpoint": recorded(paths.sft_checkpoint),
            "policy": recorded(policy),
            "outputs": {recorded(policy): weights_hash(work / policy)},
        }
        write_json_atomic(work / paths.arm(arm).arm_result, {**result, **extra})
    descoped = {"stage": "dpo", "arm": "gamma", "descoped": True, "reason": "kept 24 pairs"}
    write_json_atomic(
        work / paths.arm("gamma").arm_result, {**receipt, **descoped, "status": DESCOPED}
    )
    for arm in ARMS:
        write_arm_toml(work, arm)
    (work / "selection.toml").write_text(SELECTION_TOML + PERMISSIVE_BAND)
    return work


SELECTION_TOML = (
    'rule = "paired_accuracy"\ndefault_arm = "beta"\n'
    "[paired]\nn_boot = 500\nseed = 1\n[generation_check]\nprompts = 3\nmax_new_tokens = 6\n"
)
# The random tiny models never end a generation; most tests here are about the other rules.
PERMISSIVE_BAND = "[generation_band]\nmin_terminated_vs_sft = 0.0\nmin_terminated_vs_chosen = 0.0\n"


def recorded(path: Path) -> str:
    """A path under results/ as a receipt names it: relative to the results directory."""
    return path.relative_to("results").as_posix()


def run_select(work: Path) -> subprocess.CompletedProcess:
    configs = [str(work / "selection.toml"), *(str(work / f"{arm}.toml") for arm in ARMS)]
    return subprocess.run(
        [
            sys.executable,
            str(SELECT_SCRIPT),
            *configs,
            "--run.results_dir=results",
            "--run.threads=1",
        ],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def selection_run(fabricated_run) -> subprocess.CompletedProcess:
    run = run_select(fabricated_run)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def selection(selection_run, fabricated_run) -> dict:
    return read_json(fabricated_run / "results" / "selection.json")


def test_the_stage_names_the_descoped_and_the_tripwire_ended_arm_apart(selection):
    arms = selection["arms"]
    assert arms["gamma"]["standing"] == sel.NEVER_MEASURED
    assert arms["gamma"]["reason"].startswith("never measured")
    assert arms["beta"]["standing"] == sel.TRIPWIRE_ENDED
    assert arms["beta"]["reason"].startswith("measured badly")
    decision = selection["decision"]
    assert (decision["selected"], decision["branch"]) == ("alpha", "only_eligible_arm")
    assert set(decision["excluded"]) == {"beta", "gamma"}
    assert selection["status"] == PASSED and selection["stage"] == "select_arms"


def test_the_stage_scores_measured_policies_on_the_union_of_held_out_shards(selection):
    figures = selection["figures"]
    assert set(figures["policies"]) == {sel.SFT, "alpha", "beta"}
    eval_set = figures["eval_set"]
    assert eval_set["pairs"] == 72 and eval_set["sources"] == {"alpha": 24, "beta": 24, "gamma": 24}
    assert [(c["a"], c["b"]) for c in figures["comparisons"]] == [
        ("alpha", "beta"),
        ("alpha", sel.SFT),
        ("beta", sel.SFT),
    ]
    for policy in figures["policies"].values():
        assert policy["n"] == 72 and policy["generation"]["prompts"] == 3
        assert 0 <= policy["generation"]["mean_tokens"] <= 6
        # Read back from the live model that scored, not copied from the config.
        assert policy["precision"]["compute"] == "float32", policy["precision"]
    assert figures["policies"][sel.SFT]["mean_chosen_logp_change"] == 0.0
    assert len(figures["devices"]) == 1 and ":cpu" in figures["devices"][0], figures


def test_the_stage_records_and_shows_the_precision_and_devices_that_scored(
    selection, selection_run
):
    figures = selection["figures"]
    precision = figures["precision"]
    assert (precision["compute"], precision["master"], precision["loss"]) == ("float32",) * 3
    assert precision["read_back"]["linear_weights"] == ["float32"]
    assert all(p["precision"] == precision for p in figures["policies"].values())
    banner = figures["banner"]
    assert "compute float32, master float32, reduce float32, loss head float32" in banner
    assert f"0={figures['devices'][0]}" in banner and "72 pairs" in banner
    assert "alpha (alpha/policy)" in banner and "sft (sft/checkpoint)" in banner
    assert f"align select_arms: banner\n{banner}" in selection_run.stderr


def test_policies_scored_at_different_precisions_are_refused_by_name():
    def scored(compute: str) -> paired.PolicyScores:
        record = {"compute": compute, "master": "float32", "reduce": "float32", "loss": "float32"}
        return paired.PolicyScores(np.zeros(2), np.zeros(2), [1], [True], record)

    same = {"alpha": scored("float32"), sel.SFT: scored("float32")}
    assert paired.shared_precision(same) == same["alpha"].precision
    mixed = {"alpha": scored("float32"), "beta": scored("bfloat16"), sel.SFT: scored("float32")}
    with pytest.raises(
        ConfigError, match=r"\['beta'\] were scored at another precision than alpha"
    ):
        paired.shared_precision(mixed)


def test_the_receipt_records_the_rule_and_the_hashes_of_what_it_read(selection, fabricated_run):
    paths = RunPaths.of("results")
    inputs = selection["inputs"]
    for arm in ARMS:
        assert inputs[f"{arm}/arm_result.json"] == hash_file(
            fabricated_run / paths.arm(arm).arm_result
        )
    assert {"alpha/policy", "beta/policy", "sft/checkpoint"} <= set(inputs)
    assert selection["rule"]["name"] == "paired_accuracy"
    assert selection["rule"]["paired"]["n_boot"] == 500
    eval_set = selection["figures"]["eval_set"]
    assert selection["outputs"] == {eval_set["path"]: eval_set["hash"]}
    assert [g["gate"] for g in selection["gates"]][:3] == ["sft_gate", "sft_weights", "manifest"]


def test_a_policy_changed_after_its_arm_result_is_refused_before_torch(fabricated_run, tmp_path):
    work = tmp_path / "run"
    shutil.copytree(fabricated_run, work)
    (work / "results" / "selection.json").unlink(missing_ok=True)
    (work / "results" / "selection" / "eval_pairs.safetensors").unlink(missing_ok=True)
    weights = work / "results" / "alpha" / "policy" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    run = run_select(work)
    assert run.returncode == GATE_REFUSED, run.stderr[-2000:]
    assert "gate arm_result" in run.stderr and "weights hash expected" in run.stderr
    assert not (work / "results" / "selection.json").exists()
    assert not (work / "results" / "selection" / "eval_pairs.safetensors").exists()


def test_a_named_eval_shard_must_be_a_pair_shard(fabricated_run, tmp_path):
    manifest = Manifest.read(fabricated_run / "results" / "data" / "manifest.json")
    assert set(sel.eval_set_sources("union", manifest, ARMS)) == set(ARMS)
    not_a_shard = tmp_path / "pairs.safetensors"
    from align.data.shards import write_shard

    write_shard(not_a_shard, {"x": np.zeros(2, dtype=np.int32)}, "align-sft-v1")
    with pytest.raises(GateRefused, match="format expected 'align-pairs-v1'"):
        sel.eval_set_sources(str(not_a_shard), manifest, ARMS)
    with pytest.raises(GateRefused, match="names no file"):
        sel.eval_set_sources(str(tmp_path / "missing.safetensors"), manifest, ARMS)


def test_a_passed_arm_result_without_a_policy_is_refused(tmp_path):
    paths = RunPaths.of(tmp_path / "results")
    sft = str(paths.sft_checkpoint)
    result = {"schema_version": SCHEMA_VERSION, "stage": "dpo", "status": PASSED, "arm": "alpha"}
    write_json_atomic(paths.arm("alpha").arm_result, result)
    with pytest.raises(GateRefused, match="a PASSED arm result names no policy"):
        sel.arm_result_gate(paths, "alpha", sft)
    write_json_atomic(paths.arm("alpha").arm_result, {**result, "arm": "beta"})
    with pytest.raises(GateRefused, match="arm expected 'alpha', found 'beta'"):
        sel.arm_result_gate(paths, "alpha", sft)
    trained_elsewhere = {**result, "policy": "alpha/policy", "checkpoint": "other/sft"}
    write_json_atomic(paths.arm("alpha").arm_result, trained_elsewhere)
    with pytest.raises(GateRefused, match="trained from 'other/sft'"):
        sel.arm_result_gate(paths, "alpha", sft)


def test_the_stage_with_no_eligible_arm_writes_a_failed_receipt_naming_every_reason(
    fabricated_run, tmp_path
):
    work = tmp_path / "run"
    shutil.copytree(fabricated_run, work)
    # The shipped band: the data's chosen responses all end, alpha's generations never do.
    (work / "selection.toml").write_text(SELECTION_TOML)
    run = run_select(work)
    assert run.returncode == 0, run.stderr[-3000:]
    receipt = read_json(work / "results" / "selection.json")
    assert receipt["status"] == FAILED
    decision = receipt["decision"]
    assert (decision["selected"], decision["branch"]) == (None, "no_eligible_arm")
    alpha = receipt["arms"]["alpha"]
    assert alpha["standing"] == sel.INELIGIBLE
    assert alpha["generation"]["terminated_fraction"] < 0.75
    assert "below the minimum 0.75" in alpha["reason"]
    assert receipt["figures"]["generation_band"]["min_terminated_fraction"] == 0.75
    assert receipt["figures"]["eval_set"]["chosen_responses"]["terminated_fraction"] == 1.0
    for arm in ARMS:
        assert arm in decision["excluded"] and arm in decision["reason"]
    assert "selected None (no_eligible_arm)" in run.stderr
