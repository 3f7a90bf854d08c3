"""The embedded default data: seeded single-digit arithmetic in the public raw formats.

Owns three small JSONL datasets written by `write_default_data`:

- argilla: the columns of argilla/distilabel-intel-orca-dpo-pairs, one question per row,
  the right answer chosen over a nearly right one;
- steppairs: the Step-DPO columns, two-step sums whose second step is right or off;
- sft: prompt/response rows in the same formats that never state a result, so a policy
  tuned on them is near chance on the pairs and DPO has to learn the table.

The same seed gives byte-identical files. Stdlib and align's own readers only.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from align.data.formats import iter_raw_rows
from align.receipts import atomic_path

ARGILLA_FILE = "argilla.jsonl"
STEPPAIRS_FILE = "steppairs.jsonl"
SFT_FILE = "sft.jsonl"

WRONG_OFFSETS = (-2, -1, 1, 2)
LABELLING_MODEL = "gpt-4-0613"
STEPPAIRS_DATASET = "synthetic-arith"

TIE_FRACTION = 0.08
LOW_SCORE_FRACTION = 0.08
GSM8K_FRACTION = 0.05
SWAPPED_FRACTION = 0.15
LOW_SCORE_THRESHOLD = 8.0

# Fields of any of the three formats that hold a prompt or a response.
TEXT_FIELDS = (
    "system",
    "input",
    "prompt",
    "chosen",
    "rejected",
    "initial_reason_steps",
    "full_chosen",
    "full_rejected",
    "response",
)

PEOPLE = (
    ("Tom", "he"),
    ("Anna", "she"),
    ("Sam", "he"),
    ("Mia", "she"),
    ("Ben", "he"),
    ("Lucy", "she"),
)
THINGS = (
    ("apple", "apples"),
    ("book", "books"),
    ("coin", "coins"),
    ("ball", "balls"),
    ("pen", "pens"),
    ("cup", "cups"),
)

ADD_QUESTIONS = (
    "What is {a} + {b}?",
    "Compute {a} + {b}.",
    "Calculate {a} plus {b}.",
    "What is the sum of {a} and {b}?",
    "Add {a} and {b}.",
    "How much is {a} plus {b}?",
    "{a} + {b} = ?",
    "Find the total of {a} and {b}.",
    "{name} has {a} {things_a} and gets {b} more. How many {things} does {pron} have?",
    "There are {a} {things_a} in a box. {name} puts in {b} more. How many {things} are in the box?",
    "{name} buys {a} {things_a} and then {b} more. How many {things} did {pron} buy?",
    "If you have {a} {things_a} and find {b} more, how many {things} do you have?",
)
SUB_QUESTIONS = (
    "What is {a} - {b}?",
    "Compute {a} - {b}.",
    "Calculate {a} minus {b}.",
    "Subtract {b} from {a}.",
    "What is {a} take away {b}?",
    "How much is {a} minus {b}?",
    "{a} - {b} = ?",
    "{name} has {a} {things_a} and gives away {b}. How many {things} does {pron} have left?",
    "There are {a} {things_a} on a table. {name} takes {b}. How many {things} are left?",
    "{name} had {a} {things_a} and lost {b}. How many {things} does {pron} have now?",
)
STEP_QUESTIONS = (
    "Add {a}, {b} and {c}.",
    "What is {a} + {b} + {c}?",
    "Compute {a} + {b} + {c}.",
    "Find the sum of {a}, {b} and {c}.",
    "What is the total of {a}, {b} and {c}?",
    "{a} + {b} + {c} = ?",
    "{name} has {a} {things_a}, gets {b} more, then {c} more. How many {things} does {pron} have?",
    "A box holds {a} {things_a}. {name} adds {b}, then {c}. How many {things} are in the box?",
)
ANSWERS = (
    "{a} {op} {b} = {r}. The answer is {r}.",
    "{a} {op_word} {b} is {r}. The answer is {r}.",
    "We get {a} {op} {b} = {r}. The answer is {r}.",
)
SYSTEM_PROMPTS = (
    "",
    "",
    "You are a helpful assistant.",
    "You are an AI assistant. Answer briefly.",
    "You are a math tutor. Give the final answer.",
)
OP_WORDS = {"+": "plus", "-": "minus"}

SFT_ADD_RESPONSES = (
    "We add {a} and {b}.",
    "We add {a} and {b}. The answer is their sum.",
    "This asks for {a} + {b}. The answer is the sum.",
)
SFT_SUB_RESPONSES = (
    "We subtract {b} from {a}.",
    "We take {b} away from {a}. The answer is the difference.",
    "This asks for {a} - {b}. The answer is the difference.",
)
SFT_STEP_RESPONSES = (
    "Step 1: first we add {a} and {b}.",
    "Step 1: first we add {a} and {b}.\nStep 2: then we add {c}. The answer is the total.",
)
COUNT_PROMPTS = (
    "Count from {start} to {end}.",
    "List the numbers from {start} to {end}.",
    "Count up from {start} to {end}.",
)
COPY_PROMPTS = ("Repeat: {digits}", "Copy these digits: {digits}", "Say again: {digits}")
SFT_KIND_WEIGHTS = {"add": 0.30, "sub": 0.15, "steps": 0.20, "count": 0.175, "copy": 0.175}

JUDGE_SYSTEM = "You are a helpful and precise assistant for checking the quality of the answer."
JUDGE_INSTRUCTION = (
    "Please rate the helpfulness, relevance and accuracy of the two answers. Each assistant "
    "receives a score from 1 to 10. Output the two scores on the first line, then explain."
)


@dataclass(frozen=True)
class Fact:
    """One single-digit arithmetic fact, `a op b`."""

    a: int
    b: int
    op: str

    @property
    def result(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b


ADD_FACTS = tuple(Fact(a, b, "+") for a in range(10) for b in range(10))
# a > b keeps every difference positive, so no fact sits at the floor of the wrong answers.
SUB_FACTS = tuple(Fact(a, b, "-") for a in range(10) for b in range(a))
FACTS = ADD_FACTS + SUB_FACTS


def write_default_data(
    out_dir: str | os.PathLike,
    seed: int,
    n_argilla: int = 700,
    n_steppairs: int = 700,
    n_sft: int = 1500,
) -> dict[str, Path]:
    """Write the three default datasets as JSONL into `out_dir`; return their paths by name."""
    out = Path(out_dir)
    paths = {
        "argilla": out / ARGILLA_FILE,
        "steppairs": out / STEPPAIRS_FILE,
        "sft": out / SFT_FILE,
    }
    _write_jsonl(paths["argilla"], argilla_rows(_rng(seed, "argilla"), n_argilla))
    _write_jsonl(paths["steppairs"], steppairs_rows(_rng(seed, "steppairs"), n_steppairs))
    _write_jsonl(paths["sft"], sft_rows(_rng(seed, "sft"), n_sft))
    return paths


def default_texts(
    paths: Mapping[str, str | os.PathLike] | Iterable[str | os.PathLike],
) -> Iterator[str]:
    """Every non-empty prompt or response string in the given JSONL files, in file order.

    Lines are read as the data build reads them, so none is held past the readers' bound.
    """
    files = paths.values() if isinstance(paths, Mapping) else paths
    for path in files:
        for row in iter_raw_rows(Path(path)):
            for field in TEXT_FIELDS:
                value = row.values.get(field)
                if isinstance(value, str) and value:
                    yield value


def _rng(seed: int, dataset: str) -> random.Random:
    # One stream per dataset, so resizing one dataset leaves the others byte-identical.
    return random.Random(f"align-synthetic:{seed}:{dataset}")


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    text = "".join(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n" for row in rows)
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def wrong_answer(rng: random.Random, right: int) -> int:
    """The right answer moved by a small non-zero offset, never below zero."""
    return right + rng.choice([offset for offset in WRONG_OFFSETS if right + offset >= 0])


def _story_fields(rng: random.Random, first_count: int) -> dict[str, str]:
    name, pron = rng.choice(PEOPLE)
    singular, plural = rng.choice(THINGS)
    return {
        "name": name,
        "pron": pron,
        "things": plural,
        "things_a": singular if first_count == 1 else plural,
    }


def fact_question(rng: random.Random, fact: Fact) -> str:
    template = rng.choice(ADD_QUESTIONS if fact.op == "+" else SUB_QUESTIONS)
    return template.format(a=fact.a, b=fact.b, **_story_fields(rng, fact.a))


def answer_pair(rng: random.Random, fact: Fact) -> tuple[str, str]:
    """The same answer sentence with the right result and with a wrong one."""
    template = rng.choice(ANSWERS)
    fields = {"a": fact.a, "b": fact.b, "op": fact.op, "op_word": OP_WORDS[fact.op]}
    wrong = wrong_answer(rng, fact.result)
    return template.format(r=fact.result, **fields), template.format(r=wrong, **fields)


# --- argilla -----------------------------------------------------------------------------


def argilla_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    return [_argilla_row(rng, rng.choice(FACTS), category) for category in _categories(rng, n)]


def _categories(rng: random.Random, n: int) -> list[str]:
    """Exact shares of each row kind, shuffled, so the filters downstream remove a known count."""
    shares = {
        "tie": TIE_FRACTION,
        "low_score": LOW_SCORE_FRACTION,
        "gsm8k": GSM8K_FRACTION,
        "swapped": SWAPPED_FRACTION,
    }
    categories = [kind for kind, share in shares.items() for _ in range(round(n * share))]
    categories = categories[:n] + ["clean"] * max(0, n - len(categories))
    rng.shuffle(categories)
    return categories


def _ratings(rng: random.Random, category: str) -> tuple[float, float]:
    """(rating of the right answer, rating of the wrong one) for a row kind."""
    if category == "tie":
        score = float(rng.randint(8, 10))
        return score, score
    if category == "low_score":
        return float(rng.randint(5, 7)), float(rng.randint(1, 4))
    return float(rng.randint(8, 10)), float(rng.randint(1, 4))


def _argilla_row(rng: random.Random, fact: Fact, category: str) -> dict[str, Any]:
    question = fact_question(rng, fact)
    right, wrong = answer_pair(rng, fact)
    right_rating, wrong_rating = _ratings(rng, category)
    # A swapped row is one where the original data preferred the wrong answer.
    original_chosen, original_rejected = (wrong, right) if category == "swapped" else (right, wrong)
    rating_of = {right: right_rating, wrong: wrong_rating}
    order = ["chosen", "rejected"] if rng.random() < 0.5 else ["rejected", "chosen"]
    original = {"chosen": original_chosen, "rejected": original_rejected}
    generations = [original[name] for name in order]
    rating = [rating_of[text] for text in generations]
    rationale = _rationale(generations, rating, fact)
    return {
        "system": rng.choice(SYSTEM_PROMPTS),
        "input": question,
        "chosen": right,
        "rejected": wrong,
        "generations": generations,
        "order": order,
        "labelling_model": LABELLING_MODEL,
        "labelling_prompt": _labelling_prompt(question, generations),
        "raw_labelling_response": f"{rating[0]:g} {rating[1]:g}\n{rationale}",
        "rating": rating,
        "rationale": rationale,
        "status": {"tie": "tie", "swapped": "swapped"}.get(category, "unchanged"),
        "original_chosen": original_chosen,
        "original_rejected": original_rejected,
        "chosen_score": right_rating,
        "in_gsm8k_train": category == "gsm8k",
    }


def _labelling_prompt(question: str, generations: list[str]) -> list[dict[str, str]]:
    answers = "\n\n".join(
        f"[The Start of Assistant {i}'s Answer]\n{text}\n[The End of Assistant {i}'s Answer]"
        for i, text in enumerate(generations, start=1)
    )
    user = f"[Question]\n{question}\n\n{answers}\n\n[System]\n{JUDGE_INSTRUCTION}"
    return [{"role": "system", "content": JUDGE_SYSTEM}, {"role": "user", "content": user}]


def _rationale(generations: list[str], rating: list[float], fact: Fact) -> str:
    if rating[0] == rating[1]:
        return "Both assistants give a short, direct answer in the same format."
    better = 1 if rating[0] > rating[1] else 2
    worse = 3 - better
    return (
        f"Assistant {better} correctly gives {fact.result}. "
        f"Assistant {worse} makes an arithmetic mistake, so it is less accurate."
    )


# --- steppairs ---------------------------------------------------------------------------


def steppairs_rows(rng: random.Random, n: int) -> list[dict[str, Any]]:
    return [_steppairs_row(rng) for _ in range(n)]


def _steppairs_row(rng: random.Random) -> dict[str, Any]:
    a, b, c = _step_operands(rng)
    first = a + b
    right = first + c
    wrong = wrong_answer(rng, right)
    initial = f"Step 1: {a} + {b} = {first}.\n"
    chosen = f"Step 2: {first} + {c} = {right}. The answer is {right}."
    rejected = f"Step 2: {first} + {c} = {wrong}. The answer is {wrong}."
    return {
        "dataset": STEPPAIRS_DATASET,
        "prompt": step_question(rng, a, b, c),
        "initial_reason_steps": initial,
        "chosen": chosen,
        "rejected": rejected,
        "full_chosen": initial + chosen,
        "full_rejected": initial + rejected,
        "answer": str(right),
    }


def _step_operands(rng: random.Random) -> tuple[int, int, int]:
    """a + b stays a single digit, so both steps are facts of the addition table."""
    a = rng.randint(0, 9)
    b = rng.randint(0, 9 - a)
    return a, b, rng.randint(0, 9)


def step_question(rng: random.Random, a: int, b: int, c: int) -> str:
    template = rng.choice(STEP_QUESTIONS)
    return template.format(a=a, b=b, c=c, **_story_fields(rng, a))


# --- sft ---------------------------------------------------------------------------------


def sft_rows(rng: random.Random, n: int) -> list[dict[str, str]]:
    kinds = rng.choices(list(SFT_KIND_WEIGHTS), weights=list(SFT_KIND_WEIGHTS.values()), k=n)
    return [_SFT_MAKERS[kind](rng) for kind in kinds]


def _sft_fact(
    rng: random.Random, facts: tuple[Fact, ...], responses: tuple[str, ...]
) -> dict[str, str]:
    fact = rng.choice(facts)
    response = rng.choice(responses).format(a=fact.a, b=fact.b)
    return {"prompt": fact_question(rng, fact), "response": response}


def _sft_steps(rng: random.Random) -> dict[str, str]:
    a, b, c = _step_operands(rng)
    response = rng.choice(SFT_STEP_RESPONSES).format(a=a, b=b, c=c)
    return {"prompt": step_question(rng, a, b, c), "response": response}


def _sft_count(rng: random.Random) -> dict[str, str]:
    start = rng.randint(0, 12)
    end = start + rng.randint(2, 8)
    prompt = rng.choice(COUNT_PROMPTS).format(start=start, end=end)
    return {"prompt": prompt, "response": " ".join(str(i) for i in range(start, end + 1))}


def _sft_copy(rng: random.Random) -> dict[str, str]:
    digits = " ".join(str(rng.randint(0, 9)) for _ in range(rng.randint(2, 6)))
    return {"prompt": rng.choice(COPY_PROMPTS).format(digits=digits), "response": digits}


_SFT_MAKERS = {
    "add": lambda rng: _sft_fact(rng, ADD_FACTS, SFT_ADD_RESPONSES),
    "sub": lambda rng: _sft_fact(rng, SUB_FACTS, SFT_SUB_RESPONSES),
    "steps": _sft_steps,
    "count": _sft_count,
    "copy": _sft_copy,
}
