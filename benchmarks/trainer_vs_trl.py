"""align's Trainer against TRL's DPOTrainer: step time, tokens/s and peak RSS on CPU.

Eight configurations train the same random Mistral (hidden 256, 6 layers, ~4.9M
parameters, sdpa) on the same pre-tokenized pairs for the same steps, batch, learning
rate, AdamW betas and gradient clip, in float32 but the *_bf16 ones, and without
activation checkpointing unless --activation-checkpointing turns it on for all. Each side
is compared in its own arithmetic: float32 align against float32 TRL, bfloat16 compute
(production's) against TRL's bf16 autocast.

  align        align's Trainer (FSDP2 on one gloo rank), reference log-probs precomputed
  align_shared the same with batch.layout = "shared": one row [prompt | chosen | rejected]
               per pair, so the prompt runs once; sdpa runs the rows as one unpadded stream
               of exact attention pieces, the last layer only where a label reads it
               (align.kernels.pieces)
  align_packed the same with batch.layout = "packed": as many shared pairs per row as
               fit the step's widest (the same stream through sdpa)
  align_bf16   align with model.dtype = bfloat16: float32 master shards, bf16 forward and
               backward (FSDP2's MixedPrecisionPolicy), its own bf16 reference log-probs
  align_shared_bf16  the shared layout in bfloat16
  trl_precomp  TRL DPOTrainer, precompute_ref_log_probs=True
  trl_bf16     the same with bf16=True (float32 weights, bf16 autocast)
  trl_live     TRL DPOTrainer with a live reference model (a second copy of the weights)

Two workloads, each run in full (--workloads picks): `shots`, the embedded synthetic
arithmetic questions (align.data.synthetic, argilla format) with each prompt packed with
earlier solved questions to about SHOTS_LEN tokens and short answers; and `varied`, prompts
of 200-500 tokens and responses of 20-300 (log-uniform, chosen and rejected drawn apart)
cut from the same text, as prompt-heavy chat data is. Both are tokenized once with a
byte-level BPE trained on the texts; TRL gets the same token ids (its own tokenization step
is skipped), so both score the same completion tokens. Each side precomputes its reference log-probs in its own process
before training, as its trainer does.

How it is measured: every (configuration, round) runs in a fresh subprocess with
the same thread count (an align one set up as align's stages set up a rank:
align.utils.guard.configure_cpu); peak RSS is that child's ru_maxrss (os.wait4). Step time is the
interval between consecutive optimizer-step ends, so it covers everything the loop
does (data, forward, backward, clip, optimizer, logging), in wall time and in the
child's CPU time (steadier when other jobs share the cores); the median over a run's
intervals is its figure. Rounds alternate the order of the configurations, and the
tables report the median over rounds. Tokens/s is the mean real (unpadded) tokens of
a step in the chosen-then-rejected layout (the prompt counted twice, for every
configuration alike) over the median wall step time; every run covers the same pairs
exactly once. The mean prompt and response lengths are printed with the table: the
prompt's share of them is what the shared layout saves. So are the positions each side's
decoder computes a step: TRL's two rows per pair, padded to the step's longest (as its
collator pads; the mean over consecutive groups of pairs, as either trainer shuffles its
own order), against align's stream of real tokens. Their ratio is what the step-time
ratio would be if a step cost only its positions.

Run: .venv/bin/python benchmarks/trainer_vs_trl.py  [--steps 12] [--rounds 3] [--threads 1]
     [--activation-checkpointing] [--configs align align_bf16 ...] [--workloads shots varied]
     [--json FILE]
(needs the 'bench' extra; about half an hour on two cores for both workloads)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHOTS_LEN = 256
VARIED_PROMPT = (200, 500)
VARIED_RESPONSE = (20, 300)
WORKLOADS = ("shots", "varied")
PAIRS_PER_STEP = 4
LR = 1e-5
BETAS = (0.9, 0.95)
BETA = 0.1
GRAD_CLIP = 1.0
VOCAB = 384
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": VARIED_PROMPT[1] + VARIED_RESPONSE[1] + 1,
}
CONFIGS = (
    "align",
    "align_shared",
    "align_packed",
    "align_bf16",
    "align_shared_bf16",
    "trl_precomp",
    "trl_bf16",
    "trl_live",
)
# Each align configuration's batch.layout; a *_bf16 one computes in bfloat16.
ALIGN_LAYOUTS = {
    "align": "padded",
    "align_shared": "shared",
    "align_packed": "packed",
    "align_bf16": "padded",
    "align_shared_bf16": "shared",
}
ALIGN_CONFIGS = tuple(ALIGN_LAYOUTS)
# align's best layout over TRL with the reference precomputed, at most, on every workload.
TARGETS = {"median_step_s": 0.45, "peak_rss_mb": 0.7}
# The TRL configuration align's configurations of each arithmetic are held against.
TRL_BASELINE = {"float32": "trl_precomp", "bfloat16": "trl_bf16"}
RATIOS = ("median_step_s", "median_step_cpu_s", "peak_rss_mb")


# --- shared inputs ---------------------------------------------------------------------


def shot_pairs(rows: list[dict], n_pairs: int, encode, bos: int, eos: int) -> list:
    """Each question after as many earlier solved questions as fit SHOTS_LEN."""
    from align.data.tokenize import TokenizedPair

    pairs = []
    for index in range(n_pairs):
        row = rows[index]
        chosen, rejected = [*encode(row["chosen"]), eos], [*encode(row["rejected"]), eos]
        question = encode(f"Question: {row['input']}\nAnswer: ")
        room = SHOTS_LEN - 1 - len(question) - max(len(chosen), len(rejected))
        shots: list[int] = []
        for earlier in rows[n_pairs + 3 * index :]:  # solved examples, never a benchmark pair
            shot = encode(f"Question: {earlier['input']}\nAnswer: {earlier['chosen']}\n\n")
            if len(shots) + len(shot) > room:
                break
            shots += shot
        pairs.append(TokenizedPair([bos, *shots, *question], chosen, rejected, truncated=False))
    return pairs


def varied_pairs(rows: list[dict], n_pairs: int, encode, bos: int, eos: int) -> list:
    """Prompts and responses of drawn lengths, cut in turn from the rows' running text."""
    from align.data.tokenize import TokenizedPair

    text = [t for row in rows for t in encode(f"{row['input']} {row['chosen']} {row['rejected']} ")]
    rng = np.random.default_rng(0)
    cursor = 0

    def cut(length: int) -> list[int]:
        nonlocal cursor
        piece = [text[(cursor + i) % len(text)] for i in range(length)]
        cursor += length
        return piece

    def response_length() -> int:
        low, high = np.log(VARIED_RESPONSE)
        return int(np.exp(rng.uniform(low, high)))

    pairs = []
    for _ in range(n_pairs):
        prompt = cut(int(rng.integers(*VARIED_PROMPT)) - 1)
        chosen, rejected = cut(response_length()), cut(response_length())
        pairs.append(
            TokenizedPair([bos, *prompt], [*chosen, eos], [*rejected, eos], truncated=False)
        )
    return pairs


PAIR_MAKERS = {"shots": shot_pairs, "varied": varied_pairs}


def prepare(work: Path, n_pairs: int, workload: str) -> dict[str, float]:
    """Data, tokenizer, base checkpoint and the pair shard; returns mean real tokens per step
    (both layouts) and mean prompt / chosen / rejected lengths."""
    from tokenizers import Tokenizer

    from align.data.shards import PAIR_FORMAT, pair_arrays, write_shard
    from align.data.synthetic import default_texts, write_default_data
    from align.model.tiny import make_tiny_model
    from align.model.tokenizer import BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, train_bpe_tokenizer

    files = write_default_data(
        work / "data", seed=0, n_argilla=5 * n_pairs + 20, n_steppairs=1, n_sft=1
    )
    train_bpe_tokenizer(default_texts(list(files.values())), VOCAB, work / "tokenizer")
    make_tiny_model(work / "base", work / "tokenizer", seed=0, **MODEL)
    tokenizer = Tokenizer.from_file(str(work / "tokenizer" / "tokenizer.json"))
    bos, eos, pad = (tokenizer.token_to_id(t) for t in (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    rows = [json.loads(line) for line in files["argilla"].read_text().splitlines()]
    pairs = PAIR_MAKERS[workload](rows, n_pairs, encode, bos, eos)
    write_shard(work / "pairs.safetensors", pair_arrays(range(n_pairs), pairs, pad), PAIR_FORMAT)
    (work / "pairs.json").write_text(
        json.dumps(
            [
                {"prompt_ids": p.prompt, "chosen_ids": p.chosen, "rejected_ids": p.rejected}
                for p in pairs
            ]
        )
    )
    prompt, chosen, rejected = (
        float(np.mean([len(getattr(p, part)) for p in pairs]))
        for part in ("prompt", "chosen", "rejected")
    )
    longest = [
        max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in step)
        for step in zip(*[iter(pairs)] * PAIRS_PER_STEP, strict=True)
    ]
    return {
        "tokens_per_step": (2 * prompt + chosen + rejected) * PAIRS_PER_STEP,
        "shared_tokens_per_step": (prompt + chosen + rejected) * PAIRS_PER_STEP,
        "trl_positions_per_step": 2 * PAIRS_PER_STEP * float(np.mean(longest)),
        "mean_prompt": prompt,
        "mean_chosen": chosen,
        "mean_rejected": rejected,
    }


# --- the children ----------------------------------------------------------------------


def _clocks() -> tuple[float, float]:
    """Wall time and this process's CPU time: the second is steadier when jobs share cores."""
    return time.perf_counter(), time.process_time()


def run_align(
    work: Path, steps: int, activation_checkpointing: bool, layout: str, dtype: str
) -> list[tuple[float, float]]:
    import torch

    from align.config import BatchConfig, ModelConfig, OptimizerConfig, RunConfig, TrainerConfig
    from align.data.loader import PairShard
    from align.eval.logprobs import sequence_logps
    from align.losses.dpo import DPOObjective
    from align.train.adapters import DpoAdapter
    from align.train.session import build_trainer, load_policy, start_session

    batch = BatchConfig(
        micro_batch=PAIRS_PER_STEP,
        global_batch=PAIRS_PER_STEP,
        grad_accum=1,
        epochs=1,
        layout=layout,
    )
    run_dir = work / "align-run"
    trainer_cfg = TrainerConfig(activation_checkpointing=activation_checkpointing)
    info = start_session(run_dir, RunConfig(), batch)
    model = load_policy(
        work / "base", ModelConfig(dtype=dtype, attn_implementation="sdpa"), info, trainer_cfg
    )
    shard = PairShard(work / "pairs.safetensors", layout)
    # The trainer, and with it the optimizer, comes before the reference forward: a
    # no_grad forward leaves the FSDP root's parameters gathered, plain tensors an optimizer
    # built after it would hold instead of the shards, so embed, norm and lm_head would
    # never train. The reference log-probs fill these tensors in place below.
    chosen, rejected = torch.zeros(len(shard)), torch.zeros(len(shard))
    trainer = build_trainer(
        model,
        shard,
        DpoAdapter(DPOObjective(beta=BETA), chosen, rejected),
        optim=OptimizerConfig(lr=LR, betas=list(BETAS), grad_clip=GRAD_CLIP),
        batch=batch,
        trainer=trainer_cfg,
        run_dir=run_dir,
        stage="dpo",
        info=info,
        stage_started=time.monotonic(),
    )
    with torch.no_grad():  # the reference cache: the policy at step 0
        model.eval()
        for rows in np.array_split(np.arange(len(shard)), len(shard) // PAIRS_PER_STEP):
            logps = sequence_logps(model, shard.collate(rows))
            chosen[rows], rejected[rows] = logps[: len(rows)], logps[len(rows) :]
    ends: list[tuple[float, float]] = []
    trainer.fit(on_step=lambda metrics: ends.append(_clocks()))
    if len(ends) != steps:
        raise RuntimeError(f"align ran {len(ends)} steps, expected {steps}")
    return ends


def arithmetic(config: str) -> str:
    """What a configuration computes in: its name ends in _bf16 for bfloat16."""
    return "bfloat16" if config.endswith("_bf16") else "float32"


def run_trl(
    work: Path, steps: int, live_reference: bool, activation_checkpointing: bool, bf16: bool
) -> list[tuple[float, float]]:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    class PretokenizedDPOTrainer(DPOTrainer):
        """Takes prompt_ids / chosen_ids / rejected_ids as they are: the same ids align trains on."""

        def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
            return dataset

    ends: list[tuple[float, float]] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(_clocks())

    def load():
        return AutoModelForCausalLM.from_pretrained(
            work / "base", dtype=torch.float32, attn_implementation="sdpa"
        )

    args = DPOConfig(
        output_dir=str(work / "trl-run"),
        per_device_train_batch_size=PAIRS_PER_STEP,
        gradient_accumulation_steps=1,
        max_steps=steps,
        learning_rate=LR,
        lr_scheduler_type="cosine",
        optim="adamw_torch",
        adam_beta1=BETAS[0],
        adam_beta2=BETAS[1],
        weight_decay=0.0,
        max_grad_norm=GRAD_CLIP,
        beta=BETA,
        loss_type=["sigmoid"],
        max_length=None,
        # TRL's own defaults are bf16 autocast and gradient checkpointing; each is set as
        # its align counterpart runs, so both sides compute the same arithmetic.
        bf16=bf16,
        gradient_checkpointing=activation_checkpointing,
        precompute_ref_log_probs=not live_reference,
        precompute_ref_batch_size=PAIRS_PER_STEP,
        logging_steps=steps,  # one log line: TRL's logging costs it nothing per step
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = PretokenizedDPOTrainer(
        model=load(),
        ref_model=load() if live_reference else None,
        args=args,
        train_dataset=Dataset.from_list(json.loads((work / "pairs.json").read_text())),
        processing_class=PreTrainedTokenizerFast.from_pretrained(work / "base"),
        callbacks=[StepEnds()],
    )
    trainer.train()
    if len(ends) != steps:
        raise RuntimeError(f"TRL ran {len(ends)} steps, expected {steps}")
    return ends


def child(config: str, work: Path, args: argparse.Namespace) -> None:
    if config in ALIGN_CONFIGS:  # as align's stages set up a rank, before torch is imported
        from align.config import RunConfig
        from align.utils.guard import configure_cpu

        configure_cpu(RunConfig(threads=args.threads))
    import torch

    torch.set_num_threads(args.threads)
    checkpointing = args.activation_checkpointing
    dtype = arithmetic(config)
    if config in ALIGN_CONFIGS:
        ends = run_align(work, args.steps, checkpointing, ALIGN_LAYOUTS[config], dtype)
    else:
        ends = run_trl(work, args.steps, config == "trl_live", checkpointing, dtype == "bfloat16")
    wall, cpu = np.diff(np.array(ends), axis=0).T
    print(json.dumps({"wall": wall.tolist(), "cpu": cpu.tolist()}))


# --- the parent ------------------------------------------------------------------------


def measure(config: str, work: Path, args: argparse.Namespace) -> dict:
    """One configuration in a fresh process: its step intervals and its own peak RSS."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{config}-", dir=work))
    for name in ("pairs.safetensors", "pairs.json", "base"):
        (run_dir / name).symlink_to(work / name)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(run_dir / "hf-datasets"),
        "TQDM_DISABLE": "1",
    }
    cmd = [sys.executable, __file__, "--child", config, "--work", str(run_dir)]
    cmd += ["--steps", str(args.steps), "--threads", str(args.threads)]
    if args.activation_checkpointing:
        cmd.append("--activation-checkpointing")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{config} exited {proc.returncode}:\n{err.read()[-4000:]}")
        intervals = json.loads(out.read().strip().splitlines()[-1])
    return {
        "median_step_s": statistics.median(intervals["wall"]),
        "median_step_cpu_s": statistics.median(intervals["cpu"]),
        "peak_rss_mb": usage.ru_maxrss / 1024,
    }


def report(
    results: dict[str, list[dict]], data: dict[str, float], args: argparse.Namespace
) -> dict:
    tokens_per_step = data["tokens_per_step"]
    summary = {}
    for config, runs in results.items():
        step = statistics.median(r["median_step_s"] for r in runs)
        summary[config] = {
            "median_step_s": step,
            "median_step_cpu_s": statistics.median(r["median_step_cpu_s"] for r in runs),
            "tokens_per_s": tokens_per_step / step,
            "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in runs),
            "rounds": [
                [
                    round(r["median_step_s"], 3),
                    round(r["median_step_cpu_s"], 3),
                    round(r["peak_rss_mb"]),
                ]
                for r in runs
            ],
        }
    checkpointing = "on" if args.activation_checkpointing else "off"
    print(
        f"\n{args.steps} steps, {args.threads} thread(s), activation checkpointing {checkpointing}, "
        f"{tokens_per_step:.0f} real tokens per step ({data['shared_tokens_per_step']:.0f} "
        "in the shared layout)"
    )
    print(
        f"mean lengths: prompt {data['mean_prompt']:.1f}, chosen response "
        f"{data['mean_chosen']:.1f}, rejected response {data['mean_rejected']:.1f} tokens"
    )
    trl_positions, stream = data["trl_positions_per_step"], data["shared_tokens_per_step"]
    print(
        f"decoder positions a step: TRL {trl_positions:.0f} (two rows a pair, padded), "
        f"align's stream {stream:.0f}: {stream / trl_positions:.2f}x"
    )
    print(
        f"{'config':<17} {'step s':>7} {'cpu s':>7} {'tokens/s':>9} {'peak RSS MiB':>13}"
        "  rounds [step s, cpu s, MiB]"
    )
    for config, row in summary.items():
        print(
            f"{config:<17} {row['median_step_s']:7.3f} {row['median_step_cpu_s']:7.3f} "
            f"{row['tokens_per_s']:9.0f} {row['peak_rss_mb']:13.0f}  {row['rounds']}"
        )
    pairs = [(mine, TRL_BASELINE[arithmetic(mine)]) for mine in ALIGN_CONFIGS]
    pairs += [(mine, "trl_live") for mine in ALIGN_CONFIGS if arithmetic(mine) == "float32"]
    layouts = [(mine, "align") for mine in ALIGN_CONFIGS if mine != "align"]
    for mine, other in [*pairs, *layouts]:
        if mine not in summary or other not in summary:
            continue
        ratios = {key: summary[mine][key] / summary[other][key] for key in RATIOS}
        print(
            f"{mine:<17} / {other:<12} step time {ratios['median_step_s']:.2f}x "
            f"(cpu {ratios['median_step_cpu_s']:.2f}x)   peak RSS {ratios['peak_rss_mb']:.2f}x"
        )
    for dtype, other in TRL_BASELINE.items():
        measured = [c for c in ALIGN_CONFIGS if c in summary and arithmetic(c) == dtype]
        if other not in summary or not measured:
            continue
        best = min(measured, key=lambda config: summary[config]["median_step_s"])
        for key, limit in TARGETS.items():
            ratio = summary[best][key] / summary[other][key]
            print(
                f"target best layout ({best}) / {other} {key} <= {limit}x: {ratio:.2f}x "
                f"{'met' if ratio <= limit else 'MISSED'}"
            )
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="checkpoint every layer, on both"
    )
    parser.add_argument("--json", type=Path, help="also write the summary here")
    parser.add_argument(
        "--configs",
        nargs="+",
        choices=CONFIGS,
        default=list(CONFIGS),
        help="which configurations to run (align ones need no 'bench' extra)",
    )
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3 (the median needs step intervals)")
    if args.child:
        child(args.child, args.work, args)
        return
    summaries = {workload: run_workload(workload, args) for workload in args.workloads}
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=2) + "\n")


def run_workload(workload: str, args: argparse.Namespace) -> dict:
    """Every configuration on one workload, round after round; its summary."""
    with tempfile.TemporaryDirectory(prefix=f"trainer-vs-trl-{workload}-") as tmp:
        work = Path(tmp)
        data = prepare(work, args.steps * PAIRS_PER_STEP, workload)
        configs = tuple(args.configs)
        results: dict[str, list[dict]] = {config: [] for config in configs}
        for round_index in range(args.rounds):
            # Alternate the order, so drift in the machine's load spreads over all of them.
            order = configs if round_index % 2 == 0 else configs[::-1]
            for config in order:
                results[config].append(measure(config, work, args))
                print(
                    f"{workload} round {round_index + 1} {config}: {results[config][-1]}",
                    file=sys.stderr,
                )
        print(f"\n== workload {workload}")
        return report(results, data, args)


if __name__ == "__main__":
    main()
