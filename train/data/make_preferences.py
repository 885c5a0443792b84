"""A synthetic preference set to try data.kind preference with (examples/dpo.yaml): every prompt
asks for a word; the chosen response is lowercase letters, the rejected one digits, both random.
A model that learns the preference prefers letters on held-out prompts too (rewards/accuracies
rises above 0.5). The output is a pure function of the arguments.

    python -m zerotrain.train.data.make_preferences runs/dpo-data/train.jsonl [--records 512] [--val 64] [--seed 0]

writes train.jsonl and its validation split train.val.jsonl (data.kind preference reads both)."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"


def records(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        word = lambda alphabet: "".join(rng.choice(alphabet) for _ in range(rng.randint(3, 8)))  # noqa: E731
        out.append({"prompt": f"say {word(LETTERS)}:", "chosen": " " + word(LETTERS), "rejected": " " + word(DIGITS)})
    return out


def write(out: Path, n: int, n_val: int, seed: int) -> tuple[Path, Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    val = out.with_suffix(".val.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in records(n, seed)))
    val.write_text("".join(json.dumps(r) + "\n" for r in records(n_val, seed + 1)))
    return out, val


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="make_preferences", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--records", type=int, default=512)
    p.add_argument("--val", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    train, val = write(a.out, a.records, a.val, a.seed)
    print(f"wrote {a.records} records to {train} and {a.val} to {val}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
