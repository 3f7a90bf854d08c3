"""Activation checkpointing wraps every decoder layer, recomputes it in backward, and
leaves the loss and every gradient as they are, alone and under FSDP2."""

from __future__ import annotations

import copy

import torch
from tiny_models import tiny_mistral_config
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    _CHECKPOINT_PREFIX,
    CheckpointWrapper,
)
from torch.distributed.fsdp import FSDPModule

from align.losses.fused import shift_labels
from align.model.checkpoint import save_hf_checkpoint
from align.model.mistral import DecoderLayer, NmoMistralForCausalLM
from align.train.fsdp import apply_activation_checkpointing, load_sharded
from align.train.precision import Precision

torch.set_num_threads(1)

CONFIG = tiny_mistral_config(vocab_size=96, num_hidden_layers=3, max_position_embeddings=32)


def step_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows with a scored response, as the DPO collate makes them."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(1, CONFIG.vocab_size, (4, 20), generator=generator)
    lengths = torch.tensor([20, 17, 12, 9])
    attention = torch.arange(20)[None, :] < lengths[:, None]
    loss_mask = attention & (torch.arange(20)[None, :] >= 4)
    return ids, attention.long(), shift_labels(ids, loss_mask)


def loss_and_grads(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step's loss (token-mean NLL through the chunked path) and its gradients."""
    ids, attention, labels = step_batch()
    logps, counts = model(ids, attention_mask=attention, labels=labels)
    loss = -logps.sum() / counts.sum()
    loss.backward()
    grads = {
        name.replace(_CHECKPOINT_PREFIX, ""): _full(param.grad)
        for name, param in model.named_parameters()
    }
    return loss.detach(), grads


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def count_layer_forwards(model) -> list[int]:
    """Forward calls per decoder layer (the recompute in backward counts as a second one)."""
    calls = [0] * len(model.layers)
    for index, module in enumerate(m for m in model.modules() if isinstance(m, DecoderLayer)):
        # Patched on the instance: the recompute bypasses module hooks but calls forward.
        def counted(*args, _forward=module.forward, _index=index, **kwargs):
            calls[_index] += 1
            return _forward(*args, **kwargs)

        module.forward = counted
    return calls


def assert_same_step(plain, checkpointed) -> None:
    loss, grads = loss_and_grads(plain)
    loss_ac, grads_ac = loss_and_grads(checkpointed)
    torch.testing.assert_close(loss_ac, loss, rtol=1e-6, atol=1e-7)
    assert grads_ac.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ac[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_every_decoder_layer_is_wrapped_and_recomputed_in_backward():
    torch.manual_seed(0)
    model = NmoMistralForCausalLM(CONFIG)
    apply_activation_checkpointing(model)
    assert all(isinstance(layer, CheckpointWrapper) for layer in model.layers)
    assert all(isinstance(layer._checkpoint_wrapped_module, DecoderLayer) for layer in model.layers)
    calls = count_layer_forwards(model)
    loss_and_grads(model)
    assert calls == [2] * CONFIG.num_hidden_layers


def test_checkpointing_leaves_loss_and_gradients_unchanged():
    torch.manual_seed(0)
    plain = NmoMistralForCausalLM(CONFIG)
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed)
    calls = count_layer_forwards(plain)
    assert_same_step(plain, checkpointed)
    assert calls == [1] * CONFIG.num_hidden_layers  # the reference really kept its activations


def test_checkpointing_under_fsdp_loads_the_weights_and_keeps_the_step(info, tmp_path):
    torch.manual_seed(0)
    save_hf_checkpoint(NmoMistralForCausalLM(CONFIG), tmp_path / "base")
    plain = load_sharded(tmp_path / "base", info, Precision("float32"), "sdpa")
    checkpointed = load_sharded(
        tmp_path / "base", info, Precision("float32"), "sdpa", activation_checkpointing=True
    )
    for layer in checkpointed.layers:
        assert isinstance(layer, CheckpointWrapper) and isinstance(layer, FSDPModule)
        assert isinstance(layer._checkpoint_wrapped_module, DecoderLayer)
    calls = count_layer_forwards(checkpointed)
    assert_same_step(plain, checkpointed)
    assert calls == [2] * CONFIG.num_hidden_layers
