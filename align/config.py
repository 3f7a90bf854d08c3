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
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

from align.constants import CPU_ISAS, DTYPES
from align.exit_codes import ConfigError
from align.receipts import hash_file, hash_json
from align.topology import divides, ranks_per_node

T = TypeVar("T")
TRUNCATION_POLICIES = ("prompt_left_response_right",)
DATA_FORMATS = ("argilla", "steppairs", "pairs", "ultrafeedback")
# The DPO loss variants align.losses.dpo implements; label smoothing applies to the first.
DPO_LOSSES = ("sigmoid", "ipo", "hinge")
SMOOTHABLE_LOSSES = ("sigmoid",)


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


@dataclass
class FilterConfig:
    """Pre-registered row filters; each reports how many rows it removed."""

    exclude_status: list[str] = field(default_factory=list)
    min_chosen_score: float | None = None
    exclude_in_gsm8k_train: bool = False


@dataclass
class DataConfig:
    """Where an arm's pairs come from, how they are cut and split, and how many are expected."""

    format: str = "pairs"
    files: list[str] = field(default_factory=list)
    seq_len: int = 512
    truncation: str = "prompt_left_response_right"
    held_fraction: float = 0.1
    split_seed: int = 0
    min_pairs: int = 1
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
            one_of("truncation", self.truncation, TRUNCATION_POLICIES),
            at_least("seq_len", self.seq_len, 2),
            open_fraction("held_fraction", self.held_fraction),
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
    attn_implementation: str = "sdpa"

    def checks(self) -> list[Check]:
        keys = ("dtype", "master_dtype", "reduce_dtype")
        return [one_of(key, getattr(self, key), DTYPES) for key in keys]


@dataclass
class RefConfig:
    """The forward path that builds the reference log-prob cache, and how the work is cut.

    The precompute writes one resumable part per slice of `slice_pairs` pairs, rounded
    up to whole batches so that slicing never changes a batch; the cache's bytes do not
    depend on it. `share_prompt` scores each pair as one prefix-shared row, as
    `batch.share_prompt` trains.
    """

    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    batch_size: int = 16
    share_prompt: bool = False
    slice_pairs: int = 128

    def checks(self) -> list[Check]:
        return [
            one_of("dtype", self.dtype, DTYPES),
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
    # RPO: this weight x the chosen response's token-mean NLL is added to each pair's loss.
    rpo_alpha: float = 0.0
    # Score per-token mean log-probs instead of sums (length-normalized DPO).
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

    name: str = "adamw"
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0

    def checks(self) -> list[Check]:
        return [finite_number("lr", self.lr, 0, True, "a finite number > 0")]


@dataclass
class BatchConfig:
    """Batch topology: world_size x micro_batch x grad_accum must equal global_batch.

    `share_prompt` lays each DPO pair out as one row [prompt | chosen | rejected], so the
    prompt runs once (align.data.loader.collate_shared_prompt); it changes the forward
    path, so it is part of forward_impl ('shared' for 'padded'). Needs an attention
    backend with a segment-aware mask ('sdpa', 'eager'); SFT refuses it.
    """

    world_size: int = 1
    # Ranks (GPUs) per node; 0 takes the site's run.gpus_per_node. world_size / this = nodes.
    gpus_per_node: int = 0
    micro_batch: int = 1
    grad_accum: int = 1
    global_batch: int = 1
    epochs: int = 1
    seed: int = 0
    share_prompt: bool = False

    def checks(self) -> list[Check]:
        ranks, per_node = self.world_size, self.gpus_per_node
        product = ranks * self.micro_batch * self.grad_accum
        return [
            *positive_ints(self, "world_size", "micro_batch", "grad_accum", "global_batch"),
            at_least("epochs", self.epochs, 1),
            Check(
                "gpus_per_node",
                per_node,
                divides(ranks, ranks_per_node(ranks, per_node)),
                f"0 (the site's value) or a divisor of world_size = {ranks}",
            ),
            Check(
                "global_batch",
                self.global_batch,
                product == self.global_batch,
                f"world_size x micro_batch x grad_accum = {ranks} x {self.micro_batch} x "
                f"{self.grad_accum} = {product}",
            ),
        ]


@dataclass
class TrainerConfig:
    """How the step loop runs, stops and checkpoints; not what it optimizes."""

    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    resume: bool = False
    # The job's budget, counted from the stage's start (a rerun spends the same budget).
    max_wall_seconds: float = 0.0
    max_micro_steps: int = 0
    probe_steps: int = 20
    max_consecutive_skipped_steps: int = 3
    max_skipped_fraction: float = 0.05
    activation_checkpointing: bool = False


@dataclass
class PathBiasConfig:
    """Step-0 check of the training forward path against the cache (mean |margin| in nats)."""

    tolerance: float = 1e-3
    sample_pairs: int = 64
    seed: int = 0


@dataclass
class PreflightConfig:
    """Memory projection terms that are not derived from the model: margins and overheads."""

    host_memory_fraction: float = 0.9
    rank_overhead_mb: float = 520.0
    activation_factor: float = 24.0
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
        ]


@dataclass
class TripwireResponse:
    """The pre-registered configuration of the single rerun after an alarm (unset = unchanged)."""

    lr: float | None = None
    beta: float | None = None
    rpo_alpha: float | None = None

    def checks(self) -> list[Check]:
        return [
            finite_number("lr", self.lr, 0, True, "a finite number > 0"),
            finite_number("beta", self.beta, 0, True, "a finite number > 0"),
            finite_number("rpo_alpha", self.rpo_alpha, 0, False, "a finite number >= 0"),
        ]


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
    """Why a pre-registration disarms a wire: required for each disarmed wire, refused for an
    armed one, so no wire is switched off without a stated reason."""

    collapse: str = ""
    length_drift: str = ""
    generation: str = ""


@dataclass
class TripwireConfig:
    """The wires watched while training (align.train.tripwires) and the one rerun's response."""

    # Windowed chosen log-ratio per token below the floor while the margin grows.
    collapse: bool = True
    logps_window: int = 64
    chosen_logp_floor: float = -1.0
    # Share of pairs whose implicit reward prefers the longer response, vs the data's.
    length_drift: bool = True
    length_window_pairs: int = 128
    length_band: float = 0.25
    # Greedy generations of a fixed held-out prompt set every `generation_every_steps`
    # optimizer steps (and after the last) must stay inside `generation_band`.
    generation: bool = True
    generation_every_steps: int = 25
    # Few and short, so a check costs seconds: every rank decodes its share together.
    generation_prompts: int = 8
    generation_max_new_tokens: int = 40
    generation_band: GenerationBandConfig = field(default_factory=GenerationBandConfig)
    disarmed: DisarmedWires = field(default_factory=DisarmedWires)
    response: TripwireResponse = field(default_factory=TripwireResponse)

    def checks(self) -> list[Check]:
        """Each disarmed wire states why; an armed wire has no reason."""
        checks = positive_ints(
            self, "generation_every_steps", "generation_prompts", "generation_max_new_tokens"
        )
        for wire in (f.name for f in dataclasses.fields(DisarmedWires)):
            armed, reason = getattr(self, wire), getattr(self.disarmed, wire).strip()
            expected = (
                f"no reason while {wire} is armed (remove it, or set {wire} = false)"
                if armed
                else f"the reason {wire} = false disarms the wire, since none may go unexplained"
            )
            checks.append(Check(f"disarmed.{wire}", reason, armed != bool(reason), expected))
        return checks


@dataclass
class EvalConfig:
    """How held-out pairs are scored: pairs per forward."""

    batch_size: int = 32

    def checks(self) -> list[Check]:
        return positive_ints(self, "batch_size")


@dataclass
class RunConfig:
    """Where this run reads and writes; not a scientific choice, so overrides are expected."""

    results_dir: str = "results"
    base_model: str = "resources/tiny/base"
    sft_checkpoint: str = ""
    device: str = "cpu"
    # The site's ranks (GPUs) per node, for arms that pre-register none; 0: one node.
    gpus_per_node: int = 0
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
    expected_host: str = ""
    require_off_root: bool = False
    # MiB of the node a job will run on, when it is not this host (the workflow passes the
    # partition's figure to the preflight on the submit host); 0: this host's memory.
    node_memory_mb: float = 0.0
    # Where node_memory_mb came from, for the preflight receipt.
    node_memory_source: str = ""

    def checks(self) -> list[Check]:
        return [
            at_least("gpus_per_node", self.gpus_per_node, 0),
            at_least("threads", self.threads, 1),
            one_of("cpu_isa", self.cpu_isa, ("", *CPU_ISAS)),
        ]


@dataclass
class ArmConfig:
    """One arm's pre-registration (config/arms/<arm>.toml)."""

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
        return [Check("arm", self.arm, bool(self.arm), "the arm's name (required)")]


@dataclass
class SftDataConfig:
    """The SFT conversations: where they are, how they are cut and split."""

    files: list[str] = field(default_factory=list)
    seq_len: int = 512
    held_fraction: float = 0.1
    split_seed: int = 0

    def checks(self) -> list[Check]:
        return [
            at_least("seq_len", self.seq_len, 2),
            open_fraction("held_fraction", self.held_fraction),
        ]


@dataclass
class SftGateConfig:
    """Section-11 quality gate: held-out NLL ceiling and greedy-generation sanity."""

    max_held_nll: float = 2.0
    generation_prompts: int = 8
    max_new_tokens: int = 32
    min_terminated_fraction: float = 1.0

    def checks(self) -> list[Check]:
        return [
            *positive_ints(self, "generation_prompts", "max_new_tokens"),
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
    run: RunConfig = field(default_factory=RunConfig)


@dataclass
class PairedEvalConfig:
    """The common held-out set every policy is scored on, and its paired statistics."""

    eval_set: str = "union"
    n_boot: int = 10000
    seed: int = 0
    confidence: float = 0.95

    def checks(self) -> list[Check]:
        return [
            at_least("n_boot", self.n_boot, 1),
            open_fraction("confidence", self.confidence),
        ]


@dataclass
class LengthProbeConfig:
    """Greedy generations on held-out prompts: an arm outside `band` is ineligible."""

    prompts: int = 16
    max_new_tokens: int = 48
    band: GenerationBandConfig = field(default_factory=GenerationBandConfig)

    def checks(self) -> list[Check]:
        return positive_ints(self, "prompts", "max_new_tokens")


@dataclass
class SelectionConfig:
    """The arm-selection pre-registration (config/selection.toml, section 13)."""

    rule: str = "paired_accuracy"
    default_arm: str = ""
    paired: PairedEvalConfig = field(default_factory=PairedEvalConfig)
    generation: LengthProbeConfig = field(default_factory=LengthProbeConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)


@dataclass
class TinyModelSpec:
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False


@dataclass
class TinyConfig:
    """The embedded tiny default: seeded data, tokenizer and random base model."""

    seed: int = 0
    out_dir: str = "resources/tiny"
    n_argilla: int = 700
    n_steppairs: int = 700
    n_sft: int = 1500
    vocab_size: int = 384
    model: TinyModelSpec = field(default_factory=TinyModelSpec)


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
        raw = tomllib.loads(path.read_text())
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
    for name, hint in typing.get_type_hints(cls).items():
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
    """Every section's own checks (`checks()`), refused at the first that fails, named by its
    dotted key."""
    for prefix, section in sections(cfg):
        for check in getattr(section, "checks", list)():
            if not check.holds:
                raise ConfigError(
                    f"{where}: key {prefix + check.key!r} expected {check.expected}, "
                    f"found {check.value!r}"
                )


def sections(cfg: Any, prefix: str = ""):
    """(dotted prefix, section) of `cfg` and every dataclass nested in it, outermost first."""
    yield prefix, cfg
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from sections(value, f"{prefix}{f.name}.")
