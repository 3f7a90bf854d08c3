"""Pre-registration and run configuration: dataclasses, strict TOML loading, dotted overrides.

An arm's TOML fixes every scientific choice. Loading refuses unknown keys and wrong
types, naming the file and key; overrides (`--lr=5e-7`, `lr=5e-7`,
`--optimizer.lr=5e-7`) are typed by the field they set, applied or refused, and
returned so every receipt can record them. Imports nothing heavy.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from align.exit_codes import ConfigError
from align.receipts import hash_file, hash_json
from align.topology import topology

T = TypeVar("T")
DTYPES = ("float32", "bfloat16", "float16")
DTYPE_KEYS = ("dtype", "master_dtype", "reduce_dtype")
TRUNCATION_POLICIES = ("prompt_left_response_right",)
DATA_FORMATS = ("argilla", "steppairs", "pairs", "ultrafeedback")


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


@dataclass
class DpoConfig:
    """The objective: loss variant and its weights (see align.losses.dpo.DPOObjective)."""

    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float = 0.0
    length_normalize: bool = False
    rdpo_alpha: float = 0.0


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


@dataclass
class TripwireResponse:
    """The pre-registered configuration of the single rerun after an alarm (unset = unchanged)."""

    lr: float | None = None
    beta: float | None = None
    rpo_alpha: float | None = None


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


@dataclass
class EvalConfig:
    batch_size: int = 32


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


@dataclass
class SftDataConfig:
    files: list[str] = field(default_factory=list)
    seq_len: int = 512
    held_fraction: float = 0.1
    split_seed: int = 0


@dataclass
class SftGateConfig:
    """Section-11 quality gate: held-out NLL ceiling and greedy-generation sanity."""

    max_held_nll: float = 2.0
    generation_prompts: int = 8
    max_new_tokens: int = 32
    min_terminated_fraction: float = 1.0


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


@dataclass
class LengthProbeConfig:
    """Greedy generations on held-out prompts: an arm outside `band` is ineligible."""

    prompts: int = 16
    max_new_tokens: int = 48
    band: GenerationBandConfig = field(default_factory=GenerationBandConfig)


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


def _build(cls: type, raw: dict[str, Any], where: str, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
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
    """Cross-field checks that no type annotation expresses."""
    for dotted, value in _walk(cfg):
        leaf = dotted.rsplit(".", 1)[-1]
        if leaf in DTYPE_KEYS and value not in DTYPES:
            raise ConfigError(f"{where}: key {dotted!r} expected one of {DTYPES}, found {value!r}")
    if isinstance(cfg, ArmConfig):
        if not cfg.arm:
            raise ConfigError(f"{where}: key 'arm' is required")
        if cfg.data.format not in DATA_FORMATS:
            raise ConfigError(
                f"{where}: key 'data.format' expected one of {DATA_FORMATS}, found {cfg.data.format!r}"
            )
        if cfg.data.truncation not in TRUNCATION_POLICIES:
            raise ConfigError(
                f"{where}: key 'data.truncation' expected one of {TRUNCATION_POLICIES}, "
                f"found {cfg.data.truncation!r}"
            )
        budget = cfg.data.max_prompt_tokens
        if budget is not None and budget < 1:
            raise ConfigError(
                f"{where}: key 'data.max_prompt_tokens' expected an integer >= 1 or none, "
                f"found {budget!r}"
            )
        check_disarmed_reasons(cfg.tripwires, where)
    for dotted, value, ok, expected in _ranges(cfg):
        if not ok:
            raise ConfigError(f"{where}: key {dotted!r} expected {expected}, found {value!r}")
    batch = getattr(cfg, "batch", None)
    if batch is not None:
        topology(batch.world_size, batch.gpus_per_node)
        product = batch.world_size * batch.micro_batch * batch.grad_accum
        if product != batch.global_batch:
            raise ConfigError(
                f"{where}: batch topology world_size x micro_batch x grad_accum = "
                f"{batch.world_size} x {batch.micro_batch} x {batch.grad_accum} = {product}, "
                f"expected global_batch {batch.global_batch}"
            )


def check_disarmed_reasons(wires: TripwireConfig, where: str) -> None:
    """Each disarmed wire states why in [tripwires.disarmed]; an armed wire has no reason."""
    for wire in (f.name for f in dataclasses.fields(DisarmedWires)):
        armed, reason = getattr(wires, wire), getattr(wires.disarmed, wire).strip()
        if not armed and not reason:
            raise ConfigError(
                f"{where}: key 'tripwires.{wire}' is false but 'tripwires.disarmed.{wire}' "
                "gives no reason; a pre-registration that disarms a wire must say why"
            )
        if armed and reason:
            raise ConfigError(
                f"{where}: key 'tripwires.disarmed.{wire}' gives a reason, but "
                f"'tripwires.{wire}' is armed; remove the reason or disarm the wire"
            )


POSITIVE_INTS = (
    "world_size",
    "micro_batch",
    "grad_accum",
    "global_batch",
    "epochs",
    "threads",
    "batch_size",
    "slice_pairs",
    "generation_every_steps",
    "generation_prompts",
    "generation_max_new_tokens",
)
FRACTIONS = ("min_terminated_vs_sft", "min_terminated_vs_chosen")


def _ranges(cfg: Any):
    """(key, value, in range, what was expected) for every range-checked leaf."""
    for dotted, value in _walk(cfg):
        leaf = dotted.rsplit(".", 1)[-1]
        if value is None:
            continue
        if leaf in POSITIVE_INTS:
            yield dotted, value, value >= 1, "an integer >= 1"
        elif leaf == "seq_len":
            yield dotted, value, value >= 2, "an integer >= 2"
        elif leaf == "held_fraction":
            yield dotted, value, 0.0 < value < 1.0, "a fraction in (0, 1)"
        elif leaf in ("lr", "beta"):
            yield dotted, value, math.isfinite(value) and value > 0, "a finite number > 0"
        elif leaf in FRACTIONS:
            yield dotted, value, 0.0 <= value <= 1.0, "a fraction in [0, 1]"
        elif leaf == "length_low":
            yield dotted, value, 0.0 <= value <= 1.0, "a factor in [0, 1]"
        elif leaf == "length_high":
            yield dotted, value, value >= 1.0, "a factor >= 1"
        elif leaf in ("min_moved_fraction", "device_memory_fraction"):
            yield dotted, value, 0.0 < value <= 1.0, "a fraction in (0, 1]"
        elif leaf == "gpus_per_node":
            yield dotted, value, value >= 0, "an integer >= 0"
        elif leaf == "device_memory_gb":
            yield dotted, value, math.isfinite(value) and value >= 0, "a number of GB >= 0"


def _walk(obj: Any, prefix: str = ""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _walk(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, value
