"""Start-up cost of instruction data (data.kind sft): build_data on N JSONL records (every
rank tokenizes every record in Python) vs on the set `zerotrain prepare --sft` made of them
once (memory-mapped), with a small local BPE tokenizer and a ChatML chat template. Also the
one-off prepare time. Samples are compared (a few hundred) to show they are the same.

    .venv/bin/python bench/sft_startup.py [N=20000]       # ~1 min for 20k records on 1 core
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from helpers import make_tokenizer, random_text  # noqa: E402  (the tests' tiny tokenizer)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SEQ_LEN = 256


def records(n: int) -> list[dict]:
    """Half prompt/response, half 2-turn conversations; prompts/responses of 5-60 words."""
    rng = random.Random(0)
    words = random_text(200_000, 7).split()
    say = lambda: " ".join(rng.choice(words) for _ in range(rng.randint(5, 60)))  # noqa: E731
    return [{"prompt": say(), "response": say()} if i % 2 else
            {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": say()},
                          {"role": "assistant", "content": say()}, {"role": "user", "content": say()},
                          {"role": "assistant", "content": say()}]} for i in range(n)]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
    from zerotrain.train.commands.prepare import main as prepare
    from zerotrain.train.config import DataConfig
    from zerotrain.train.data import build_data
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        tok = make_tokenizer(d / "tok", [random_text(50_000, s) for s in range(4)], vocab_size=1024)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        tok.chat_template = CHATML
        tok.save_pretrained(str(d / "tok"))
        src = d / "r.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in records(n)))
        build = lambda p: build_data(DataConfig(kind="sft", path=str(p), seq_len=SEQ_LEN, val_fraction=0.01),  # noqa
                                     SEQ_LEN, 0, str(d / "tok"))
        jsonl, t_jsonl = timed(lambda: build(src))
        _, t_prep = timed(lambda: prepare(["--sft", str(src), "--out", str(d / "r.bin"), "--tokenizer", str(d / "tok")]))
        prepared, t_mmap = timed(lambda: build(d / "r.bin"))
        same = all(all((jsonl.train[i][k] == prepared.train[i][k]).all() for k in ("input_ids", "labels"))
                   for i in range(0, len(jsonl.train), max(1, len(jsonl.train) // 300)))
        print(f"{n} records ({src.stat().st_size / 1e6:.1f} MB JSONL, seq_len {SEQ_LEN}, BPE vocab {len(tok)}, "
              f"chat template): build_data from JSONL {t_jsonl:.2f}s, from the prepared set {t_mmap:.3f}s "
              f"({t_jsonl / t_mmap:.0f}x); prepare --sft once {t_prep:.2f}s; samples identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
