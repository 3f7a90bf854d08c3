# Input and resource functions shared by the rules. Paths come from align.paths,
# the same module the stage scripts use; configs are read with align.config
# (stdlib only, so this costs milliseconds).
from pathlib import Path

from align.config import ArmConfig, SftConfig, load_config
from align.paths import SPLITS, RunPaths
from align.receipts import read_json
from align.train.path_bias import required_forward_impl
from align.train.ref_cache import forward_impl_name, parse_forward_impl

PATHS = RunPaths.of(config["results_dir"])
ARMS = list(config["arms"])
SCRIPTS = Path(workflow.basedir) / "workflow" / "scripts"
SFT_TOML = str(Path(workflow.basedir) / config["sft_config"])
TINY_TOML = str(Path(workflow.basedir) / config["tiny_config"])
TINY_DIR = Path(config["tiny_dir"])
BASE_MODEL = Path(config["base_model"])
CHECKPOINT_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

RUN_OVERRIDES = " ".join(
    [
        f"--run.results_dir={config['results_dir']}",
        f"--run.base_model={config['base_model']}",
        f"--run.sft_checkpoint={config['sft_checkpoint']}",
    ]
)


def arm_toml(arm):
    return str(Path(workflow.basedir) / config["arm_config_dir"] / f"{arm}.toml")


def arm_cfg(arm):
    return load_config(arm_toml(arm), ArmConfig).cfg


def sft_cfg():
    return load_config(SFT_TOML, SftConfig).cfg


def sft_checkpoint():
    """The SFT policy: the given checkpoint, or the one rule sft trains."""
    return config["sft_checkpoint"] or str(PATHS.sft_checkpoint)


def base_model_files():
    return [BASE_MODEL / name for name in CHECKPOINT_FILES]


def ref_forward_impl(arm):
    """The forward path of the reference cache the arm's pre-registration names."""
    ref = arm_cfg(arm).ref
    return forward_impl_name(ref.attn_implementation, ref.dtype, ref.batch_size)


def arm_shards(arm):
    return [PATHS.arm(arm).shard(split) for split in SPLITS]


def preregistered_ref_caches(wildcards):
    """The cache built by the pre-registered reference path; path_bias measures against it."""
    impl = ref_forward_impl(wildcards.arm)
    return [PATHS.arm(wildcards.arm).ref_cache(impl, split) for split in SPLITS]


def caches_in_use(wildcards):
    """The cache the path-bias report demands (the DAG is re-evaluated once it exists)."""
    bias_receipt = checkpoints.path_bias.get(arm=wildcards.arm).output[0]
    impl = required_forward_impl(read_json(bias_receipt))
    return [PATHS.arm(wildcards.arm).ref_cache(impl, split) for split in SPLITS]


def ref_overrides(wildcards):
    """The ref-path overrides that build the cache named by the forward_impl wildcard."""
    path = parse_forward_impl(wildcards.forward_impl)
    if path["padding"] != "padded":
        raise ValueError(
            f"forward_impl {wildcards.forward_impl}: only padded batches are built"
        )
    return " ".join(
        f"--ref.{key}={path[key]}"
        for key in ("attn_implementation", "dtype", "batch_size")
    )


def per_rank_threads(world_size):
    """The job's threads, shared among its ranks (at least one each)."""
    return max(1, config["threads"] // world_size)


def arm_world_size(wildcards):
    return arm_cfg(wildcards.arm).batch.world_size


def arm_rank_threads(wildcards):
    return per_rank_threads(arm_world_size(wildcards))


def arm_stop_marker(wildcards):
    return PATHS.arm(wildcards.arm).run_dir / "stopped.json"
