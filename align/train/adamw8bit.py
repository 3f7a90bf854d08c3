"""bitsandbytes' 8-bit AdamW, stepping plain and FSDP2-sharded (DTensor) parameters.

bitsandbytes' update kernels take plain tensors; under FSDP2 each parameter is a
DTensor whose local shard is what this rank owns. `ShardedAdamW8bit` runs those
kernels on the local shards and keeps every per-parameter state tensor a DTensor, so
torch.distributed.checkpoint saves each rank's part: the two moments carry the
parameter's placement, and the per-block absmax scales (one float32 per 256 values of
the local shard) are padded to the largest shard's block count and sharded evenly.

`check_device` runs one real update on the target device and refuses (ConfigError)
a device where bitsandbytes cannot run it, rather than letting training fall back.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from align.exit_codes import ConfigError

NAME = "adamw8bit"
BLOCK = 256  # values per absmax scale in bitsandbytes' blockwise quantization
MIN_8BIT_SIZE = 4096  # smaller tensors keep float32 moments (bitsandbytes' default)


def _bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as err:
        raise ConfigError(
            f"optimizer.name {NAME!r} needs bitsandbytes, which is not importable here ({err}); "
            "install the project's 'adamw8bit' extra"
        ) from err
    return bitsandbytes


def _padded_blocks(param: DTensor) -> int:
    """Blocks of the largest local shard: FSDP2 splits dim 0 like torch.chunk."""
    world = param.device_mesh.size()
    rows = math.ceil(param.shape[0] / world)
    return math.ceil(rows * math.prod(param.shape[1:]) / BLOCK)


def _require_dim0_sharding(param: DTensor) -> None:
    if param.device_mesh.ndim != 1 or tuple(param.placements) != (Shard(0),):
        raise ConfigError(
            f"optimizer.name {NAME!r} steps FSDP2 parameters sharded on dim 0 of a 1-D mesh, "
            f"found placements {param.placements} on a {param.device_mesh.ndim}-D mesh"
        )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


@functools.cache
def _optimizer_class():
    bnb = _bitsandbytes()
    functional = bnb.functional

    class ShardedAdamW8bit(bnb.optim.AdamW8bit):
        """AdamW with blockwise 8-bit moments; DTensor parameters step shard by shard."""

        @torch.no_grad()
        def init_state(self, group, p, gindex, pindex):
            if not isinstance(p, DTensor):
                return super().init_state(group, p, gindex, pindex)
            _require_dim0_sharding(p)
            config = self.get_config(gindex, pindex, group)
            # Decided on the global size, so every rank keeps the same kind of state.
            eight_bit = config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]
            state = self.state[p]
            state["step"] = 0
            dtype = torch.uint8 if eight_bit else torch.float32
            state["state1"] = torch.zeros_like(p, dtype=dtype)
            state["state2"] = torch.zeros_like(p, dtype=dtype)
            if eight_bit:
                device = p.to_local().device
                state["qmap1"] = self.name2qmap["dynamic"].to(device)
                state["qmap2"] = self.name2qmap["udynamic"].to(device)
                blocks, mesh = _padded_blocks(p), p.device_mesh
                for key in ("absmax1", "absmax2"):
                    state[key] = DTensor.from_local(
                        torch.zeros(blocks, dtype=torch.float32, device=device),
                        mesh,
                        [Shard(0)],
                        run_check=False,
                        shape=(mesh.size() * blocks,),
                        stride=(1,),
                    )
            return None

        @torch.no_grad()
        def update_step(self, group, p, gindex, pindex):
            if not isinstance(p, DTensor):
                return super().update_step(group, p, gindex, pindex)
            state = self.state[p]
            state["step"] += 1
            param = p.to_local()
            if param.numel() == 0:  # this rank holds no rows of a small parameter
                return None
            if not param.is_contiguous():
                raise RuntimeError(f"local shard of a {tuple(p.shape)} parameter is not contiguous")
            config = self.get_config(gindex, pindex, group)
            grad = _local(p.grad).contiguous()
            beta1, beta2 = config["betas"][:2]
            state1, state2 = _local(state["state1"]), _local(state["state2"])
            if state1.dtype == torch.uint8:
                blocks = math.ceil(param.numel() / BLOCK)
                functional.optimizer_update_8bit_blockwise(
                    self.optimizer_name,
                    grad,
                    param,
                    state1,
                    state2,
                    beta1,
                    beta2,
                    0.0,
                    0.0,
                    config["eps"],
                    state["step"],
                    config["lr"],
                    state["qmap1"],
                    state["qmap2"],
                    _local(state["absmax1"])[:blocks],
                    _local(state["absmax2"])[:blocks],
                    config["weight_decay"],
                    gnorm_scale=1.0,
                    skip_zeros=config["skip_zeros"],
                )
            else:
                functional.optimizer_update_32bit(
                    self.optimizer_name,
                    grad,
                    param,
                    state1,
                    beta1,
                    config["eps"],
                    state["step"],
                    config["lr"],
                    state2,
                    beta2,
                    weight_decay=config["weight_decay"],
                    skip_zeros=config["skip_zeros"],
                )
            return None

    return ShardedAdamW8bit


def build_adamw8bit(
    groups: list[dict[str, Any]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> torch.optim.Optimizer:
    """The optimizer for param `groups` ((name, tensor) params and each group's
    weight_decay), after checking that bitsandbytes runs on their device."""
    devices = {_local(p).device for group in groups for _, p in group["params"]}
    if len(devices) != 1:
        raise ConfigError(
            f"optimizer.name {NAME!r} needs every parameter on one device, found {sorted(map(str, devices))}"
        )
    check_device(devices.pop())
    return _optimizer_class()(groups, lr=lr, betas=betas, eps=eps, min_8bit_size=MIN_8BIT_SIZE)


def check_device(device: torch.device) -> None:
    """Refuse a device where bitsandbytes cannot run its 8-bit AdamW update."""
    reason = _probe(str(device))
    if reason is not None:
        version = getattr(_bitsandbytes(), "__version__", "?")
        raise ConfigError(
            f"optimizer.name {NAME!r} cannot be honoured on device {device}: "
            f"bitsandbytes {version} {reason}"
        )


@functools.cache
def _probe(device: str) -> str | None:
    """Why one 8-bit AdamW step fails on `device`, or None when it updates as AdamW does."""
    cls = _optimizer_class()
    try:
        param = torch.zeros(MIN_8BIT_SIZE, device=device)
        param.grad = torch.ones_like(param)
        optimizer = cls([param], lr=1.0, weight_decay=0.0, min_8bit_size=MIN_8BIT_SIZE)
        optimizer.step()
        # AdamW's first step moves each value by lr against the gradient's sign.
        moved = param.detach().to("cpu")
    except Exception as err:  # any failure of the probe step is the reason to refuse
        message = str(err).splitlines()[0] if str(err) else ""
        return f"cannot run its 8-bit AdamW step there ({type(err).__name__}: {message})"
    if optimizer.state[param]["state1"].dtype != torch.uint8:
        return "kept float32 state for a tensor that should be 8-bit"
    if not torch.allclose(moved, torch.full_like(moved, -1.0), atol=1e-3):
        return f"computed a wrong first AdamW step (mean update {float(moved.mean()):.4g}, expected -1)"
    return None
