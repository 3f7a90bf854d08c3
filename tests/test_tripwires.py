"""Tripwire detectors on synthetic metric streams and generation checks, and their union
across two ranks."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch.multiprocessing as mp

from align.config import DisarmedWires, GenerationBandConfig, TripwireConfig
from align.eval.sanity import GenerationBand
from align.train.tripwires import ChosenCollapse, LengthDrift, PairStats, Tripwires


def stats(logratio, margins, chosen_tokens, rejected_tokens) -> PairStats:
    return PairStats(
        np.asarray(logratio, float),
        np.asarray(margins, float),
        np.asarray(chosen_tokens, float),
        np.asarray(rejected_tokens, float),
    )


BAND = GenerationBand.of(
    GenerationBandConfig(),
    {"terminated_fraction": 1.0, "mean_tokens": 18.0},
    {"terminated_fraction": 1.0, "mean_tokens": 16.0},
)
ONLY_GENERATION = TripwireConfig(
    disarmed=DisarmedWires(collapse="watched elsewhere", length_drift="watched elsewhere"),
)


def never(flag: bool) -> bool:
    return flag


def alone(value: float) -> list[float]:
    """`gather` on one rank."""
    return [value]


def test_collapse_fires_when_chosen_logratio_falls_below_the_floor_while_margins_grow():
    detector = ChosenCollapse(window=8, floor=-0.5)
    detector.update(stats([0.0] * 8, [0.1] * 8, [5] * 8, [5] * 8))
    assert not detector.fired()
    detector.update(stats([-2.0] * 8, [3.0] * 8, [5] * 8, [5] * 8))
    assert detector.fired()
    assert detector.signal() == pytest.approx(-2.0)


def test_collapse_does_not_fire_when_margins_do_not_grow():
    detector = ChosenCollapse(window=8, floor=-0.5)
    detector.update(stats([0.0] * 8, [1.0] * 8, [5] * 8, [5] * 8))
    detector.update(stats([-2.0] * 8, [0.5] * 8, [5] * 8, [5] * 8))
    assert not detector.fired()


def test_collapse_does_not_fire_above_the_floor():
    detector = ChosenCollapse(window=4, floor=-0.5)
    detector.update(stats([0.0] * 4, [0.1] * 4, [5] * 4, [5] * 4))
    detector.update(stats([-0.1] * 4, [2.0] * 4, [5] * 4, [5] * 4))
    assert not detector.fired()


def test_length_drift_fires_only_once_the_window_is_full():
    detector = LengthDrift(window=10, baseline=0.5, band=0.2)
    # Every pair prefers the longer response: fraction 1.0, far outside [0.3, 0.7].
    detector.update(stats([0] * 9, [1.0] * 9, [9] * 9, [4] * 9))
    assert detector.signal() == 1.0
    assert not detector.fired()
    detector.update(stats([0], [1.0], [9], [4]))
    assert detector.fired()


def test_length_drift_ignores_equal_lengths_and_stays_quiet_inside_the_band():
    detector = LengthDrift(window=4, baseline=0.5, band=0.2)
    detector.update(stats([0] * 6, [1, -1, 1, -1, 1, 1], [9, 9, 9, 9, 5, 5], [4, 4, 4, 4, 5, 5]))
    assert len(detector.prefers_longer) == 4
    assert detector.signal() == 0.5
    assert not detector.fired()


def test_tripwires_record_signals_and_bands_per_step():
    wires = Tripwires.armed(TripwireConfig(logps_window=2, length_window_pairs=2), 0.5, BAND)
    wires.update([stats([-0.1, -0.2], [0.1, 0.2], [3, 4], [4, 3])])
    assert wires.check(step=0, gather=alone) == []
    assert wires.signals["chosen_logp_collapse"] == [[0, pytest.approx(-0.15)]]
    assert wires.bands()["length_drift"] == [0.25, 0.75]


def _fed(wires: Tripwires, batches: list[PairStats], first_step: int) -> list[list[str]]:
    """Feed one batch per step; the alarms of each step."""
    fired = []
    for step, batch in enumerate(batches, start=first_step):
        wires.update([batch])
        fired.append([a.name for a in wires.check(step=step, gather=alone)])
    return fired


def test_a_resumed_run_continues_its_tripwire_windows_and_signal_history():
    cfg = TripwireConfig(logps_window=6, length_window_pairs=6, length_band=0.2)
    rng = np.random.default_rng(0)
    batches = [
        stats(rng.normal(-0.3 * i, 0.1, 3), rng.normal(0.2 * i, 0.1, 3), [4, 6, 5], [5, 4, 6])
        for i in range(10)
    ]
    through = Tripwires.armed(cfg, 0.5, BAND)
    alarms = _fed(through, batches, 0)
    assert any(alarms[5:]), "the stream must set a wire off after the stop"

    stopped = Tripwires.armed(cfg, 0.5, BAND)
    before = _fed(stopped, batches[:5], 0)
    saved = json.loads(json.dumps(stopped.state_dict()))
    resumed = Tripwires.armed(cfg, 0.5, BAND)
    resumed.load_state_dict(saved)
    assert before + _fed(resumed, batches[5:], 5) == alarms
    assert resumed.signals == through.signals


def test_a_tripwire_state_of_other_wires_is_refused():
    saved = Tripwires.armed(TripwireConfig(), 0.5, BAND).state_dict()
    with pytest.raises(ValueError, match="this run arms"):
        Tripwires.armed(ONLY_GENERATION, 0.5, BAND).load_state_dict(saved)


def _rank(rank: int, world: int, init: str, out) -> None:
    import torch.distributed as dist

    from align.utils.dist import all_gather_floats

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    only_length = TripwireConfig(
        length_window_pairs=4,
        length_band=0.1,
        disarmed=DisarmedWires(collapse="not under test", generation="not under test"),
    )
    wires = Tripwires.armed(only_length, 0.5)
    # Rank 1's pairs all prefer the longer response; rank 0's do so half the time (in band).
    margins = [1.0, -1.0, 1.0, -1.0] if rank == 1 else [1.0, 1.0, -1.0, -1.0]
    wires.update([stats([0] * 4, margins, [9, 4, 9, 4], [4, 9, 4, 9])])
    assert wires.detectors[0].fired() == (rank == 1)
    alarms = wires.check(step=3, gather=all_gather_floats)
    out.put((rank, [(a.name, a.rank, a.value) for a in alarms]))
    dist.destroy_process_group()


def test_an_alarm_only_rank_1_set_off_records_rank_1s_value_on_every_rank(tmp_path):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = f"file://{tmp_path / 'store'}"
    procs = [ctx.Process(target=_rank, args=(r, 2, init, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    # Rank 0's own signal is 0.5, inside its band; the alarm is rank 1's 1.0 on both.
    assert results == {0: [("length_drift", 1, 1.0)], 1: [("length_drift", 1, 1.0)]}


def check(terminated: float, tokens: float) -> dict:
    return {"prompts": 8, "terminated_fraction": terminated, "mean_tokens": tokens}


def test_the_generation_wire_fires_when_too_few_generations_end():
    wires = Tripwires.armed(ONLY_GENERATION, 0.5, BAND)
    assert wires.check_generation(0, check(1.0, 18.0), never) == []
    assert wires.check_generation(25, check(0.875, 12.0), never) == []
    (alarm,) = wires.check_generation(50, check(0.5, 24.0), never)
    assert (alarm.name, alarm.step, alarm.value) == ("generation_terminated", 50, 0.5)
    assert alarm.band == [pytest.approx(0.75), 1.0]
    assert wires.signals["generation_terminated"] == [[0, 1.0], [25, 0.875], [50, 0.5]]
    assert wires.signals["generation_length"] == [[0, 18.0], [25, 12.0], [50, 24.0]]


def test_the_generation_wire_fires_when_generations_run_outside_the_length_band():
    wires = Tripwires.armed(ONLY_GENERATION, 0.5, BAND)
    alarms = wires.check_generation(25, check(0.0, 40.0), never)
    assert [a.name for a in alarms] == ["generation_terminated", "generation_length"]
    assert wires.bands()["generation_length"] == [pytest.approx(8.0), pytest.approx(27.0)]
    (short,) = wires.check_generation(50, check(1.0, 2.0), never)
    assert short.name == "generation_length"


def test_an_armed_generation_wire_needs_its_band_and_an_unarmed_one_takes_no_check():
    with pytest.raises(ValueError, match="no generation band"):
        Tripwires.armed(ONLY_GENERATION, 0.5)
    unarmed = TripwireConfig(disarmed=DisarmedWires(generation="a test"))
    wires = Tripwires.armed(unarmed, 0.5)
    assert "generation_terminated" not in wires.bands()
    with pytest.raises(ValueError, match="not armed"):
        wires.check_generation(0, check(1.0, 18.0), never)


def test_a_wire_that_is_not_one_is_refused_by_name():
    with pytest.raises(KeyError, match="'colapse' is not a tripwire"):
        TripwireConfig().armed("colapse")


def test_every_rerun_response_setting_lands_in_the_arm_and_is_recorded():
    from align.config import ArmConfig, TripwireResponse

    fields = {f.name for f in dataclasses.fields(TripwireResponse)}
    assert set(TripwireResponse.TARGETS) == fields
    arm = ArmConfig(arm="a")
    TripwireResponse(lr=1e-7, beta=0.5, rpo_alpha=1.0).applied_to(arm)
    assert TripwireResponse.settings_of(arm) == {"lr": 1e-7, "beta": 0.5, "rpo_alpha": 1.0}
