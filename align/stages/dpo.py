"""The DPO stage of one arm: the throughput probe, or training and held-out evaluation.

Trains the policy from the SFT checkpoint against the reference cache the gates
chose, and scores the SFT and final policies on the held-out pairs the same way.
The probe runs the same set-up for `probe_steps` micro-steps and measures it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from align.config import ArmConfig, TripwireResponse
from align.data.loader import PairShard
from align.eval.generation import generation_check, generation_prompts
from align.eval.preference import implicit_reward_preference, policy_preference, score_pairs
from align.eval.sanity import GenerationBand, chosen_responses, judge
from align.exit_codes import ConfigError
from align.kernels.flex import compile_seconds
from align.log import stage_logger
from align.losses.dpo import DPOObjective
from align.paths import FIRST_RUN, RERUN, SPLITS, ended_run_in
from align.receipts import read_json, write_json_atomic
from align.stages.arm_result import TripwireRecord
from align.stages.entry import is_main_process
from align.stages.gates import CacheInUse, Gated, Probed
from align.stages.phase_stops import EVALUATE, EXPORT, PhaseStops, Trained, resume_evaluation
from align.train.adapters import DpoAdapter
from align.train.path_bias import TrainingPath
from align.train.phases import PhaseMeter
from align.train.precision import describe as describe_precision
from align.train.probes import Beside, probe_figures, run_projection_s, worst_case_runs
from align.train.ref_cache import load_ref_cache
from align.train.session import build_trainer, export_policy, load_policy, start_session
from align.train.tripwires import Alarm, Tripwires, describe_alarm
from align.utils.dist import DistInfo, all_gather_floats, any_rank, barrier
from align.utils.weights_hash import weights_fingerprint

LOG = stage_logger("dpo")


def _ref(cache: CacheInUse, shard: PairShard) -> tuple[torch.Tensor, torch.Tensor]:
    chosen, rejected = load_ref_cache(cache.path, cache.key, shard.pair_ids)
    return torch.from_numpy(chosen), torch.from_numpy(rejected)


@dataclass
class Session:
    """A training run's live objects: the ranks, the shards and reference log-probs by
    split, the policy and its trainer."""

    info: DistInfo
    shards: dict[str, PairShard]
    refs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    model: Any
    trainer: Any

    def end_training(self) -> None:
        """Drop the trainer and with it the optimizer state: export and evaluation need only
        the policy, and their memory projections count no optimizer."""
        self.trainer = None


def _setup(
    cfg: ArmConfig,
    gated: Gated,
    run_dir: Path,
    trainer_cfg,
    meter: PhaseMeter,
    stage_started: float,
    projected_wall_s: float | None = None,
) -> Session:
    info = start_session(run_dir, cfg.run, cfg.batch)
    shards = {split: PairShard(gated.entry.shards[split], cfg.batch.layout) for split in SPLITS}
    refs = {split: _ref(gated.caches[split], shards[split]) for split in SPLITS}
    with meter.phase("load"):
        model = load_policy(gated.checkpoint, cfg.model, info, trainer_cfg)
    trainer = build_trainer(
        model,
        shards["train"],
        DpoAdapter(DPOObjective.of(cfg.dpo), *refs["train"]),
        optim=cfg.optimizer,
        batch=cfg.batch,
        trainer=trainer_cfg,
        run_dir=run_dir,
        stage="dpo",
        info=info,
        stage_started=stage_started,
        stop_marker=gated.arm.stop_marker,
        projected_wall_s=projected_wall_s,
    )
    return Session(info, shards, refs, model, trainer)


def local_device_peak_mb(info: DistInfo) -> float | None:
    """This rank's device peak (torch.cuda.max_memory_allocated), None off CUDA."""
    if info.device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(info.device) / 2**20


def rank_device_peaks(local_device_mb: float | None) -> list[float]:
    """Every rank's device peak in MiB, in rank order; none off CUDA."""
    return [] if local_device_mb is None else all_gather_floats(local_device_mb)


def run_probe(
    cfg: ArmConfig, gated: Gated, stage_started: float
) -> tuple[dict[str, Any], DistInfo]:
    probe_cfg = dataclasses.replace(
        cfg.trainer, max_micro_steps=cfg.trainer.probe_steps, resume=False, checkpoint_every=0
    )
    meter = PhaseMeter(cfg.run.device)
    session = _setup(cfg, gated, gated.arm.probe_run_dir, probe_cfg, meter, stage_started)
    info, model, trainer = session.info, session.model, session.trainer
    tokens_per_s: list[float] = []
    with meter.phase("train"):
        trainer.fit(on_step=lambda m: tokens_per_s.append(m["tokens_per_s"]))
        checkpoint_s = timed_save(trainer)
        generation_s = timed_generation_check(cfg, gated, session.shards["held"], model, info)
    beside = Beside(
        checkpoint_s,
        cfg.trainer.checkpoint_every,
        generation_s,
        cfg.tripwires.generation_every_steps,
    )
    # The job's peak is its fullest phase's; every rank's device peak is the training one.
    rss = meter.job_host_peak_mb()
    device_peaks = rank_device_peaks(local_device_peak_mb(info))
    projected = gated.projection.device_allocated_mb
    figures = probe_figures(
        trainer.state.step_times,
        tokens_per_s,
        trainer.state.micro_step,
        [trainer.source.step_tokens(step) for step in range(len(trainer.source))],
        rss,
        device_peaks,
        projected,
        beside,
        runs=worst_case_runs(cfg.tripwires.armed_wires()),
    )
    placed = {"precision": model.precision, "devices": list(info.devices)}
    path = TrainingPath.of_model(model, cfg.batch.micro_batch, cfg.batch.layout)
    return {
        **figures,
        "checkpoint_s": checkpoint_s,
        # A compiled attention kernel (flex) pays its compilation once per shape bucket.
        "attention_compilations": compile_seconds(),
        "training_path": path.as_dict(),
        **placed,
        "phases": meter.report(gated.projection.figures),
    }, info


def timed_generation_check(cfg: ArmConfig, gated: Gated, held, model, info) -> float | None:
    """Seconds of one generation check as training runs it (None: the wire is unarmed)."""
    if not cfg.tripwires.armed("generation"):
        return None
    schedule = GenerationSchedule.of(cfg, held, gated.entry.pins)
    started = time.perf_counter()
    schedule.run(model, info, 0)
    barrier()
    return time.perf_counter() - started


def timed_save(trainer) -> float:
    """Seconds one real checkpoint of this model and optimizer takes to save; the probe's
    checkpoint is removed after, as nothing resumes from it."""
    started = time.perf_counter()
    checkpoint = trainer.save()
    seconds = time.perf_counter() - started
    barrier()
    if trainer.info.is_main:
        shutil.rmtree(checkpoint.path)
    return seconds


def banner(cfg: ArmConfig, gated: Gated, model, info: DistInfo) -> str:
    """What is about to train, read off the running objects rather than the config."""
    counts = gated.entry.counts
    rows = [
        ("arm", cfg.arm),
        ("checkpoint", f"{gated.checkpoint} ({gated.checkpoint_weights[:12]})"),
        ("pairs", f"train {counts['train']}, held {counts['held']}"),
        (
            "cache",
            f"{gated.caches['train'].key.forward_impl} shard {gated.caches['train'].key.shard[:12]}",
        ),
        ("path bias", f"ratio {gated.path_bias.ratio:.3f} -> {gated.path_bias.action}"),
        (
            "RSS projection",
            f"{gated.projection.total_mb:.0f} MiB for {gated.projection.optimizer}",
        ),
        ("attention", model.attn_implementation),
        ("precision", describe_precision(model.precision)),
        ("world size", str(info.world_size)),
        (
            "projected wall",
            f"{gated.probe.projected_wall_s:.0f} s (probe median {gated.probe.median_step_s:.3f} s/step)",
        ),
    ]
    return "\n".join(f"  {name:<15} {value}" for name, value in rows)


class TripwireAlarm(Exception):
    """Raised on every rank together when an armed tripwire fires."""

    def __init__(self, alarms: list[Alarm]):
        super().__init__(", ".join(describe_alarm(a.as_dict()) for a in alarms))
        self.alarms = alarms


def chosen_longer_baseline(shard: PairShard) -> float:
    """Among pairs whose responses differ in length, the fraction where chosen is longer."""
    a = shard.arrays
    chosen, rejected = a["chosen_len"] - a["prompt_len"], a["rejected_len"] - a["prompt_len"]
    unequal = chosen != rejected
    return float((chosen[unequal] > rejected[unequal]).mean()) if unequal.any() else 0.5


def with_response(cfg: ArmConfig) -> tuple[ArmConfig, dict[str, Any]]:
    """The arm's configuration for its one rerun: the pre-registered response applied."""
    response = cfg.tripwires.response
    if not response.changes():
        raise ConfigError(
            f"arm {cfg.arm}: a tripwire fired but tripwires.response pre-registers no change"
        )
    rerun = copy.deepcopy(cfg)
    response.applied_to(rerun)
    return rerun, response.changes()


@dataclass
class GenerationSchedule:
    """The periodic generation check of one run: a fixed held-out prompt set, its cadence,
    and every check made (after `step` optimizer steps; 0 is the SFT policy, before training)."""

    prompts: list[list[int]]
    every_steps: int
    max_new_tokens: int
    eos_id: int
    pad_id: int
    checks: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, cfg: ArmConfig, held: PairShard, pins: dict[str, Any]) -> GenerationSchedule:
        wires = cfg.tripwires
        return cls(
            generation_prompts(held.arrays, wires.generation_check.prompts),
            wires.generation_every_steps,
            wires.generation_check.max_new_tokens,
            pins["eos_id"],
            pins["pad_id"],
        )

    def due(self, steps_done: int, horizon: int) -> bool:
        return steps_done % self.every_steps == 0 or steps_done == horizon

    def run(self, model, info: DistInfo, steps_done: int) -> dict[str, Any]:
        """One check, on every rank together; the same figures come back on each."""
        check = generation_check(
            model, self.prompts, self.max_new_tokens, self.eos_id, self.pad_id, info
        )
        record = {"step": steps_done, **check.as_dict()}
        self.checks.append(record)
        if info.is_main:
            LOG.info(
                f"generation check after {steps_done} steps: "
                f"{check.terminated_fraction:.3f} of {check.prompts} ended, "
                f"mean {check.mean_tokens:.1f} tokens"
            )
        return record


@dataclass
class WireState:
    """A run's tripwire windows, signal history and generation checks: the rank state its
    checkpoints hold, so a resumed run continues them."""

    tripwires: Tripwires
    schedule: GenerationSchedule | None

    def state_dict(self) -> dict[str, Any]:
        checks = self.schedule.checks if self.schedule is not None else []
        return {"tripwires": self.tripwires.state_dict(), "generation_checks": checks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tripwires.load_state_dict(state["tripwires"])
        if self.schedule is not None:
            self.schedule.checks[:] = state["generation_checks"]


def run_record(cfg: ArmConfig) -> dict[str, Any]:
    """The settings a rerun's response can change, as a run records them."""
    return TripwireResponse.settings_of(cfg)


@dataclass(frozen=True)
class RunRecord:
    """One training run as ended.json and the arm result's tripwire section record it."""

    run: str  # FIRST_RUN or RERUN
    config: dict[str, Any]  # the settings a rerun's response can change (run_record)
    summary: dict[str, Any]  # the trainer's summary: steps, horizon, final figures
    alarms: list[dict[str, Any]]  # the alarms that ended it (none: it ran to its horizon)
    signals: dict[str, list[list[float]]]  # each wire's [step, value] series
    bands: dict[str, Any]  # each wire's band
    generation_checks: list[dict[str, Any]]
    generation_band: dict[str, Any] | None

    @classmethod
    def of(cls, record: dict[str, Any]) -> RunRecord:
        return cls(**record)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TrainingRun:
    """One training run as the arm result needs it: its record, its banner and generation
    band, and for a run trained in this process its live session (None once dropped, or
    for a run read back)."""

    record: RunRecord
    banner: str | None
    band: GenerationBand | None
    session: Session | None

    @property
    def alarms(self) -> list[dict[str, Any]]:
        return self.record.alarms

    @property
    def summary(self) -> dict[str, Any]:
        return self.record.summary


def _train_once(
    cfg: ArmConfig,
    gated: Probed,
    run_dir: Path,
    name: str,
    meter: PhaseMeter,
    stage_started: float,
) -> TrainingRun:
    """One training run from the SFT checkpoint; the first alarm ends it."""
    projected = gated.probe.projected_wall_s
    session = _setup(cfg, gated, run_dir, cfg.trainer, meter, stage_started, projected)
    with meter.phase("train"):
        return _fit_with_wires(cfg, gated, name, session)


class BannerOnce:
    """The run's banner, made once its probe steps are behind it (the figures it shows are
    the run's own by then), and logged from rank 0."""

    def __init__(self, probe_steps: int):
        self.probe_steps = probe_steps
        self.text: str | None = None

    def show_when_due(self, micro_step: int, make) -> None:
        if self.text is None and micro_step >= self.probe_steps:
            self.text = make()
            if is_main_process():
                LOG.info(f"banner\n{self.text}")


def _fit_with_wires(cfg: ArmConfig, gated: Probed, name: str, session: Session) -> TrainingRun:
    """The run's tripwires armed around its fit: the step-0 generation check, then every step."""
    info, model, trainer, shards = session.info, session.model, session.trainer, session.shards
    schedule, band = None, None
    if cfg.tripwires.armed("generation"):
        schedule = GenerationSchedule.of(cfg, shards["held"], gated.entry.pins)
        start = schedule.run(model, info, 0)
        chosen = chosen_responses(shards["held"].arrays, schedule.eos_id)
        band = GenerationBand.of(cfg.tripwires.generation_band, start, chosen)
    tripwires = Tripwires.armed(cfg.tripwires, chosen_longer_baseline(shards["train"]), band)
    shown = BannerOnce(cfg.trainer.probe_steps)
    horizon = len(trainer.source)

    def on_step(metrics: dict[str, Any]) -> None:
        tripwires.update(trainer.adapter.pair_stats)
        trainer.adapter.pair_stats.clear()
        alarms = tripwires.check(metrics["step"], all_gather_floats)
        done = trainer.state.step
        if schedule is not None and schedule.due(done, horizon):
            alarms += tripwires.check_generation(done, schedule.run(model, info, done), any_rank)
        shown.show_when_due(trainer.state.micro_step, lambda: banner(cfg, gated, model, info))
        if alarms:
            raise TripwireAlarm(alarms)

    alarms: list[dict[str, Any]] = []
    try:
        if schedule is not None:
            # The SFT policy itself outside the band is an alarm before any training.
            fired = tripwires.check_generation(0, schedule.checks[0], any_rank)
            if fired:
                raise TripwireAlarm(fired)
        summary = trainer.fit(on_step=on_step, rank_state=WireState(tripwires, schedule))
    except TripwireAlarm as alarm:
        alarms = [a.as_dict() for a in alarm.alarms]
        summary = trainer.summary()
        if info.is_main:
            LOG.warning(f"{name}: tripwire fired: {alarm}")
    record = RunRecord(
        run=name,
        config=run_record(cfg),
        summary=summary,
        alarms=alarms,
        signals=tripwires.signals,
        bands=tripwires.bands(),
        generation_checks=schedule.checks if schedule else [],
        generation_band=band.as_dict() if band else None,
    )
    return TrainingRun(record, shown.text, band, session)


def ended_first_run(cfg: ArmConfig, run_dir: Path) -> TrainingRun | None:
    """On a retry, the first run a tripwire ended in an earlier attempt, as it recorded
    itself; the rerun then resumes without that run being trained to its alarm again."""
    path = ended_run_in(run_dir)
    if not cfg.trainer.resume or not path.is_file():
        return None
    ended = read_json(path)
    run = TrainingRun(RunRecord.of(ended["record"]), ended["banner"], band=None, session=None)
    if is_main_process():
        alarms = ", ".join(f"{a['name']} at step {a['step']}" for a in run.alarms)
        LOG.info(f"{FIRST_RUN}: ended by {alarms} (read from {path})")
    return run


def record_ended_run(run: TrainingRun, run_dir: Path) -> None:
    if is_main_process():
        record = {"record": run.record.as_dict(), "banner": run.banner}
        write_json_atomic(ended_run_in(run_dir), record)


@dataclass(frozen=True)
class ArmTrained(Trained):
    """... and what the arm result needs of training besides: the banner, the result run's
    configuration and generation check, and the tripwires' record."""

    banner: str | None
    final_config: dict[str, Any]
    generation: dict[str, Any] | None
    tripwire: dict[str, Any]


def run_dpo(cfg: ArmConfig, gated: Probed, stage_started: float) -> tuple[dict[str, Any], DistInfo]:
    """Train the arm (on an alarm, rerun once from SFT with the pre-registered response),
    export the policy, then score it and the SFT policy on the held-out pairs."""
    trained = ArmTrained.read_before(gated.arm.run_dir, cfg.trainer.resume)
    meter = PhaseMeter(cfg.run.device)
    policy = gated.paths.recorded(gated.arm.policy_dir)
    with PhaseStops("dpo", gated.arm.stop_marker, policy) as stops:
        walls: dict[str, float] = {}  # the projected wall clock of each phase that has one
        if trained is None:
            trained, final, projected_train_s = train_and_export(cfg, gated, meter, stage_started)
            if projected_train_s > 0:
                walls["train"] = projected_train_s
            stops.stop_if_requested(EXPORT)
            live = final.session
            info, model = live.info, live.model
            held, ref_held = live.shards["held"], live.refs["held"]
            resumed = None
        else:
            info, model, held, ref_held, resumed = reload_exported(cfg, gated, trained, meter)
        with meter.phase("evaluate"):
            held_out = evaluate(cfg, gated, info, model, held, ref_held, stops)
    figures: dict[str, Any] = {
        "world_size": info.world_size,
        "precision": model.precision,
        "devices": list(info.devices),
        "banner": trained.banner,
        "training": trained.training,
        "final_config": trained.final_config,
        "held_out": held_out,
        "generation": trained.generation,
        "phases": meter.report(gated.projection.figures, walls),
    }
    if resumed is not None:
        figures["evaluation_resumed_after"] = resumed
    return {**figures, "tripwire": trained.tripwire}, info


def train_and_export(
    cfg: ArmConfig, gated: Probed, meter: PhaseMeter, stage_started: float
) -> tuple[ArmTrained, TrainingRun, float]:
    """The first run and, after an alarm, the rerun; the result run's policy exported and
    what training decided recorded beside it; and the projected wall clock of the steps
    trained here (each run's share of the probe's projection)."""
    first_dir = gated.arm.training_run_dir(FIRST_RUN)
    first = ended_first_run(cfg, first_dir)
    steps_here: list[int] = []  # each run's steps trained in this process (no session kept)
    if first is None:
        first = _train_once(cfg, gated, first_dir, FIRST_RUN, meter, stage_started)
        steps_here.append(first.summary["fit_steps"])
        if first.alarms:
            record_ended_run(first, first_dir)
            # The rerun starts again from SFT; one policy stays in memory.
            first = dataclasses.replace(first, session=None)
    runs, final, final_cfg, response = [first], first, cfg, None
    if first.alarms:
        final_cfg, response = with_response(cfg)
        rerun_dir = gated.arm.training_run_dir(RERUN)
        final = _train_once(final_cfg, gated, rerun_dir, RERUN, meter, stage_started)
        runs.append(final)
        steps_here.append(final.summary["fit_steps"])
    export_trained(final.session, gated, meter)
    trained = ArmTrained(
        banner=final.banner or first.banner,
        training=final.summary,
        final_config=run_record(final_cfg),
        generation=policy_generation(final),
        tripwire=tripwire_section(cfg, runs, response),
        policy_fingerprint=weights_fingerprint(gated.arm.policy_dir),
    )
    trained.write(gated.arm.run_dir)
    probe = gated.probe
    projected = sum(
        run_projection_s(probe.projected_wall_s, steps, probe.horizon_steps) for steps in steps_here
    )
    return trained, final, projected


def export_trained(session: Session, gated: Probed, meter: PhaseMeter) -> None:
    """The result run's policy in HF format, its trainer dropped first."""
    session.end_training()
    if session.info.is_main:
        LOG.info(f"exporting the policy to {gated.arm.policy_dir}")
    with meter.phase("export"):
        export_policy(session.model, session.info, gated.checkpoint, gated.arm.policy_dir)
        barrier()  # rank 0 writes the export; every rank reads its files below


def reload_exported(cfg: ArmConfig, gated: Probed, trained: ArmTrained, meter: PhaseMeter):
    """The exported policy and the held-out pairs, for a retry that evaluates only; the stop
    it follows is read from the marker, which it then clears."""
    info = start_session(gated.arm.run_dir, cfg.run, cfg.batch)
    policy = gated.arm.policy_dir
    resumed = resume_evaluation("dpo", policy, trained.policy_fingerprint, gated.arm.stop_marker)
    held = PairShard(gated.entry.shards["held"], cfg.batch.layout)
    with meter.phase("load"):
        model = load_policy(policy, cfg.model, info)
    return info, model, held, _ref(gated.caches["held"], held), resumed


def evaluate(
    cfg: ArmConfig, gated: Probed, info: DistInfo, model, held: PairShard, ref_held, stops
) -> dict[str, Any] | None:
    """The SFT and trained policies' held-out preference accuracy (rank 0's record)."""
    stops.stop_if_requested(EVALUATE)
    if info.is_main:
        LOG.info(f"evaluating {len(held)} held-out pairs")
    between = functools.partial(stops.stop_if_requested, EVALUATE)
    eval_bs = cfg.eval.batch_size
    sft_model = load_policy(gated.checkpoint, cfg.model, info)
    sft_c, sft_r = score_pairs(sft_model, held, eval_bs, info, "eval sft", between_batches=between)
    pol_c, pol_r = score_pairs(model, held, eval_bs, info, "eval policy", between_batches=between)
    if not info.is_main:
        return None
    # Rank 0 alone records them; the intervals' scipy.stats import would cost every rank.
    ref_c, ref_r = (t.numpy() for t in ref_held)
    return {
        "sft": policy_preference(sft_c, sft_r),
        "policy": policy_preference(pol_c, pol_r),
        "policy_implicit_reward": implicit_reward_preference(pol_c, pol_r, ref_c, ref_r),
        "mean_chosen_logp_change": float((pol_c - sft_c).mean()),
    }


def policy_generation(run: TrainingRun) -> dict[str, Any] | None:
    """The result policy's last generation check judged against its band (None: unarmed)."""
    checks = run.record.generation_checks
    if not checks:
        return None
    return {
        "step": checks[-1]["step"],
        "prompts": checks[-1]["prompts"],
        **judge(run.band, checks[-1]),
    }


def tripwire_section(
    cfg: ArmConfig, runs: list[TrainingRun], response: dict[str, Any] | None
) -> dict[str, Any]:
    """Both runs, which one is the result, and every signal that fired, run by run."""
    records = [run.record for run in runs]
    rerun = len(records) > 1
    return TripwireRecord(
        armed=cfg.tripwires.armed_wires(),
        disarmed={k: v for k, v in dataclasses.asdict(cfg.tripwires.disarmed).items() if v},
        rerun=rerun,
        response=response,
        result_run=records[-1].run,
        ended_by_tripwire=rerun and bool(records[-1].alarms),
        fired=[{"run": r.run, **a} for r in records for a in r.alarms],
        runs=[r.as_dict() for r in records],
    ).as_dict()
