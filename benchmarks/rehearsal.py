"""The inputs of the scale rehearsal: the whole chain at two model sizes on this machine's CPUs.

Owns everything under `--out` (default `rehearsal/`) but `<size>/results/`, which the
workflow writes from config/rehearsal/<size>.yaml:

  tokenizer/      Mistral v0.3's own sentencepiece model (32,768 tokens, [INST] and [/INST]
                  control tokens) from the mistral-common wheel, converted to tokenizer.json
                  by tests/hub_checkpoint.py's `write_mistral_tokenizer`, with Mistral's
                  v3 instruct template (which refuses a system turn)
  <size>/base/    a random-initialised MistralForCausalLM saved by transformers'
                  save_pretrained in bfloat16 (what a hub download of Mistral-7B holds) as
                  several shards plus the index, with GQA, a sliding window shorter than the
                  arms' seq_len and that tokenizer; sizes in SIZES
  data/           seeded, generated rows in the public schemas the arms read (Parquet, as
                  the production run's downloads): argilla (distilabel-intel-orca-dpo-pairs
                  columns), steppairs (Math-Step-DPO-10K columns) and SFT prompt/response
                  rows, with realistic lengths: prompts of hundreds of tokens, responses from
                  tens to several hundred, so some rows reach the seq_len of 1024 and are cut,
                  and small shares of rows that the pre-registered filters remove

Each directory carries `spec.json`, the spec it was written from; a directory whose spec
matches is left as it is (so the workflow sees unchanged inputs and reruns nothing),
anything else is written in a temporary directory beside it and renamed into place. The
script prints each model's exact parameter count and the token-length quantiles of the
data under the real tokenizer.

Run: .venv/bin/python benchmarks/rehearsal.py --out rehearsal [--sizes 60m 250m]
(`make rehearsal` runs it, then the chain at each size, then benchmarks/projections.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The hub-shaped tokenizer writer the hub checkpoint tests use, so both convert alike.
sys.path.insert(0, str(ROOT / "tests"))

from hub_checkpoint import (  # noqa: E402
    MISTRAL_INSTRUCT_V3_TEMPLATE,
    SENTENCEPIECE_V3,
    write_mistral_tokenizer,
)

# Bump when what a spec describes is written differently, so old outputs are rebuilt.
GENERATOR_VERSION = 1
SPEC_FILE = "spec.json"
SEED = 0

# Mistral v0.3's shape conventions, scaled down: GQA (4 query heads per key/value head),
# head_dim 64, untied lm_head, rope_theta 1e6, its 32,768 positions; a sliding window
# shorter than the arms' seq_len (1024), so the windowed mask is exercised.
COMMON_MODEL = {
    "vocab_size": 32768,
    "head_dim": 64,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "rope_theta": 1e6,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SIZES: dict[str, dict[str, Any]] = {
    "60m": {
        "hidden_size": 512,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "intermediate_size": 1536,
        # bfloat16 is 115 MB: three shards.
        "max_shard_size": "50MB",
    },
    "250m": {
        "hidden_size": 1024,
        "num_hidden_layers": 14,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "intermediate_size": 3584,
        # bfloat16 is 516 MB: six shards.
        "max_shard_size": "100MB",
    },
}
# What Mistral-7B's hub checkpoint stores; every stage casts it to its pre-registered dtype.
STORED_DTYPE = "bfloat16"

# Rows of each dataset, sized by the step time on this machine's 2 cores (2 ranks of one
# thread, seq_len 1024, activation checkpointing): a DPO micro-step of one pair of about
# 550 tokens per rank takes about 6 s at 60m and 28 s at 250m, and every stage around the
# training (reference caches, evaluation, greedy generations) scales alike.
# Each arm keeps 16 to 18 pairs and holds 4 or 5 of them out, which leaves 6 micro-steps
# per rank in the arms' one epoch; SFT gets 19 rows to train on, 4 micro-steps of two rows
# per rank, and holds out 8 (a whole evaluation batch and the gate's generation prompts).
# Both sizes' chains (SFT, two arms, selection) then run in about 47 minutes (8 + 39).
ROWS = {"argilla": 21, "steppairs": 19, "sft": 27}
SEQ_LEN = 1024
DATA_FILES = {
    "argilla": "distilabel-intel-orca-dpo-pairs.parquet",
    "steppairs": "Math-Step-DPO-10K.parquet",
    "sft": "ultrachat_200k-sft.parquet",
}


# --- idempotent, atomic directories --------------------------------------------------------


def spec_digest(spec: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def written_with(directory: Path, spec: dict[str, Any]) -> bool:
    """Whether `directory` holds a finished write of exactly `spec`."""
    path = directory / SPEC_FILE
    try:
        return json.loads(path.read_text())["digest"] == spec_digest(spec)
    except (OSError, ValueError, KeyError):
        return False


@contextmanager
def atomic_directory(directory: Path, spec: dict[str, Any]) -> Iterator[Path]:
    """A temporary directory beside `directory`, renamed into its place (spec.json last
    inside it) when the block ends without an error; removed otherwise."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        yield staging
        _readable(staging)
        payload = {"digest": spec_digest(spec), "spec": spec}
        (staging / SPEC_FILE).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        old = None
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old.", dir=directory.parent))
            os.replace(directory, old / directory.name)
        os.replace(staging, directory)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _readable(directory: Path) -> None:
    """The modes a download has (mkdtemp and some writers make files private)."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)


def ensure(directory: Path, spec: dict[str, Any], write: Callable[[Path], None]) -> bool:
    """Write `directory` from `spec` unless it already holds it; True when written."""
    if written_with(directory, spec):
        print(f"{directory}: up to date")
        return False
    with atomic_directory(directory, spec) as staging:
        write(staging)
    print(f"{directory}: written")
    return True


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- tokenizer and models ------------------------------------------------------------------


def tokenizer_spec() -> dict[str, Any]:
    from hub_checkpoint import mistral_sentencepiece_model

    return {
        "what": "tokenizer",
        "version": GENERATOR_VERSION,
        "sentencepiece": SENTENCEPIECE_V3,
        "sentencepiece_sha256": file_digest(mistral_sentencepiece_model(SENTENCEPIECE_V3)),
        "chat_template": MISTRAL_INSTRUCT_V3_TEMPLATE,
    }


def write_tokenizer(out: Path) -> None:
    write_mistral_tokenizer(out, model=SENTENCEPIECE_V3, chat_template=MISTRAL_INSTRUCT_V3_TEMPLATE)


def model_spec(size: str, tokenizer_dir: Path) -> dict[str, Any]:
    return {
        "what": "base model",
        "version": GENERATOR_VERSION,
        "size": size,
        "config": {**COMMON_MODEL, **SIZES[size]},
        "stored_dtype": STORED_DTYPE,
        "seed": SEED,
        "tokenizer": json.loads((tokenizer_dir / SPEC_FILE).read_text())["digest"],
    }


def write_model(out: Path, size: str, tokenizer_dir: Path) -> None:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    sizes = dict(SIZES[size])
    max_shard_size = sizes.pop("max_shard_size")
    config = MistralConfig(**COMMON_MODEL, **sizes)
    torch.manual_seed(SEED)
    model = MistralForCausalLM(config).to(getattr(torch, STORED_DTYPE))
    model.save_pretrained(out, max_shard_size=max_shard_size)
    for source in tokenizer_dir.iterdir():
        if source.name != SPEC_FILE:
            shutil.copyfile(source, out / source.name)


def parameter_count(size: str) -> int:
    """Exact parameters of the Mistral of `size` (embedding and lm_head untied)."""
    c = {**COMMON_MODEL, **SIZES[size]}
    hidden, head_dim = c["hidden_size"], c["head_dim"]
    attention = hidden * head_dim * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"])
    layer = attention + 3 * hidden * c["intermediate_size"] + 2 * hidden
    return c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * hidden + hidden


def stored_parameters(directory: Path) -> tuple[int, int]:
    """(parameters, shards) of a saved checkpoint, read from its safetensors headers."""
    from align.utils.weights_hash import checkpoint_tensors

    tensors = checkpoint_tensors(directory)
    count = sum(math.prod(location.shape) for location in tensors.values())
    return count, len({location.path for location in tensors.values()})


# --- English-like text ---------------------------------------------------------------------

# Common English words, drawn with Zipf-like weights (earlier words more often), so the
# sentencepiece tokenizer splits the text as it splits ordinary prose.
_WORD_LIST = """
the of and to a in is that for it as was with be by on not he this are or his from at which
but have an they you were her she there one all we their can has been if more when will
would who so no them other some time these two may then do first any my now such like our
over man me even most made after also did many before must through back years where much
your way well down should because each just those people how too little state good very
make world still own see men work long get here between both life being under never day
same another know while last might us great old year off come since against go came right
used take three states himself few house use during without again place american around
however home small found thought went say part once general high upon school every does
got united left number course war until always away something fact though water less
public put think almost hand enough far took head yet government system better set told
nothing night end why called find going look asked later knew point next program city
business give group toward young days let room president side social given present
several order national possible rather second face per among form important often things
looked early white case john become large big need four within felt along children saw
best church ever least power development light thing seemed family interest want members
mind country area others done turned although open god service certain kind problem began
different door thus help sense means whole matter perhaps itself york times law human
line above name example action company hands local show whether five history gave today
either act feet across taken past quite anything seen having death week experience body
word half really field am car words already themselves information tell college shall
money period held keep sure free seems political real behind cannot miss question air
office making brought whose special heard major problems ago became federal moment study
available known result street economic boy position reason change south board individual
job areas society west close turn love community true court force full seem wife future
age wanted department voice center woman control common necessary following front
sometimes six girl clear further land run students provide feel party able mother music
education university child effect level stood military town short morning total outside
rate figure class art century washington north usually plan leave therefore evidence too
million sound top black strong hard various says believe type value play surface soon
mean near lines table peace modern tax road red book personal process situation minutes
increase idea english alone women gone nor food cost material amount report energy
analysis measure answer method distance equation solve value function number series
"""
WORDS = tuple(_WORD_LIST.split())
CONNECTIVES = ("however", "therefore", "for example", "in addition", "as a result", "then")


class Prose:
    """Seeded sentences of WORDS; lengths in words."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.weights = [1.0 / (rank + 10) for rank in range(len(WORDS))]

    def words(self, n: int) -> list[str]:
        return self.rng.choices(WORDS, weights=self.weights, k=n)

    def sentence(self, n: int | None = None) -> str:
        n = n or self.rng.randint(6, 22)
        words = self.words(n)
        if n > 10 and self.rng.random() < 0.3:
            words.insert(n // 2, f"{self.rng.choice(CONNECTIVES)},")
        if self.rng.random() < 0.15:
            words.insert(self.rng.randrange(len(words)), str(self.rng.randint(2, 2024)))
        text = " ".join(words)
        return text[0].upper() + text[1:] + self.rng.choice(".....?!")

    def text(self, n_words: int) -> str:
        """About `n_words` words in sentences and paragraphs."""
        sentences, count = [], 0
        while count < n_words:
            sentence = self.sentence(min(self.rng.randint(6, 22), max(3, n_words - count)))
            sentences.append(sentence)
            count += len(sentence.split())
        paragraphs, i = [], 0
        while i < len(sentences):
            step = self.rng.randint(3, 6)
            paragraphs.append(" ".join(sentences[i : i + step]))
            i += step
        return "\n\n".join(paragraphs)


def lognormal_words(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, rng.lognormvariate(math.log(median), sigma))))


# Exact shares of rows that run long, so the build's cuts are seen at every size of the
# data: a prompt of 480 to 640 words (about 580 to 780 tokens, past max_prompt_tokens = 512,
# removed as prompt_over_budget), or one response of 650 to 900 words (about 870 to 1,200
# tokens), which with its prompt passes seq_len = 1024 and is cut.
LONG_SHARES = {"long_prompt": 0.06, "long_response": 0.08}


def long_prompt_words(rng: random.Random) -> int:
    return rng.randint(480, 640)


def response_words(rng: random.Random, median: float, long: bool = False) -> int:
    """Tens to a few hundred words; 650 to 900 for a long one."""
    return rng.randint(650, 900) if long else lognormal_words(rng, median, 0.8, 8, 450)


def row_kinds(rng: random.Random, n: int, shares: dict[str, float]) -> list[str]:
    """Each kind's exact share of n rows (at least one each), the rest "clean", shuffled."""
    counts = {kind: max(1, round(n * share)) for kind, share in shares.items()}
    kinds = [kind for kind, count in counts.items() for _ in range(count)]
    kinds += ["clean"] * (n - len(kinds))
    rng.shuffle(kinds)
    return kinds


# --- argilla -------------------------------------------------------------------------------

# ORCA's system prompts are a small fixed set of instructions like these; many rows have none.
SYSTEM_PROMPTS = (
    "",
    "",
    "You are an AI assistant. You will be given a task. You must generate a detailed and "
    "long answer.",
    "You are a helpful assistant, who always provide explanation. Think like you are "
    "answering to a five year old.",
    "You are an AI assistant that follows instruction extremely well. Help as much as you can.",
    "You are an AI assistant. User will you give you a task. Your goal is to complete the "
    "task as faithfully as you can. While performing the task think step-by-step and "
    "justify your steps.",
    "You should describe the task and explain your answer. While answering a multiple "
    "choice question, first output the correct answer(s). Then explain why other answers "
    "are wrong. Think like you are answering to a five year old.",
    "Explain how you used the definition to come up with the answer.",
    "You are a teacher. Given a task, you explain in simple steps what the task is asking, "
    "any guidelines it provides and how to use those guidelines to find the answer.",
)
LABELLING_MODEL = "gpt-4-0613"
JUDGE_SYSTEM = "You are a helpful and precise assistant for checking the quality of the answer."
JUDGE_INSTRUCTION = (
    "Please rate the helpfulness, relevance and accuracy of the two answers. Each assistant "
    "receives a score from 1 to 10. Output the two scores on the first line, then explain."
)
# Shares of rows the arm's filters remove (ties, chosen rated under 8, GSM8K prompts), of
# rows whose preference was swapped by the relabelling (kept), and of exact duplicates.
ARGILLA_SHARES = {"tie": 0.04, "low_score": 0.03, "gsm8k": 0.02, "swapped": 0.1, "duplicate": 0.01}


def argilla_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    prose = Prose(rng)
    rows: list[dict[str, Any]] = []
    clean: list[dict[str, Any]] = []
    for kind in row_kinds(rng, n, {**ARGILLA_SHARES, **LONG_SHARES}):
        if kind == "duplicate" and clean:
            # A copy of a kept row, so the build counts it as a duplicate pair.
            rows.append(dict(rng.choice(clean)))
            continue
        rows.append(_argilla_row(rng, prose, kind))
        if kind == "clean":
            clean.append(rows[-1])
    return rows


def _argilla_row(rng: random.Random, prose: Prose, kind: str) -> dict[str, Any]:
    # A passage and a question about it: 30 to 320 words, or a long one.
    long_prompt = kind == "long_prompt"
    words = long_prompt_words(rng) if long_prompt else lognormal_words(rng, 140, 0.55, 30, 320)
    question = f"{prose.text(words)}\n\n{prose.sentence()[:-1]}?"
    long_chosen = kind == "long_response" and rng.random() < 0.5
    long_rejected = kind == "long_response" and not long_chosen
    chosen = prose.text(response_words(rng, 100, long_chosen))
    rejected = prose.text(response_words(rng, 80, long_rejected))
    if kind == "tie":
        right_score = wrong_score = float(rng.randint(8, 10))
    elif kind == "low_score":
        right_score, wrong_score = float(rng.randint(5, 7)), float(rng.randint(1, 4))
    else:
        right_score, wrong_score = float(rng.randint(8, 10)), float(rng.randint(1, 6))
    original = (rejected, chosen) if kind == "swapped" else (chosen, rejected)
    order = ["chosen", "rejected"] if rng.random() < 0.5 else ["rejected", "chosen"]
    by_name = {"chosen": original[0], "rejected": original[1]}
    generations = [by_name[name] for name in order]
    score_of = {chosen: right_score, rejected: wrong_score}
    rating = [score_of[text] for text in generations]
    rationale = prose.text(rng.randint(25, 70))
    judge = "\n\n".join(
        f"[The Start of Assistant {i}'s Answer]\n{text}\n[The End of Assistant {i}'s Answer]"
        for i, text in enumerate(generations, start=1)
    )
    return {
        "system": rng.choice(SYSTEM_PROMPTS),
        "input": question,
        "chosen": chosen,
        "rejected": rejected,
        "generations": generations,
        "order": order,
        "labelling_model": LABELLING_MODEL,
        "labelling_prompt": [
            {"role": "system", "content": JUDGE_SYSTEM},
            {
                "role": "user",
                "content": f"[Question]\n{question}\n\n{judge}\n\n[System]\n{JUDGE_INSTRUCTION}",
            },
        ],
        "raw_labelling_response": f"{rating[0]:g} {rating[1]:g}\n{rationale}",
        "rating": rating,
        "rationale": rationale,
        "status": {"tie": "tie", "swapped": "swapped"}.get(kind, "unchanged"),
        "original_chosen": original[0],
        "original_rejected": original[1],
        "chosen_score": right_score,
        "in_gsm8k_train": kind == "gsm8k",
    }


# --- steppairs -----------------------------------------------------------------------------


def steppairs_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    prose = Prose(rng)
    return [_steppairs_row(rng, prose, kind) for kind in row_kinds(rng, n, LONG_SHARES)]


def _step(prose: Prose, rng: random.Random, number: int, words: int) -> str:
    body = prose.text(words).replace("\n\n", " ")
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return f"Step {number}: {body} So {a} + {b} = {a + b}."


def _response_steps(prose: Prose, rng: random.Random, prefix: int, long: bool) -> str:
    """One to three further steps; the last is a response's length."""
    count = rng.choice((1, 1, 2, 3))
    words = [lognormal_words(rng, 40, 0.5, 8, 120) for _ in range(count - 1)]
    words.append(response_words(rng, 60, long))
    return "\n".join(_step(prose, rng, prefix + 1 + k, n) for k, n in enumerate(words))


def _steppairs_row(rng: random.Random, prose: Prose, kind: str) -> dict[str, Any]:
    # A problem of 25 to 200 words (or a long one) and zero to five shared steps.
    long_prompt = kind == "long_prompt"
    words = long_prompt_words(rng) if long_prompt else lognormal_words(rng, 100, 0.6, 25, 200)
    problem = prose.text(words)
    prefix = rng.choice((0, 1, 1, 2, 2, 3, 4, 5))
    initial = "".join(
        _step(prose, rng, k, lognormal_words(rng, 35, 0.5, 8, 60)) + "\n"
        for k in range(1, prefix + 1)
    )
    answer = str(rng.randint(1, 999))
    long_chosen = kind == "long_response" and rng.random() < 0.5
    chosen = _response_steps(prose, rng, prefix, long_chosen)
    rejected = _response_steps(prose, rng, prefix, kind == "long_response" and not long_chosen)
    chosen += f"\nThe answer is: {answer}"
    rejected += f"\nThe answer is: {int(answer) + rng.choice((-3, -2, -1, 1, 2, 3))}"
    return {
        "dataset": "MATH",
        "prompt": problem,
        "initial_reason_steps": initial,
        "chosen": chosen,
        "rejected": rejected,
        "full_chosen": initial + chosen,
        "full_rejected": initial + rejected,
        "answer": answer,
    }


# --- sft -----------------------------------------------------------------------------------


def sft_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    prose = Prose(rng)
    kinds = row_kinds(rng, n, {"long_response": LONG_SHARES["long_response"]})
    rows = []
    for kind in kinds:
        prompt = prose.text(lognormal_words(rng, 70, 0.7, 6, 320))
        long = kind == "long_response"
        words = response_words(rng, 0, long) if long else lognormal_words(rng, 200, 0.6, 10, 450)
        rows.append({"prompt": prompt, "response": prose.text(words)})
    return rows


MAKERS = {"argilla": argilla_rows, "steppairs": steppairs_rows, "sft": sft_rows}


def data_spec() -> dict[str, Any]:
    return {
        "what": "data",
        "version": GENERATOR_VERSION,
        "seed": SEED,
        "rows": ROWS,
        "files": DATA_FILES,
        "words": spec_digest({"words": WORDS, "system": SYSTEM_PROMPTS}),
        "shares": {**ARGILLA_SHARES, **LONG_SHARES},
    }


def write_data(out: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, maker in MAKERS.items():
        rows = maker(random.Random(f"align-rehearsal:{SEED}:{name}"), ROWS[name])
        pq.write_table(pa.Table.from_pylist(rows), out / DATA_FILES[name])


# --- report --------------------------------------------------------------------------------


def length_report(data_dir: Path, tokenizer_dir: Path) -> None:
    """Token-length quantiles of each dataset's fields under the real tokenizer, and of each
    arm's pairs as the build renders them (template, bos, eos), before any cut to seq_len."""
    import numpy as np
    import pyarrow.parquet as pq

    from align.data.formats import iter_records
    from align.data.tokenize import PromptRenderer, tokenize_pairs
    from align.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_dir)
    quantiles = (0.05, 0.25, 0.5, 0.75, 0.95, 1.0)

    def line(label: str, lengths: list[int]) -> None:
        values = np.array(lengths)
        cells = "".join(f"{int(np.quantile(values, q)):>7d}" for q in quantiles)
        print(f"  {label:<36}{values.mean():>7.0f}{cells}")

    header = "".join(f"{f'q{round(q * 100)}':>7}" for q in quantiles)
    print(f"token lengths, Mistral v0.3 tokenizer{'mean':>7}{header}")
    fields = {
        "argilla": ("system", "input", "chosen", "rejected"),
        "steppairs": ("prompt", "initial_reason_steps", "chosen", "rejected"),
        "sft": ("prompt", "response"),
    }
    for name, columns in fields.items():
        table = pq.read_table(data_dir / DATA_FILES[name], columns=list(columns)).to_pydict()
        for column in columns:
            line(f"{name} {column}", [len(ids) for ids in tokenizer.encode_batch(table[column])])
    # The arms' renderings: argilla folds its system turn into the user turn.
    for arm, merge in (("argilla", True), ("steppairs", False)):
        records = list(iter_records([data_dir / DATA_FILES[arm]], arm))
        renderer = PromptRenderer(tokenizer, merge_system_into_user=merge)
        pairs = tokenize_pairs(records, tokenizer, sys.maxsize, renderer)
        line(f"{arm} rendered prompt", [len(pair.prompt) for pair in pairs])
        longer = [len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs]
        line(f"{arm} prompt + longer response", longer)
        print(f"  {arm}: {sum(n > SEQ_LEN for n in longer)} of {len(pairs)} pairs over {SEQ_LEN}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("rehearsal"))
    parser.add_argument("--sizes", nargs="+", choices=sorted(SIZES), default=sorted(SIZES))
    parser.add_argument(
        "--lengths", action="store_true", help="print the data's token-length quantiles"
    )
    args = parser.parse_args(argv)
    out: Path = args.out
    tokenizer_dir = out / "tokenizer"
    ensure(tokenizer_dir, tokenizer_spec(), write_tokenizer)
    for size in args.sizes:
        base = out / size / "base"
        ensure(
            base,
            model_spec(size, tokenizer_dir),
            lambda d, s=size: write_model(d, s, tokenizer_dir),
        )
        count, shards = stored_parameters(base)
        if count != parameter_count(size):
            raise SystemExit(
                f"{base}: {count:,} parameters stored, {parameter_count(size):,} expected"
            )
        print(f"{size}: {count:,} parameters in {shards} {STORED_DTYPE} shards ({base})")
    data_dir = out / "data"
    if ensure(data_dir, data_spec(), write_data) or args.lengths:
        length_report(data_dir, tokenizer_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
