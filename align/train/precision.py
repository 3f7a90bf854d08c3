"""Master, compute and gradient-reduction dtypes: the FSDP2 policy that applies them, and
the read-back from a live model that proves what runs.

The pre-registration names three dtypes (align.config.ModelConfig). FSDP2 keeps the
sharded parameters in the master dtype, casts them to the compute dtype when it gathers
a layer, and reduces gradients in the reduce dtype. `verify_precision` runs one tiny
forward with hooks on every linear layer and reads back what the parameters, the
activations, the loss head and FSDP's own parameter groups really hold, then refuses any
difference from the pre-registration.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from align.exit_codes import ConfigError
from align.utils.dtypes import TORCH_DTYPES


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Precision:
    """The three dtypes of a training or scoring path, by name."""

    compute: str
    master: str = "float32"
    reduce: str = "float32"

    @classmethod
    def of(cls, model_cfg) -> Precision:
        """From a pre-registration's `[model]` section (align.config.ModelConfig)."""
        return cls(model_cfg.dtype, model_cfg.master_dtype, model_cfg.reduce_dtype)

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


def mixed_precision_policy(precision: Precision) -> MixedPrecisionPolicy:
    """FSDP2's policy for `precision`; the sharded parameters must already be in its master dtype."""
    return MixedPrecisionPolicy(
        param_dtype=TORCH_DTYPES[precision.compute],
        reduce_dtype=TORCH_DTYPES[precision.reduce],
    )


def fsdp_dtypes(model: nn.Module) -> dict[str, set[str]]:
    """What FSDP's parameter groups hold: master (sharded), compute (gathered) and reduce dtypes.

    FSDP clamps a cast it does not need to None, so the effective dtype falls back to
    the one it would otherwise use.
    """
    found: dict[str, set[str]] = {"master": set(), "compute": set(), "reduce": set()}
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for param in group.fsdp_params:
                compute = param.param_dtype or param.orig_dtype
                found["master"].add(dtype_name(param.orig_dtype))
                found["compute"].add(dtype_name(compute))
                found["reduce"].add(dtype_name(param.reduce_dtype or compute))
    return found


def observed_forward_dtypes(model: nn.Module, device: torch.device) -> dict[str, set[str]]:
    """Run one two-token forward through the loss head, recording what every linear layer
    received, held and returned, and what the loss head returned."""
    seen: dict[str, set[str]] = {"linear_inputs": set(), "linear_weights": set(), "loss": set()}
    seen["linear_outputs"] = set()

    def record(module, args, output):
        seen["linear_inputs"].add(dtype_name(args[0].dtype))
        seen["linear_weights"].add(dtype_name(module.weight.dtype))
        seen["linear_outputs"].add(dtype_name(output.dtype))

    handles = [m.register_forward_hook(record) for m in model.modules() if type(m) is nn.Linear]
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    labels = torch.tensor([[0, -100]], dtype=torch.long, device=device)
    try:
        with torch.no_grad():
            logps, _ = model(ids, labels=labels)
    finally:
        for handle in handles:
            handle.remove()
    seen["loss"].add(dtype_name(logps.dtype))
    if isinstance(model, FSDPModule):
        # The root keeps its gathered parameters after a forward; training and the
        # optimizer must see the sharded master parameters again.
        model.reshard()
    return seen


def read_back(model: nn.Module, device: torch.device) -> dict[str, object]:
    """The live dtypes: parameters as the optimizer sees them, FSDP's groups, one forward."""
    # The forward comes first: FSDP settles its groups' dtypes on the first one.
    observed = observed_forward_dtypes(model, device)
    groups = fsdp_dtypes(model)
    parameters = sorted({dtype_name(p.dtype) for p in model.parameters()})
    return {
        "parameters": parameters,
        **{f"fsdp_{k}": sorted(v) for k, v in groups.items()},
        **{k: sorted(v) for k, v in observed.items()},
    }


def check_read_back(found: dict[str, object], expected: Precision) -> None:
    """Refuse a model whose live dtypes are not the pre-registered ones, naming each."""
    wanted = {
        "parameters": [expected.master],
        "fsdp_master": [expected.master],
        "fsdp_compute": [expected.compute],
        "fsdp_reduce": [expected.reduce],
        "linear_inputs": [expected.compute],
        "linear_weights": [expected.compute],
        "linear_outputs": [expected.compute],
    }
    wrong = [
        f"{key} expected {want}, found {found.get(key)}"
        for key, want in wanted.items()
        if found.get(key) != want
    ]
    if wrong:
        raise ConfigError(
            f"the live model does not run the pre-registered precision {expected.as_dict()}: "
            + "; ".join(wrong)
        )


def describe(record: dict) -> str:
    """A precision record (`verify_precision`'s) in one line, as the stages' banners print it."""
    return (
        f"compute {record['compute']}, master {record['master']}, "
        f"reduce {record['reduce']}, loss head {record['loss']}"
    )


def verify_precision(model: nn.Module, expected: Precision, device: torch.device) -> dict:
    """Read back the live dtypes, refuse any difference, and return the record for receipts."""
    found = read_back(model, device)
    check_read_back(found, expected)
    return {
        "compute": expected.compute,
        "master": expected.master,
        "reduce": expected.reduce,
        # The loss head accumulates in float32 (align.losses.fused) whatever the compute dtype.
        "loss": found["loss"][0],
        "read_back": found,
    }
