"""Under torchrun: adamw8bit on unevenly sharded FSDP2 parameters survives a DCP resume.

`torchrun --nproc-per-node=2 tests/drivers/adamw8bit_resume.py WORKDIR` trains three
steps, checkpoints, trains three more; then a differently seeded model and a fresh
optimizer load the checkpoint and train the same three steps. Each rank prints
`resumed equal` when the two end with bitwise-equal weights and its own shard's
optimizer state was restored, not another rank's.
"""

from __future__ import annotations

import sys

import torch

from align.config import OptimizerConfig
from align.losses.fused import shift_labels
from align.model.hf_config import MistralConfig
from align.model.mistral import NmoMistralForCausalLM
from align.train.checkpointing import CheckpointManager
from align.train.fsdp import apply_fsdp
from align.train.optim import build_optimizer
from align.utils.dist import destroy_distributed, init_distributed

# 257 rows: the embedding and lm_head split 129 / 128, so the ranks' absmax blocks differ.
CONFIG = MistralConfig(
    vocab_size=257,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=32,
    pad_token_id=0,
)
OPTIMIZER = OptimizerConfig(name="adamw8bit", lr=1e-2, weight_decay=0.01)


def model_of(seed: int) -> NmoMistralForCausalLM:
    torch.manual_seed(seed)
    model = NmoMistralForCausalLM(CONFIG)
    apply_fsdp(model)
    return model


def train(model, optimizer, rank: int, steps: int) -> None:
    ids = torch.randint(
        1, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(rank)
    )
    labels = shift_labels(ids, torch.ones_like(ids, dtype=torch.bool))
    for _ in range(steps):
        logps, counts = model(ids, labels=labels)
        (-logps.sum() / counts.sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def local_state(optimizer, model) -> dict[tuple[str, str], torch.Tensor]:
    return {
        (name, key): value.to_local().clone()
        for name, param in model.named_parameters()
        for key, value in optimizer.state[param].items()
        if hasattr(value, "to_local")
    }


def main() -> None:
    torch.set_num_threads(1)
    info = init_distributed(sys.argv[1], "cpu")
    manager = CheckpointManager(sys.argv[1], info, keep=1)
    model = model_of(0)
    optimizer = build_optimizer(model, OPTIMIZER)
    train(model, optimizer, info.rank, 3)
    checkpoint = manager.save(3, model, optimizer, {"world_size": info.world_size})
    saved = local_state(optimizer, model)
    train(model, optimizer, info.rank, 3)

    resumed = model_of(1)
    resumed_optimizer = build_optimizer(resumed, OPTIMIZER)
    manager.load(checkpoint, resumed, resumed_optimizer)
    restored = local_state(resumed_optimizer, resumed)
    state_ok = saved.keys() == restored.keys() and all(
        torch.equal(saved[key], restored[key]) for key in saved
    )
    train(resumed, resumed_optimizer, info.rank, 3)
    weights_ok = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(model.parameters(), resumed.parameters(), strict=True)
    )
    print(f"rank {info.rank}: state {state_ok}, weights {weights_ok}", file=sys.stderr)
    if state_ok and weights_ok:
        print(f"rank {info.rank}: resumed equal")
    destroy_distributed()


if __name__ == "__main__":
    main()
