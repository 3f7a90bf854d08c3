"""Pre-registration and run configuration: dataclasses, strict TOML loading, dotted overrides.

An arm's TOML fixes every scientific choice. Loading refuses unknown keys and wrong
types, naming the file and key; overrides (`--lr=5e-7`, `lr=5e-7`,
`--optimizer.lr=5e-7`) are typed by the field they set, applied or refused, and
returned so every receipt can record them. Imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, NamedTuple, TypeVar

from align.constants import (
    ATTENTION_IMPLEMENTATIONS,
    CPU_ISAS,
    CUDA_BACKWARD_ATTENTION,
    DATA_FORMATS,
    DEVICES,
    DPO_LOSSES,
    DTYPES,
    GATED_ATTENTION,
    LOCK_MODES,
    MIN_VOCAB_SIZE,
    OPTIMIZERS,
    PAIR_LAYOUTS,
    SEGMENT_MASK_ATTENTION,
    SELECTION_RULES,
    SMOOTHABLE_LOSSES,
    TRUNCATION_POLICIES,
)
from align.exit_codes import ConfigError
from align.receipts import hash_file, hash_json
from align.topology import divides, ranks_per_node

T = TypeVar("T")
# An arm's name is a directory of results_dir: one path component, no dots or spaces.
ARM_NAME = re.compile(r"[A-Za-z0-9_-]+")


class Check(NamedTuple):
    """One rule a config section states about its own fields (key relative to the section)."""

    key: str
    value: Any
    holds: bool
    expected: str


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> Check:
    return Check(key, value, value in allowed, f"one of {allowed}")


def at_least(key: str, value: int | None, low: int) -> Check:
    """An integer >= low; None (unset) passes."""
    return Check(key, value, value is None or value >= low, f"an integer >= {low}")


def finite_number(key: str, value: float | None, low: float, strict: bool, what: str) -> Check:
    """A finite number above `low` (or at it, unless strict); None (unset) passes."""
    holds = value is None or (math.isfinite(value) and (value > low if strict else value >= low))
    return Check(key, value, holds, what)


def open_fraction(key: str, value: float) -> Check:
    """0 < value < 1."""
    return Check(key, value, 0 < value < 1, "a fraction in (0, 1)")


def in_range(
    key: str, value: float, low: float, high: float, what: str, open_low: bool = False
) -> Check:
    """low <= value <= high (low < value when open_low)."""
    above = value > low if open_low else value >= low
    return Check(key, value, above and value <= high, what)


def positive_ints(section: Any, *keys: str) -> list[Check]:
    return [at_least(key, getattr(section, key), 1) for key in keys]


def valid_seed(key: str, value: int) -> Check:
    """numpy's generators refuse a negative seed."""
    return at_least(key, value, 0)


def finite(key: str, value: float | None, what: str) -> Check:
    """Neither nan nor infinite; None (unset) passes."""
    return Check(key, value, value is None or math.isfinite(value), what)


def positive(key: str, value: float | None) -> Check:
    return finite_number(key, value, 0, True, "a finite number > 0")


def non_negative(key: str, value: float | None) -> Check:
    return finite_number(key, value, 0, False, "a finite number >= 0")


def named(key: str, value: str, what: str) -> Check:
    """A string that may not be empty or blank; `what` says what it names."""
    return Check(key, value, bool(value.strip()), what)


def paths(key: str, value: list[str]) -> Check:
    """A list whose every entry names something (an empty entry matches no file)."""
    return Check(key, value, all(p.strip() for p in value), "a list of non-empty paths")


@dataclass
class FilterConfig:
    """Pre-registered row filters; each reports how many rows it removed."""

    # Rows whose status is one of these are removed (argilla's "tie": no preference).
    exclude_status: list[str] = field(default_factory=list)
    # Rows whose chosen response is rated below this are removed; none: no rating filter.
    min_chosen_score: float | None = None
    # Rows whose prompt is in GSM8K's train split are removed, so GSM8K stays a clean eval.
    exclude_in_gsm8k_train: bool = False

    def checks(self) -> list[Check]:
        return [
            Check(
                "exclude_status",
                self.exclude_status,
                all(status.strip() for status in self.exclude_status),
                "a list of non-empty statuses",
            ),
            finite("min_chosen_score", self.min_chosen_score, "a finite score or none"),
        ]


@dataclass
class DataConfig:
    """Where an arm's pairs come from, how they are cut and split, and how many are expected."""

    # The row layout of `files` (DATA_FORMATS), which says where prompt and responses are.
    format: str = "pairs"
    # The input files or globs; empty only in a TOML read for its arm name (build refuses it).
    files: list[str] = field(default_factory=list)
    # Tokens of prompt + one response; longer pairs are cut by `truncation`.
    seq_len: int = 512
    # How a pair longer than seq_len is cut (TRUNCATION_POLICIES).
    truncation: str = "prompt_left_response_right"
    # Share of pairs held out for evaluation and selection.
    held_fraction: float = 0.1
    # Seeds the train/held split, so the split is reproducible.
    split_seed: int = 0
    # Fewer kept pairs than this descope the arm rather than train it on too little.
    min_pairs: int = 1
    # The split sizes this data gives (align preregister); none: not yet pre-registered.
    expected_train_pairs: int | None = None
    expected_held_pairs: int | None = None
    # A pair whose rendered prompt alone has more tokens is removed as `prompt_over_budget`.
    max_prompt_tokens: int | None = None
    # For chat templates that refuse a system turn: prepend it to the user turn instead.
    merge_system_into_user: bool = False
    filters: FilterConfig = field(default_factory=FilterConfig)

    def checks(self) -> list[Check]:
        return [
            one_of("format", self.format, DATA_FORMATS),
            paths("files", self.files),
            one_of("truncation", self.truncation, TRUNCATION_POLICIES),
            at_least("seq_len", self.seq_len, 2),
            open_fraction("held_fraction", self.held_fraction),
            valid_seed("split_seed", self.split_seed),
            at_least("min_pairs", self.min_pairs, 1),
            at_least("expected_train_pairs", self.expected_train_pairs, 0),
            at_least("expected_held_pairs", self.expected_held_pairs, 0),
            Check(
                "max_prompt_tokens",
                self.max_prompt_tokens,
                self.max_prompt_tokens is None or self.max_prompt_tokens >= 1,
                "an integer >= 1 or none",
            ),
        ]


@dataclass
class ModelConfig:
    """The policy's precision and attention backend (align.train.precision applies and checks them).

    The sharded parameters the optimizer updates live in `master_dtype`; FSDP casts them
    to `dtype` for every forward and backward, and reduces gradients in `reduce_dtype`.
    """

    # What forward and backward compute in.
    dtype: str = "float32"
    # What the optimizer updates: float32 keeps updates far below bf16's half-ulp (lr 5e-7).
    master_dtype: str = "float32"
    # What gradients are summed across ranks in, before they are cast to master_dtype.
    reduce_dtype: str = "float32"
    # The attention backend of every layer (ATTENTION_IMPLEMENTATIONS), never replaced by another.
    attn_implementation: str = "sdpa"

    def checks(self) -> list[Check]:
        keys = ("dtype", "master_dtype", "reduce_dtype")
        return [
            *(one_of(key, getattr(self, key), DTYPES) for key in keys),
            one_of("attn_implementation", self.attn_implementation, ATTENTION_IMPLEMENTATIONS),
        ]


@dataclass
class RefConfig:
    """The forward path that builds the reference log-prob cache, and how the work is cut.

    The precompute writes one resumable part per slice of `slice_pairs` pairs, rounded
    up to whole batches so that slicing never changes a batch; the cache's bytes do not
    depend on it. `layout` lays the scored pairs out as `batch.layout` does the trained.
    """

    # What the reference forward computes in; part of the cache key.
    dtype: str = "float32"
    # The reference forward's attention backend; part of the cache key.
    attn_implementation: str = "sdpa"
    # Pairs per reference forward; padding depends on it, so it is part of the cache key.
    batch_size: int = 16
    # How pairs become rows (PAIR_LAYOUTS, see BatchConfig); part of the cache key.
    layout: str = "padded"
    # Pairs per resumable part of the precompute.
    slice_pairs: int = 128

    def checks(self) -> list[Check]:
        return [
            one_of("dtype", self.dtype, DTYPES),
            one_of("attn_implementation", self.attn_implementation, ATTENTION_IMPLEMENTATIONS),
            one_of("layout", self.layout, PAIR_LAYOUTS),
            *positive_ints(self, "batch_size", "slice_pairs"),
        ]


@dataclass
class DpoConfig:
    """The objective: loss variant and its weights (align.losses.dpo.DPOObjective is built
    from this section, and refuses what these checks refuse)."""

    # The inverse temperature of the implicit reward beta x log(policy / reference).
    beta: float = 0.1
    # One of DPO_LOSSES: sigmoid (DPO), ipo, hinge (SLiC).
    loss: str = "sigmoid"
    # Conservative DPO: the label is taken as flipped with this probability (sigmoid only).
    label_smoothing: float = 0.0
    # RPO: this weight x the chosen response's own token-mean NLL is added to each pair's loss.
    rpo_alpha: float = 0.0
    # Score per-token mean log-probs instead of sums (length-normalized DPO); IPO always does.
    length_normalize: bool = False
    # R-DPO: this weight x (chosen tokens - rejected tokens) is subtracted from the margin.
    rdpo_alpha: float = 0.0

    def checks(self) -> list[Check]:
        smoothing = self.label_smoothing
        return [
            finite_number("beta", self.beta, 0, True, "a finite number > 0"),
            one_of("loss", self.loss, DPO_LOSSES),
            Check("label_smoothing", smoothing, 0 <= smoothing < 0.5, "a fraction in [0, 0.5)"),
            Check(
                "label_smoothing",
                smoothing,
                not smoothing or self.loss in SMOOTHABLE_LOSSES,
                f"0 for loss {self.loss!r} (label smoothing applies to {SMOOTHABLE_LOSSES} only)",
            ),
            finite_number("rpo_alpha", self.rpo_alpha, 0, False, "a finite number >= 0"),
            finite_number("rdpo_alpha", self.rdpo_alpha, 0, False, "a finite number >= 0"),
        ]


@dataclass
class OptimizerConfig:
    """`name` is 'adamw' (torch, float32 moments) or 'adamw8bit' (bitsandbytes, 8-bit moments)."""

    # Which AdamW runs (OPTIMIZERS); the preflight projects the memory of this one.
    name: str = "adamw"
    # The peak learning rate, reached after warmup.
    lr: float = 1e-6
    # Decoupled weight decay per step, x lr.
    weight_decay: float = 0.0
    # Adam's (beta1, beta2): decay rates of the first and second moments.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Added to the second moment's root, so a zero gradient does not divide by zero.
    eps: float = 1e-8
    # Optimizer steps of linear warmup to lr: step s (from 0) runs at lr x (s + 1) / warmup_steps,
    # so the first step is not at 0 as in transformers' schedulers; 0: start at lr.
    warmup_steps: int = 0
    # The cosine after warmup ends at this share of lr (transformers' cosine_with_min_lr end,
    # which no transformers scheduler pairs with the warmup above).
    min_lr_ratio: float = 0.0
    # Gradients are scaled down to this global norm before each step.
    grad_clip: float = 1.0

    def checks(self) -> list[Check]:
        betas = self.betas
        return [
            one_of("name", self.name, OPTIMIZERS),
            positive("lr", self.lr),
            non_negative("weight_decay", self.weight_decay),
            Check(
                "betas",
                betas,
                len(betas) == 2 and all(0 <= beta < 1 for beta in betas),
                "two decay rates [beta1, beta2], each in [0, 1)",
            ),
            positive("eps", self.eps),
            at_least("warmup_steps", self.warmup_steps, 0),
            in_range("min_lr_ratio", self.min_lr_ratio, 0, 1, "a fraction in [0, 1]"),
            positive("grad_clip", self.grad_clip),
        ]


@dataclass
class BatchConfig:
    """Batch topology: world_size x micro_batch x grad_accum must equal global_batch.

    `layout` is how DPO pairs become rows (align.data.loader): 'padded', chosen and
    rejected as two rows; 'shared', one row [prompt | chosen | rejected] per pair, so the
    prompt runs once; 'packed', several shared pairs per row, so short pairs pad less. It
    changes the forward path, so it is part of forward_impl. 'shared' and 'packed' need an
    attention backend with a segment-aware mask ('sdpa', 'eager', 'flex'); SFT refuses them.
    """

    # Ranks (one per GPU on CUDA) that train together.
    world_size: int = 1
    # Pairs per rank per forward; bounds activation memory.
    micro_batch: int = 1
    # Micro-batches summed before each optimizer step.
    grad_accum: int = 1
    # Pairs per optimizer step: the pre-registered product of the three above.
    global_batch: int = 1
    # Passes over the train pairs; with global_batch it fixes the schedule's horizon.
    epochs: int = 1
    # Seeds the sampler's shuffle and torch's generator, so a rerun draws the same batches.
    seed: int = 0
    # How each pair becomes rows (PAIR_LAYOUTS, see the class docstring).
    layout: str = "padded"

    def checks(self) -> list[Check]:
        ranks = self.world_size
        product = ranks * self.micro_batch * self.grad_accum
        return [
            *positive_ints(self, "world_size", "micro_batch", "grad_accum", "global_batch"),
            at_least("epochs", self.epochs, 1),
            valid_seed("seed", self.seed),
            Check(
                "global_batch",
                self.global_batch,
                product == self.global_batch,
                f"world_size x micro_batch x grad_accum = {ranks} x {self.micro_batch} x "
                f"{self.grad_accum} = {product}",
            ),
            one_of("layout", self.layout, PAIR_LAYOUTS),
        ]


@dataclass
class TrainerConfig:
    """How the step loop runs, stops and checkpoints; not what it optimizes."""

    # Optimizer steps between checkpoints; 0: none but the stop's.
    checkpoint_every: int = 0
    # Newest checkpoints kept on disk; older ones are rotated away.
    keep_checkpoints: int = 2
    # Continue from the newest valid checkpoint (the workflow sets it on a retry).
    resume: bool = False
    # The job's budget, counted from the stage's start (a rerun spends the same budget); 0: none.
    max_wall_seconds: float = 0.0
    # Stop after this many micro-steps; 0: run to the horizon.
    max_micro_steps: int = 0
    # Micro-steps the throughput probe measures.
    probe_steps: int = 20
    # More consecutive steps skipped for a non-finite loss or gradient end the run as diverged.
    max_consecutive_skipped_steps: int = 3
    # More than this share of steps skipped ends the run as diverged.
    max_skipped_fraction: float = 0.05
    # Recompute each layer's activations in backward: less memory for more compute.
    activation_checkpointing: bool = False
    # A progress line in the log every this many optimizer steps (0: by time only) ...
    progress_every_steps: int = 10
    # ... or this many seconds, whichever comes first (0: by steps only).
    progress_every_s: float = 60.0

    def checks(self) -> list[Check]:
        return [
            at_least("checkpoint_every", self.checkpoint_every, 0),
            at_least("progress_every_steps", self.progress_every_steps, 0),
            non_negative("progress_every_s", self.progress_every_s),
            at_least("keep_checkpoints", self.keep_checkpoints, 1),
            non_negative("max_wall_seconds", self.max_wall_seconds),
            at_least("max_micro_steps", self.max_micro_steps, 0),
            at_least("probe_steps", self.probe_steps, 1),
            at_least("max_consecutive_skipped_steps", self.max_consecutive_skipped_steps, 0),
            in_range(
                "max_skipped_fraction", self.max_skipped_fraction, 0, 1, "a fraction in [0, 1]"
            ),
        ]


@dataclass
class PathBiasConfig:
    """Step-0 check of the training forward path against the cache (mean |margin| in nats)."""

    # Mean |step-0 margin| above which the cache is rebuilt with the training path.
    tolerance: float = 1e-3
    # Train pairs the step-0 check scores.
    sample_pairs: int = 64
    # Seeds which pairs are sampled.
    seed: int = 0

    def checks(self) -> list[Check]:
        return [
            positive("tolerance", self.tolerance),
            at_least("sample_pairs", self.sample_pairs, 1),
            valid_seed("seed", self.seed),
        ]


@dataclass
class PreflightConfig:
    """Memory projection terms that are not derived from the model: margins and overheads."""

    # Share of the node's memory the projected peak may fill: the rest is the OS's and caches'.
    host_memory_fraction: float = 0.9
    # Each CPU rank's host runtime outside the model's tensors (interpreter, torch, gloo and
    # the kernels its first forward loads): 393 MiB measured at 57.7M parameters, 405 at the
    # tiny default (a rank's RSS after loading, less its shard).
    cpu_rank_overhead_mb: float = 410.0
    # What a rank's runtime holds once it has trained (autograd's engine, the backward and
    # optimizer kernels it loaded), in the export and evaluation after training: they start
    # 44 (sft) and 61 (dpo) MiB above their steady terms at 57.7M parameters.
    post_training_overhead_mb: float = 64.0
    # What a rank's runtime holds once it has scored and generated with one policy, when it
    # loads the next (select_arms loads its policies in turn): those loads peak 30 MiB (57.7M
    # parameters) and 28-35 MiB (258M) above the SFT gate's single load of the same
    # checkpoint, over two scale rehearsals.
    post_scoring_overhead_mb: float = 36.0
    # What a scoring rank holds beyond its modelled tensors (the heap a sharded run grows
    # around them, more after training): a phase's measured peak less its other terms was
    # at most 62 MiB a rank over every scoring phase of two scale rehearsals at 57.7M and
    # 258M parameters (SFT's evaluation at 258M: 54, then 62), so 80 covers that spread;
    # one forward alone keeps 0-3 MiB under the ranks' glibc settings
    # (benchmarks/scoring_heap.py).
    scoring_heap_overhead_mb: float = 80.0
    # What a rank of sft, sft_gate or select_arms adds by reading rows in-process (pyarrow and
    # the tokenizer, or the arms' union eval set): their load phases start 59-63 MiB above
    # the built-shard stages' at 57.7M and 258M parameters (the scale rehearsal).
    row_reader_overhead_mb: float = 64.0
    # Each CUDA rank's host runtime: torch with an NCCL group held 2,271 MiB after its first
    # CUDA call (pytorch/pytorch#106511), and Triton's compiler and bitsandbytes add to it.
    # benchmarks/gpu_check.sh measures it (rank_overhead.json): put its figure here.
    cuda_rank_overhead_mb: float = 4096.0
    # Each node's launcher of a multi-rank stage (align.launch, torchrun's agent in-process,
    # torch imported, no device touched): 222 MiB peak measured on CPU.
    launcher_overhead_mb: float = 230.0
    # The probe refuses a projection more than this share below its measured peak.
    calibration_tolerance: float = 0.2
    # Below this fraction of master elements moved by one step at optimizer.lr, a
    # low-precision master_dtype is refused: the run would mostly not train.
    min_moved_fraction: float = 0.5
    # Per-GPU memory to project against; 0 reads it from the device (torch.cuda.mem_get_info),
    # so a submit host without a GPU needs it pre-registered.
    device_memory_gb: float = 0.0
    # Share of the device the projection may fill: the allocator's fragmentation lives above it.
    device_memory_fraction: float = 0.92
    # CUDA context and NCCL buffers, outside torch's allocator (not in max_memory_allocated).
    cuda_context_mb: float = 1024.0

    def checks(self) -> list[Check]:
        return [
            in_range(
                "min_moved_fraction", self.min_moved_fraction, 0, 1, "a fraction in (0, 1]", True
            ),
            in_range(
                "device_memory_fraction",
                self.device_memory_fraction,
                0,
                1,
                "a fraction in (0, 1]",
                True,
            ),
            finite_number(
                "device_memory_gb", self.device_memory_gb, 0, False, "a number of GB >= 0"
            ),
            in_range(
                "host_memory_fraction",
                self.host_memory_fraction,
                0,
                1,
                "a fraction in (0, 1]",
                True,
            ),
            non_negative("cpu_rank_overhead_mb", self.cpu_rank_overhead_mb),
            non_negative("post_training_overhead_mb", self.post_training_overhead_mb),
            non_negative("post_scoring_overhead_mb", self.post_scoring_overhead_mb),
            non_negative("row_reader_overhead_mb", self.row_reader_overhead_mb),
            non_negative("scoring_heap_overhead_mb", self.scoring_heap_overhead_mb),
            non_negative("cuda_rank_overhead_mb", self.cuda_rank_overhead_mb),
            non_negative("launcher_overhead_mb", self.launcher_overhead_mb),
            Check(
                "calibration_tolerance",
                self.calibration_tolerance,
                0 <= self.calibration_tolerance < 1,
                "a fraction in [0, 1)",
            ),
            non_negative("cuda_context_mb", self.cuda_context_mb),
        ]


@dataclass
class TripwireResponse:
    """The pre-registered configuration of the single rerun after an alarm (unset = unchanged)."""

    # The rerun's optimizer.lr.
    lr: float | None = None
    # The rerun's dpo.beta.
    beta: float | None = None
    # The rerun's dpo.rpo_alpha: an NLL term on chosen that holds the chosen responses up.
    rpo_alpha: float | None = None
    # Where each setting lands in the arm's configuration: (section, key), one per field.
    TARGETS: ClassVar[dict[str, tuple[str, str]]] = {
        "lr": ("optimizer", "lr"),
        "beta": ("dpo", "beta"),
        "rpo_alpha": ("dpo", "rpo_alpha"),
    }

    def changes(self) -> dict[str, float]:
        """The settings the rerun changes, by field."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    @classmethod
    def settings_of(cls, arm: Any) -> dict[str, float]:
        """What an arm's configuration holds for every setting a response can change."""
        return {key: getattr(getattr(arm, s), k) for key, (s, k) in cls.TARGETS.items()}

    def applied_to(self, arm: Any) -> None:
        """The response's settings written into `arm` (a copy the rerun runs under)."""
        for key, value in self.changes().items():
            section, name = self.TARGETS[key]
            setattr(getattr(arm, section), name, value)

    def checks(self) -> list[Check]:
        return [
            positive("lr", self.lr),
            positive("beta", self.beta),
            non_negative("rpo_alpha", self.rpo_alpha),
        ]


@dataclass
class GenerationCheckConfig:
    """Greedy generations of a fixed set of held-out prompts (align.eval.generation): one
    spelling wherever a check runs (the SFT gate, the generation wire, selection)."""

    # Distinct held-out prompts completed; few, so a check costs seconds (every rank decodes
    # its share).
    prompts: int = 8
    # Tokens each completion may take to end.
    max_new_tokens: int = 40

    def checks(self) -> list[Check]:
        return positive_ints(self, "prompts", "max_new_tokens")


@dataclass
class GenerationBandConfig:
    """Where a policy's greedy generations must stay, relative to the SFT policy's greedy
    generations on the same prompts and to the data's chosen responses (align.eval.sanity)."""

    # Terminated fraction at least this share of the SFT policy's ...
    min_terminated_vs_sft: float = 0.75
    # ... and at least this share of the data's chosen responses' (truncation can cut eos).
    min_terminated_vs_chosen: float = 0.75
    # Mean length within [length_low x the shorter, length_high x the longer reference].
    length_low: float = 0.5
    # (The upper factor of that band.)
    length_high: float = 1.5

    def checks(self) -> list[Check]:
        return [
            in_range(
                "min_terminated_vs_sft", self.min_terminated_vs_sft, 0, 1, "a fraction in [0, 1]"
            ),
            in_range(
                "min_terminated_vs_chosen",
                self.min_terminated_vs_chosen,
                0,
                1,
                "a fraction in [0, 1]",
            ),
            in_range("length_low", self.length_low, 0, 1, "a factor in [0, 1]"),
            finite_number("length_high", self.length_high, 1, False, "a factor >= 1"),
        ]


@dataclass
class DisarmedWires:
    """The wires, each armed unless the pre-registration states why it is off: the reason is
    the switch, so no wire is off without one. These fields are the one list of wires."""

    # Why the collapse wire (chosen log-ratio below its floor) is off; empty: armed.
    collapse: str = ""
    # Why the length-drift wire (the longer response preferred too often) is off; empty: armed.
    length_drift: str = ""
    # Why the generation wire (greedy generations outside their band) is off; empty: armed.
    generation: str = ""


WIRES = tuple(f.name for f in dataclasses.fields(DisarmedWires))


@dataclass
class TripwireConfig:
    """The wires watched while training (align.train.tripwires) and the one rerun's response."""

    # Pairs the collapse wire's windowed means run over: it fires when the windowed chosen
    # log-ratio per token falls below the floor while the margin grows.
    logps_window: int = 64
    # Nats per token; a log-ratio of either sign is meaningful, so any finite floor is.
    chosen_logp_floor: float = -1.0
    # Pairs the length-drift wire's share (pairs whose implicit reward prefers the longer
    # response, against the data's) is taken over; it cannot fire before the window is full.
    length_window_pairs: int = 128
    # The share may leave the data's baseline by at most this much.
    length_band: float = 0.25
    # The generation wire's greedy generations (`generation_check`) every this many optimizer
    # steps (and after the last) must stay inside `generation_band`.
    generation_every_steps: int = 25
    # The prompts and length of each check.
    generation_check: GenerationCheckConfig = field(default_factory=GenerationCheckConfig)
    # Where the generation wire's generations must stay.
    generation_band: GenerationBandConfig = field(default_factory=GenerationBandConfig)
    # The stated reason for each wire switched off (every other wire is armed).
    disarmed: DisarmedWires = field(default_factory=DisarmedWires)
    # The one pre-registered rerun after an alarm.
    response: TripwireResponse = field(default_factory=TripwireResponse)

    def checks(self) -> list[Check]:
        """Windows and band in range; a disarmed wire's reason says something."""
        checks = [
            *positive_ints(
                self,
                "logps_window",
                "length_window_pairs",
                "generation_every_steps",
            ),
            finite("chosen_logp_floor", self.chosen_logp_floor, "a finite number"),
            in_range("length_band", self.length_band, 0, 1, "a share in [0, 1]"),
        ]
        for wire in WIRES:
            reason = getattr(self.disarmed, wire)
            checks.append(
                Check(
                    f"disarmed.{wire}",
                    reason,
                    reason == "" or bool(reason.strip()),
                    f"empty (the {wire} wire armed) or the reason it is off, not blank",
                )
            )
        return checks

    def armed(self, wire: str) -> bool:
        if wire not in WIRES:
            raise KeyError(f"{wire!r} is not a tripwire; the wires are {WIRES}")
        return not getattr(self.disarmed, wire)

    def armed_wires(self) -> list[str]:
        return [wire for wire in WIRES if self.armed(wire)]


@dataclass
class EvalConfig:
    """How held-out pairs are scored: pairs per forward."""

    # Pairs per scoring forward; bounds evaluation memory.
    batch_size: int = 32

    def checks(self) -> list[Check]:
        return positive_ints(self, "batch_size")


@dataclass
class RunConfig:
    """Where this run reads and writes; not a scientific choice, so overrides are expected."""

    # Where every receipt and output of the run lies (align.paths); required.
    results_dir: str = "results"
    # The HF checkpoint SFT starts from, and whose tokenizer it uses; required.
    base_model: str = "resources/tiny/base"
    # An existing SFT checkpoint (HF format); empty: rule sft trains one.
    sft_checkpoint: str = ""
    # Where ranks compute (DEVICES); a device that is not there is refused, never replaced.
    device: str = "cpu"
    # The site's GPUs per node, so ranks per node: world_size / this = a job's nodes (0: one
    # node). A placement, not a scientific choice: the workflow passes its gpus_per_node.
    gpus_per_node: int = 0
    # Math-library threads of each rank.
    threads: int = 2
    # The widest instruction set torch's CPU kernels, MKL and oneDNN may use: a CPU run then
    # computes the same bits on every x86-64 CPU that has it. Empty: each library takes the
    # widest this CPU has, and CPUs of different generations round differently.
    cpu_isa: str = ""
    # Two heavy stages outside a scheduler never share this host: wait, refuse, or off.
    # Inside a Slurm job the scheduler owns the node and no lock is taken.
    heavy_lock: str = "wait"
    # Empty: one lock per user in the temporary directory, so users never block each other.
    heavy_lock_path: str = ""
    # Refuse to run on any other host; empty: any host.
    expected_host: str = ""
    # Refuse results on the root filesystem, which a full disk would take down.
    require_off_root: bool = False
    # MiB of the node a job will run on, when it is not this host (the workflow passes the
    # partition's figure to the preflight on the submit host); 0: this host's memory.
    node_memory_mb: float = 0.0
    # Where node_memory_mb came from, for the preflight receipt.
    node_memory_source: str = ""

    def checks(self) -> list[Check]:
        host, source = self.expected_host, self.node_memory_source
        return [
            named("results_dir", self.results_dir, "a directory (required)"),
            named("base_model", self.base_model, "a checkpoint directory (required)"),
            one_of("device", self.device, DEVICES),
            at_least("gpus_per_node", self.gpus_per_node, 0),
            at_least("threads", self.threads, 1),
            one_of("cpu_isa", self.cpu_isa, ("", *CPU_ISAS)),
            one_of("heavy_lock", self.heavy_lock, LOCK_MODES),
            Check(
                "expected_host",
                host,
                host == "".join(host.split()),
                "a host name without whitespace (empty: any host)",
            ),
            non_negative("node_memory_mb", self.node_memory_mb),
            Check(
                "node_memory_source",
                source,
                not source or self.node_memory_mb > 0,
                "empty while node_memory_mb = 0 (this host's memory is measured, not sourced)",
            ),
        ]


@dataclass
class ArmConfig:
    """One arm's pre-registration (config/arms/<arm>.toml)."""

    # The arm's name: its directory under results_dir, and its name in the selection.
    arm: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    path_bias: PathBiasConfig = field(default_factory=PathBiasConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    tripwires: TripwireConfig = field(default_factory=TripwireConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def checks(self) -> list[Check]:
        return [
            Check(
                "arm",
                self.arm,
                ARM_NAME.fullmatch(self.arm) is not None,
                "the arm's name (required): letters, digits, _ and -, a directory of results_dir",
            ),
            segment_masked("batch.layout", self.batch.layout, self.model),
            segment_masked("ref.layout", self.ref.layout, self.ref),
            trains_on_its_device(self.model, self.run),
            fits_nodes(self.batch, self.run),
        ]

    def gated_backends(self) -> list[str]:
        """The attention backends of the arm's forwards that run only behind a passed
        equivalence receipt (GATED_ATTENTION), sorted."""
        used = {self.model.attn_implementation, self.ref.attn_implementation}
        return sorted(used & set(GATED_ATTENTION))


def trains_on_its_device(model: ModelConfig, run: RunConfig) -> Check:
    """FlexAttention has a backward on CUDA only: a CPU arm may score with it, not train."""
    backend = model.attn_implementation
    return Check(
        "model.attn_implementation",
        backend,
        not (backend in CUDA_BACKWARD_ATTENTION and run.device == "cpu"),
        f"a backend with a backward on {run.device!r} for training (flex has one on CUDA "
        "only): 'sdpa' or 'eager' on the CPU; ref.attn_implementation may still be 'flex'",
    )


def fits_nodes(batch: BatchConfig, run: RunConfig) -> Check:
    """The site's nodes hold the world size exactly (align.topology)."""
    per_node = ranks_per_node(batch.world_size, run.gpus_per_node)
    return Check(
        "run.gpus_per_node",
        run.gpus_per_node,
        run.gpus_per_node < 0 or divides(batch.world_size, per_node),  # < 0: the range check's
        f"0 (one node) or a divisor of batch.world_size = {batch.world_size}",
    )


def segment_masked(key: str, layout: str, forward: ModelConfig | RefConfig) -> Check:
    """The shared and packed layouts need a backend whose mask keeps segments apart."""
    backend = forward.attn_implementation
    return Check(
        key,
        layout,
        layout == "padded" or backend in SEGMENT_MASK_ATTENTION,
        f"'padded' with attn_implementation {backend!r} (the shared and packed layouts need "
        f"one of {SEGMENT_MASK_ATTENTION})",
    )


@dataclass
class SftDataConfig:
    """The SFT conversations: where they are, how they are cut and split."""

    # The prompt / response files or globs.
    files: list[str] = field(default_factory=list)
    # Tokens per conversation; longer ones are cut.
    seq_len: int = 512
    # Share of conversations held out for the gate's NLL; both splits must be non-empty.
    held_fraction: float = 0.1
    # Seeds the train/held split, so the split is reproducible.
    split_seed: int = 0

    def checks(self) -> list[Check]:
        return [
            paths("files", self.files),
            at_least("seq_len", self.seq_len, 2),
            open_fraction("held_fraction", self.held_fraction),
            valid_seed("split_seed", self.split_seed),
        ]


@dataclass
class SftGateConfig:
    """Section-11 quality gate: held-out NLL ceiling and greedy-generation sanity."""

    # Mean held-out NLL (nats per response token) the SFT policy must stay under.
    max_held_nll: float = 2.0
    # The held-out prompts the policy greedily completes, and their length.
    generation_check: GenerationCheckConfig = field(
        default_factory=lambda: GenerationCheckConfig(prompts=8, max_new_tokens=32)
    )
    # Share of completions that must end with eos within generation_check.max_new_tokens.
    min_terminated_fraction: float = 1.0

    def checks(self) -> list[Check]:
        return [
            positive("max_held_nll", self.max_held_nll),
            in_range(
                "min_terminated_fraction",
                self.min_terminated_fraction,
                0,
                1,
                "a fraction in [0, 1]",
            ),
        ]


@dataclass
class SftConfig:
    """The SFT pre-registration (config/sft.toml)."""

    data: SftDataConfig = field(default_factory=SftDataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    gate: SftGateConfig = field(default_factory=SftGateConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # The host-memory projection's terms for the sft and sft_gate jobs.
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def checks(self) -> list[Check]:
        layout = self.batch.layout
        return [
            Check("batch.layout", layout, layout == "padded", "'padded' (SFT rows are not pairs)"),
            trains_on_its_device(self.model, self.run),
            fits_nodes(self.batch, self.run),
        ]


@dataclass
class PairedEvalConfig:
    """The common held-out set every policy is scored on, and its paired statistics."""

    # "union": every arm's held-out shard, deduplicated by pair_id; else a shard's path.
    eval_set: str = "union"
    # Bootstrap resamples of the paired accuracy difference.
    n_boot: int = 10000
    # Seeds the bootstrap, so the interval is reproducible.
    seed: int = 0
    # Coverage of the paired-bootstrap interval.
    confidence: float = 0.95

    def checks(self) -> list[Check]:
        return [
            named("eval_set", self.eval_set, '"union" or a held-out shard\'s path'),
            at_least("n_boot", self.n_boot, 1),
            valid_seed("seed", self.seed),
            open_fraction("confidence", self.confidence),
        ]


@dataclass
class SelectionConfig:
    """The arm-selection pre-registration (config/selection.toml, section 13)."""

    # How the winner is chosen (SELECTION_RULES).
    rule: str = "paired_accuracy"
    # The arm selected when the rule finds no difference; one of the workflow's arms.
    default_arm: str = ""
    paired: PairedEvalConfig = field(default_factory=PairedEvalConfig)
    # Every policy's greedy generations on the eval set's first distinct prompts ...
    generation_check: GenerationCheckConfig = field(
        default_factory=lambda: GenerationCheckConfig(prompts=16, max_new_tokens=48)
    )
    # ... must stay here, or the arm is ineligible.
    generation_band: GenerationBandConfig = field(default_factory=GenerationBandConfig)
    # One forward path scores every policy, so the comparison is not confounded by it.
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def checks(self) -> list[Check]:
        """Which arms exist is the workflow's: align.stages.select checks default_arm is one."""
        return [
            one_of("rule", self.rule, SELECTION_RULES),
            Check(
                "default_arm",
                self.default_arm,
                ARM_NAME.fullmatch(self.default_arm) is not None,
                "an arm's name (required)",
            ),
        ]


@dataclass
class TinyModelSpec:
    """The tiny random Mistral's shape, as align.model.hf_config.MistralConfig takes it."""

    # Width of the residual stream.
    hidden_size: int = 256
    # Width of each MLP's hidden layer.
    intermediate_size: int = 512
    # Decoder layers.
    num_hidden_layers: int = 4
    # Query heads; hidden_size / this is the head dim, which rotary embeddings need even.
    num_attention_heads: int = 4
    # Key/value heads, each shared by num_attention_heads / this query heads.
    num_key_value_heads: int = 2
    # The longest sequence the model is built for.
    max_position_embeddings: int = 256
    # Base of the rotary embeddings' frequencies.
    rope_theta: float = 10000.0
    # Share one matrix between the embedding and lm_head.
    tie_word_embeddings: bool = False

    def checks(self) -> list[Check]:
        heads, kv_heads, hidden = (
            self.num_attention_heads,
            self.num_key_value_heads,
            self.hidden_size,
        )
        return [
            *positive_ints(
                self,
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "max_position_embeddings",
            ),
            Check(
                "num_key_value_heads",
                kv_heads,
                kv_heads >= 1 and heads % kv_heads == 0,
                f"a divisor of num_attention_heads = {heads}",
            ),
            Check(
                "hidden_size",
                hidden,
                heads >= 1 and hidden % (2 * heads) == 0,
                f"a multiple of 2 x num_attention_heads = {2 * heads} (an even head dim)",
            ),
            positive("rope_theta", self.rope_theta),
        ]


@dataclass
class TinyConfig:
    """The embedded tiny default: seeded data, tokenizer and random base model."""

    # Seeds the data, the tokenizer's corpus order and the weights: same seed, same bytes.
    seed: int = 0
    # Where the data, tokenizer and base model are written.
    out_dir: str = "resources/tiny"
    # Rows of each synthetic data set.
    n_argilla: int = 700
    n_steppairs: int = 700
    n_sft: int = 1500
    # The BPE tokenizer's vocabulary: every byte, the special tokens, then merges.
    vocab_size: int = 384
    model: TinyModelSpec = field(default_factory=TinyModelSpec)

    def checks(self) -> list[Check]:
        return [
            valid_seed("seed", self.seed),
            named("out_dir", self.out_dir, "a directory (required)"),
            *positive_ints(self, "n_argilla", "n_steppairs", "n_sft"),
            at_least("vocab_size", self.vocab_size, MIN_VOCAB_SIZE),
        ]


@dataclass
class Loaded(Generic[T]):
    """A loaded config with its provenance: source file, its hash, applied overrides."""

    cfg: T
    source: Path
    source_hash: str
    overrides: dict[str, Any]

    @property
    def config_hash(self) -> str:
        return hash_json(to_dict(self.cfg))


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


UNPINNED_DATA_KEYS = ("expected_train_pairs", "expected_held_pairs")


def pinned_data_config(data: DataConfig) -> dict[str, Any]:
    """The `[data]` choices that determine an arm's shards, as the manifest records them."""
    return {k: v for k, v in to_dict(data).items() if k not in UNPINNED_DATA_KEYS}


def load_config(path: str | Path, cls: type[T], overrides: list[str] | None = None) -> Loaded[T]:
    """Load `path` into `cls`, refuse unknown keys and wrong types, then apply overrides."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text, as TOML must be ({err})") from err
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from err
    cfg = _build(cls, raw, where=str(path), prefix="")
    applied = apply_overrides(cfg, overrides or [], where=str(path))
    validate(cfg, where=str(path))
    return Loaded(cfg=cfg, source=path, source_hash=hash_file(path), overrides=applied)


# A config class's annotations are strings (postponed evaluation); resolving them is most of
# a load's time, and they never change.
_type_hints = functools.cache(typing.get_type_hints)


def _build(cls: type, raw: dict[str, Any], where: str, prefix: str) -> Any:
    hints = _type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in names:
            raise ConfigError(
                f"{where}: unknown key {prefix + key!r} (known in this section: {', '.join(sorted(names))})"
            )
    kwargs = {}
    for key, value in raw.items():
        hint = hints[key]
        dotted = prefix + key
        if dataclasses.is_dataclass(hint):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: key {dotted!r} expected a table, found {value!r}")
            kwargs[key] = _build(hint, value, where, dotted + ".")
        else:
            kwargs[key] = _check_type(hint, value, where, dotted)
    return cls(**kwargs)


def _check_type(hint: Any, value: Any, where: str, dotted: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None:
            return None
        return _check_type(_non_none(args), value, where, dotted)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: key {dotted!r} expected a list, found {value!r}")
        return [_check_type(args[0], v, where, f"{dotted}[{i}]") for i, v in enumerate(value)]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float) and isinstance(value, bool):
        raise ConfigError(f"{where}: key {dotted!r} expected {hint.__name__}, found bool {value!r}")
    if not isinstance(value, hint):
        raise ConfigError(
            f"{where}: key {dotted!r} expected {hint.__name__}, found {type(value).__name__} {value!r}"
        )
    return value


def _non_none(union_args: tuple) -> Any:
    """The one non-None member of an `X | None` annotation."""
    return next(a for a in union_args if a is not type(None))


def leaf_paths(cls: type, prefix: str = "") -> dict[str, Any]:
    """Every settable dotted key of `cls` with its type hint."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for name in (f.name for f in dataclasses.fields(cls)):
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            out.update(leaf_paths(hint, f"{prefix}{name}."))
        else:
            out[prefix + name] = hint
    return out


def resolve_key(cls: type, key: str, where: str) -> tuple[str, Any]:
    """Map `lr` or `optimizer.lr` to the one dotted key it names; refuse unknown or ambiguous.

    A partial key resolves to the shallowest full key ending in it (`lr` is optimizer.lr,
    not tripwires.response.lr); two candidates at that depth are ambiguous.
    """
    leaves = leaf_paths(cls)
    if key in leaves:
        return key, leaves[key]
    matches = [k for k in leaves if k.endswith("." + key)]
    if not matches:
        raise ConfigError(f"{where}: override key {key!r} is not a config key")
    depth = min(k.count(".") for k in matches)
    shallowest = [k for k in matches if k.count(".") == depth]
    if len(shallowest) == 1:
        return shallowest[0], leaves[shallowest[0]]
    raise ConfigError(
        f"{where}: override key {key!r} is ambiguous: {', '.join(sorted(shallowest))}"
    )


def parse_override(token: str, where: str) -> tuple[str, str]:
    """Split `--k=v` or `k=v`; a bare word (`lr`, `--lr`, `5e-7`) is refused."""
    body = token[2:] if token.startswith("--") else token
    key, sep, value = body.partition("=")
    if not sep or not key:
        raise ConfigError(
            f"{where}: argument {token!r} is not an override; write --key=value (e.g. --lr=5e-7)"
        )
    return key, value


def _coerce(hint: Any, text: str, key: str, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        if text.lower() in ("none", "null"):
            return None
        return _coerce(_non_none(typing.get_args(hint)), text, key, where)
    try:
        if hint is str:
            return text
        if hint is bool:
            if text.lower() not in ("true", "false"):
                raise ValueError("expected true or false")
            return text.lower() == "true"
        if hint is int:
            return int(text)
        if hint is float:
            return float(text)
        parsed = tomllib.loads(f"v = {text}")["v"]
    except (ValueError, tomllib.TOMLDecodeError) as err:
        raise ConfigError(
            f"{where}: override {key}={text!r} does not parse as {hint} ({err})"
        ) from err
    return _check_type(hint, parsed, where, key)


def apply_overrides(cfg: Any, tokens: list[str], where: str) -> dict[str, Any]:
    """Apply each override to `cfg` in place; return {dotted_key: value} of what was applied."""
    applied: dict[str, Any] = {}
    for token in tokens:
        key, text = parse_override(token, where)
        dotted, hint = resolve_key(type(cfg), key, where)
        value = _coerce(hint, text, dotted, where)
        *parents, leaf = dotted.split(".")
        target = cfg
        for part in parents:
            target = getattr(target, part)
        setattr(target, leaf, value)
        applied[dotted] = value
    return applied


def validate(cfg: Any, where: str) -> None:
    """Every section's own checks (`checks()`); all that fail are refused in one line, each
    named by its dotted key, so one edit can fix them all."""
    failed = [
        f"key {prefix + check.key!r} expected {check.expected}, found {check.value!r}"
        for prefix, section in sections(cfg)
        for check in getattr(section, "checks", list)()
        if not check.holds
    ]
    if failed:
        raise ConfigError(f"{where}: {'; '.join(failed)}")


def sections(cfg: Any, prefix: str = ""):
    """(dotted prefix, section) of `cfg` and every dataclass nested in it, outermost first."""
    yield prefix, cfg
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from sections(value, f"{prefix}{f.name}.")
