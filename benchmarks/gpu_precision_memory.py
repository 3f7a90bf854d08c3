"""On one CUDA GPU: a training rank's host memory outside the model against the preflight's
per-rank constant, bf16 compute over float32 masters, the elements one step moves, the
device-memory projection against what a full-width Mistral-7B step allocates, and the
fused loss head's memory against full logits at T = 4096.

Each check prints its figures and the file named by --out gets them all as JSON; the exit
status is non-zero when a check fails. Run by benchmarks/gpu_check.sh:
  python benchmarks/gpu_precision_memory.py --out $OUT/precision_memory.json [--layers 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from align.config import ArmConfig, apply_overrides
from align.data.loader import TokenBatch
from align.losses.dpo import DPOObjective, dpo_objective
from align.losses.fused import fused_dpo
from align.losses.reference import reference_dpo
from align.model.hf_config import MistralConfig
from align.model.mistral import NmoMistralForCausalLM
from align.train.fsdp import apply_fsdp
from align.train.memory import projected_device_memory
from align.train.optim import build_optimizer
from align.train.precision import Precision, mixed_precision_policy, verify_precision
from align.utils.dist import destroy_distributed, init_distributed
from align.utils.dtypes import TORCH_DTYPES

MISTRAL_7B = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "sliding_window": 4096,
}
# --device cpu smoke-tests the script's wiring on small shapes; figures are CUDA's.
DEVICE = "cuda"
SMALL = {**MISTRAL_7B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
SMALL.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> float:
    """Start a peak measurement; returns MiB allocated now (0 off CUDA)."""
    if DEVICE != "cuda":
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated() / 2**20


def peak_mb() -> float:
    """MiB at the peak since `reset_peak` (0 off CUDA, where the figures mean nothing)."""
    sync()
    return torch.cuda.max_memory_allocated() / 2**20 if DEVICE == "cuda" else 0.0


def sharded_model(config: MistralConfig, precision: Precision, seed: int = 0, attn: str = "sdpa"):
    """The model as align.train.fsdp.load_sharded builds it, with random weights."""
    with torch.device("meta"):
        model = NmoMistralForCausalLM(config, attn, attn_device=torch.device(DEVICE))
    model.to(TORCH_DTYPES[precision.master])
    apply_fsdp(model, mixed_precision_policy(precision))
    model.to_empty(device=DEVICE)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            local.fill_(1.0) if "norm" in name else local.normal_(0, 0.02)
    model.precision = verify_precision(model, precision, torch.device(DEVICE))
    return model


def pair_batch(vocab: int, length: int, prompt: int) -> TokenBatch:
    """One pair: a full-length chosen row and a shorter rejected row (so the mask is real)."""
    ids = torch.randint(3, vocab, (2, length), generator=torch.Generator().manual_seed(0))
    lengths = torch.tensor([length, length - 97])
    positions = torch.arange(length)[None]
    attention = positions < lengths[:, None]
    return TokenBatch(
        input_ids=ids,
        attention_mask=attention.long(),
        loss_mask=(positions >= prompt) & attention,
        rows=np.arange(1),
    )


def dpo_loss(model, batch: TokenBatch) -> torch.Tensor:
    from align.eval.logprobs import sequence_logps_and_counts

    logps, counts = sequence_logps_and_counts(model, batch)
    zeros = torch.zeros(1, device=logps.device)
    return dpo_objective(logps, counts, zeros, zeros, DPOObjective(beta=0.1)).loss


def check_rank_host_overhead() -> dict:
    """A training rank's host peak with a model too small to count: the interpreter, torch,
    the process group and, on CUDA, the driver's host side, Triton's compiled kernel and
    bitsandbytes, as a production rank loads them. Run first, before any large check."""
    from align.config import OptimizerConfig, PreflightConfig
    from align.train.memory import rank_overhead_mb
    from align.train.trainer import peak_rss_bytes

    cuda = DEVICE == "cuda"
    precision = Precision("bfloat16" if cuda else "float32")
    model = sharded_model(MistralConfig(**SMALL), precision, attn="triton_fa2" if cuda else "sdpa")
    name = "adamw8bit" if cuda else "adamw"
    optimizer = build_optimizer(model, OptimizerConfig(name=name, lr=1e-4))
    for _ in range(3):
        dpo_loss(model, pair_batch(SMALL["vocab_size"], 256, 64)).backward()
        optimizer.step()
        optimizer.zero_grad()
    sync()
    measured = peak_rss_bytes() / 2**20
    configured = rank_overhead_mb(PreflightConfig(), DEVICE)
    return {
        # The constant must cover what a rank holds; replace it with this figure when it does not.
        "ok": measured <= configured,
        "device": DEVICE,
        "host_peak_mb": measured,
        f"preflight.{DEVICE}_rank_overhead_mb": configured,
        "measured_over_configured": measured / configured,
    }


def check_bf16_compute() -> dict:
    model = sharded_model(MistralConfig(**SMALL), Precision("bfloat16"))
    loss = dpo_loss(model, pair_batch(SMALL["vocab_size"], 64, 16))
    loss.backward()
    params = sorted({str(p.dtype) for p in model.parameters()})
    grads = sorted({str(p.grad.dtype) for p in model.parameters()})
    figures = {"precision": model.precision, "parameters": params, "gradients": grads}
    ok = (
        model.precision["read_back"]["linear_outputs"] == ["bfloat16"]
        and params == ["torch.float32"]
        and grads == ["torch.float32"]
    )
    return {"ok": ok, **figures}


def moved(master: str, lr: float) -> float:
    from align.config import OptimizerConfig

    model = sharded_model(MistralConfig(**SMALL), Precision("bfloat16", master))
    optimizer = build_optimizer(model, OptimizerConfig(name="adamw", lr=lr, weight_decay=0.0))
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    ids = torch.arange(SMALL["vocab_size"], device=DEVICE).reshape(4, -1)
    logps, _ = model(ids, labels=torch.roll(ids, -1, dims=1))
    (-logps.sum()).backward()
    optimizer.step()
    after = [p.detach().full_tensor() for p in model.parameters()]
    return sum(int((a != b).sum()) for a, b in zip(after, before, strict=True)) / sum(
        b.numel() for b in before
    )


def check_elements_moved() -> dict:
    fp32, bf16 = moved("float32", 5e-7), moved("bfloat16", 5e-7)
    return {"ok": fp32 >= 0.99 and bf16 < 0.05, "float32_master": fp32, "bfloat16_master": bf16}


def check_device_projection(layers: int, seq_len: int, steps: int) -> dict:
    fields = {**(MISTRAL_7B if DEVICE == "cuda" else SMALL), "num_hidden_layers": layers}
    cfg = ArmConfig(arm="gpu_check")
    apply_overrides(
        cfg,
        [
            "--model.dtype=bfloat16",
            "--optimizer.name=adamw8bit",
            "--batch.world_size=1",
            "--micro_batch=1",
            "--grad_accum=1",
            "--global_batch=1",
            f"--data.seq_len={seq_len}",
            "--run.device=cuda",
        ],
        "gpu_check",
    )
    with tempfile.TemporaryDirectory() as stub:
        (Path(stub) / "config.json").write_text(json.dumps(fields))
        projection = projected_device_memory(cfg, stub)
    reset_peak()
    model = sharded_model(MistralConfig(**fields), Precision("bfloat16"))
    optimizer = build_optimizer(model, cfg.optimizer)
    batch = pair_batch(fields["vocab_size"], seq_len, seq_len // 4)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        dpo_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - started)
    measured = peak_mb()
    ratio = measured / projection["allocated_mb"]
    return {
        # The projection is for sizing: within 15% either way, and never far under.
        "ok": 0.85 <= ratio <= 1.15,
        "layers": layers,
        "seq_len": seq_len,
        "measured_mb": measured,
        "projected_allocated_mb": projection["allocated_mb"],
        "measured_over_projected": ratio,
        "terms_mb": projection["terms_mb"],
        "step_s": times,
    }


def check_fused_loss_memory(length: int) -> dict:
    vocab, hidden, pairs = 32000, 4096, 1
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    labels = torch.randint(0, vocab, (2 * pairs, length), generator=generator, device=DEVICE)
    labels[:, -1] = -100
    ref = torch.zeros(pairs, device=DEVICE)
    peaks = {}
    for name in ("reference", "fused"):
        h = torch.randn(2 * pairs, length, hidden, device=DEVICE, dtype=torch.bfloat16)
        w = torch.randn(vocab, hidden, device=DEVICE, dtype=torch.bfloat16) / hidden**0.5
        h.requires_grad_()
        w.requires_grad_()
        base = reset_peak()
        objective = DPOObjective(beta=0.1)
        if name == "reference":
            loss = reference_dpo(h, w, labels, ref, ref, objective, dtype=torch.float32).loss
        else:
            loss = fused_dpo(h, w, labels, ref, ref, objective).loss
        loss.backward()
        peaks[name] = peak_mb() - base
        del h, w, loss
    ratio = peaks["fused"] / peaks["reference"] if peaks["reference"] else float("nan")
    return {"ok": ratio < 0.25, "T": length, "peak_extra_mb": peaks, "fused_over_reference": ratio}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=32, help="decoder layers of the 7B check")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--fused-length", type=int, default=4096)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    init_distributed(tempfile.mkdtemp(), DEVICE)
    checks = {
        "rank_host_overhead": check_rank_host_overhead,
        "bf16_compute_float32_master": check_bf16_compute,
        "elements_moved_at_lr_5e-7": check_elements_moved,
        "device_projection_7b_adamw8bit": lambda: check_device_projection(
            args.layers, args.seq_len, args.steps
        ),
        f"fused_loss_memory_T{args.fused_length}": lambda: check_fused_loss_memory(
            args.fused_length
        ),
    }
    results = {}
    for name, check in checks.items():
        try:
            results[name] = check()
        except Exception as err:  # report every check, whatever one of them raised
            results[name] = {"ok": False, "error": f"{type(err).__name__}: {err}"}
        print(f"{name}: {json.dumps(results[name], default=str)}", flush=True)
    args.out.write_text(json.dumps(results, indent=2, default=str) + "\n")
    destroy_distributed()
    failed = [name for name, r in results.items() if not r["ok"]]
    print("failed: " + ", ".join(failed) if failed else "all precision and memory checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
