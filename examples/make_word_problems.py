"""Write `examples/word_problems.jsonl`: arithmetic word problems with GSM8K-style answers.

    python examples/make_word_problems.py            # 1000 problems, numbers up to 9, seed 0
    python examples/make_word_problems.py --n 500 --max-number 40 --seed 1 --out my_problems.jsonl

Each row is {"question": ..., "answer": "<worked solution> #### <number>"}; the `numeric` reward
reads the number after `####` as the reference and the last number of a completion as the guess.

The numbers are small by default so that a tiny model can learn the arithmetic from a few hundred
rows: the README's example run then starts RL from a warm-up inside the accuracy band, with a
learning signal from its first step (with numbers up to 40 the tiny model memorises its training
rows and gets few held-out ones right).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana"]
THINGS = ["apples", "books", "coins", "marbles", "pens", "shells", "stamps", "cards"]


def word_problem(rng: random.Random, max_number: int = 9) -> dict[str, str]:
    """One problem: buy more, give some away, or share equally; operands from 1 to `max_number`."""
    name, thing = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, max_number), rng.randint(1, max_number)
    kind = rng.choice(["more", "away", "share"])
    if kind == "more":
        question = f"{name} has {a} {thing} and buys {b} more. How many {thing} does {name} have now?"
        answer = f"{a} + {b} = {a + b}\n#### {a + b}"
    elif kind == "away":
        a = a + b
        question = f"{name} has {a} {thing} and gives {b} away. How many {thing} are left?"
        answer = f"{a} - {b} = {a - b}\n#### {a - b}"
    else:
        k = rng.randint(2, 4)
        question = f"{name} shares {a * k} {thing} equally among {k} friends. How many {thing} does each friend get?"
        answer = f"{a * k} / {k} = {a}\n#### {a}"
    return {"question": question, "answer": answer}


def word_problems(n: int, seed: int = 0, max_number: int = 9) -> list[dict[str, str]]:
    """`n` problems with distinct questions, so that no held-out question also appears in training."""
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < n:
        row = word_problem(rng, max_number)
        if row["question"] not in seen:
            seen.add(row["question"])
            rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=1000)
    parser.add_argument("--max-number", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("word_problems.jsonl")))
    args = parser.parse_args()
    print(write_jsonl(word_problems(args.n, args.seed, args.max_number), args.out))


if __name__ == "__main__":
    main()
