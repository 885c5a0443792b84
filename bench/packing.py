"""Packed vs unpacked instruction data (issue 27): padding, steps per epoch, real tokens/s, time
per epoch, on a synthetic instruction set with log-normal record lengths (median seq_len / 8).

    flock /tmp/cpu.lock .venv/bin/python bench/packing.py [--records 512] [--seq-len 256] [--model gpt-tiny]

Both layouts train the same model (fp32, in process, AdamW) over every row of one epoch with the
same micro-batch; the records are byte strings (the GPT presets read bytes). Prints one JSON line
per layout.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zerotrain.models import build_workload, resolve  # noqa: E402
from zerotrain.train.config import DataConfig, ModelConfig  # noqa: E402
from zerotrain.train.data import build_data  # noqa: E402


def write_records(path: Path, n: int, seq_len: int, seed: int = 0) -> Path:
    """n prompt/response records, total bytes ~ log-normal with median seq_len / 8 (sigma 1)."""
    g = np.random.default_rng(seed)
    total = np.clip(np.round(np.exp(g.normal(np.log(seq_len / 8), 1.0, size=n))), 4, 4 * seq_len).astype(int)
    with open(path, "w") as f:
        for t in total:
            p = max(1, int(t) // 3)
            f.write(json.dumps({"prompt": "p" * p, "response": "r" * (int(t) - p)}) + "\n")
    return path


def epoch(data, model_name: str, seq_len: int, micro: int) -> dict:
    torch.manual_seed(0)
    wl = build_workload(resolve(ModelConfig(name=model_name, seq_len=seq_len)), data)
    opt = torch.optim.AdamW(wl.model.parameters(), lr=1e-3)
    rows = len(data.train)
    t0 = time.perf_counter()
    for s in range(0, rows - rows % micro, micro):
        batch = {k: torch.stack([data.train[i][k] for i in range(s, s + micro)]) for k in data.train[0]}
        loss = wl.loss(wl.model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - t0
    steps = rows // micro
    real = data.train.real_tokens(list(range(steps * micro)))
    return {"rows": rows, "steps_per_epoch": steps, "pad_fraction": round(1 - real / (steps * micro * seq_len), 4),
            "epoch_s": round(seconds, 2), "real_tokens_per_s": round(real / seconds, 1),
            "tokens_per_s": round(steps * micro * seq_len / seconds, 1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--model", default="gpt-tiny")
    a = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_records(Path(tmp) / "sft.jsonl", a.records, a.seq_len)
        for packing in (False, True):
            data = build_data(DataConfig(kind="sft", path=str(path), seq_len=a.seq_len, val_fraction=0.0,
                                         packing=packing), a.seq_len, 0, None)
            out = epoch(data, a.model, a.seq_len, a.micro)
            print(json.dumps({"layout": "packed" if packing else "unpacked", "records": a.records,
                              "seq_len": a.seq_len, "model": a.model, "micro": a.micro, **out}), flush=True)


if __name__ == "__main__":
    main()
