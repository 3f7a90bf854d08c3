"""What an FSDP2 forward without autograd holds gathered, measured on a live sharded model
against the host projection's gathered_layers term."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from align.utils.heap import MALLOPT

# Four decoder layers of 25 MiB (a wide MLP over a tiny vocabulary and 8 positions), so the
# layers are all that a forward gathers or computes in any amount.
PROGRAM = """
import json, sys
import torch, torch.distributed as dist
from align.model.hf_config import MistralConfig
from align.model.mistral import NmoMistralForCausalLM
from align.train.fsdp import apply_fsdp
from align.train.memory import gathered_layers, parameter_count
from align.train.phases import reset_host_peak, status_mb
from align.utils.heap import fix_mmap_threshold, release_freed_memory

assert fix_mmap_threshold()
rank, world = int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"file://{sys.argv[1]}", rank=rank, world_size=world)
torch.set_num_threads(1)
config = MistralConfig(vocab_size=64, hidden_size=256, intermediate_size=8192,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=16, pad_token_id=0)
model = NmoMistralForCausalLM(config, "sdpa")
apply_fsdp(model)
ids = torch.ones(1, 8, dtype=torch.long)
with torch.no_grad():
    model(input_ids=ids)  # the first forward loads kernels; the second is measured
    release_freed_memory()
    before = status_mb("VmRSS")
    reset_host_peak()
    model(input_ids=ids)
    gathered = status_mb("VmHWM") - before
    dist.barrier()
layer = parameter_count(config)["layer"] * 4 / 2**20
projected = gathered_layers(world, parameter_count(config)["layer"], 4) / 2**20
print(json.dumps({"gathered_mb": gathered, "layer_mb": layer, "projected_mb": projected}))
dist.destroy_process_group()
"""


@pytest.mark.skipif(MALLOPT is None, reason="glibc's mallopt is not in this C library")
@pytest.mark.parametrize(("world", "low", "high"), [(2, 2.5, 3.2), (1, 0.9, 1.2)])
def test_a_forward_holds_the_gathered_layers_the_projection_counts(tmp_path, world, low, high):
    """Two ranks: the layer in use and the next twice while it is prefetched, more than the
    two layers an all-gather alone would hold. One rank gathers nothing: one layer's copy."""
    init = str(tmp_path / "init")
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", PROGRAM, init, str(rank), str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    for rank in ranks:
        out, err = rank.communicate(timeout=300)
        assert rank.returncode == 0, err[-3000:]
        found = json.loads(out.splitlines()[-1])
        assert low < found["gathered_mb"] / found["layer_mb"] < high, found
        # Beside the layers: the root (64 x 256) and eight positions' tensors, under 3 MiB.
        assert found["gathered_mb"] <= found["projected_mb"] + 3, found
