"""Packed rows' attention on this machine (issue 27): SDPA with the GPT's additive document mask
vs flex_attention with a block mask, and what the mask adds to a training step's memory.

    python bench/attention_mask.py [--seq 512,1024,2048] [--reps 5]

1. Speed: one attention call, forward + backward, (B=2, H=4, T, Hd=64) fp32, documents of random
   lengths (median ~T/8); SDPA with models/gpt.py's document_mask (built once per batch) and
   torch's flex_attention (compiled, as it must be to be fast) with a block mask from the same
   document ids; the two alternated, median of --reps calls each after a warm-up. flex_attention
   is reported as failed where it does not compile or run here.
2. Memory: the GPT (d_model 256, 4 layers, one 2048-token row) forward, packed (doc ids +
   per-document positions) vs unpacked: bytes autograd saves for backward (saved_tensors_hooks,
   each storage once) and the largest single saved tensor.
Writes bench/results/attention_mask-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from zerotrain.models.gpt import GPT, document_mask, preset  # noqa: E402


def doc_ids_for(B: int, T: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(B):
        ids, d, n = [], 0, 0
        while n < T:
            length = max(1, int(torch.empty(1).log_normal_(mean=float(torch.tensor(T / 8).log()), std=0.8,
                                                             generator=g).item()))
            take = min(length, T - n)
            ids += [d] * take
            n, d = n + take, d + 1
        rows.append(ids)
    return torch.tensor(rows)


def timed(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def speed(T: int, reps: int) -> dict:
    B, H, Hd = 2, 4, 64
    q, k, v = (torch.randn(B, H, T, Hd, requires_grad=True) for _ in range(3))
    doc = doc_ids_for(B, T)
    mask = document_mask(doc)

    def sdpa():
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    out = {"T": T, "documents_per_row": [int(r.max()) + 1 for r in doc]}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        flex = torch.compile(flex_attention, dynamic=False)

        def mask_mod(b, h, qi, ki):
            return (qi >= ki) & (doc[b, qi] == doc[b, ki])
        block = create_block_mask(mask_mod, B, None, T, T, device="cpu")

        def flex_call():
            flex(q, k, v, block_mask=block).sum().backward()
        t0 = time.perf_counter()
        flex_call()
        out["flex_compile_s"] = time.perf_counter() - t0
        a, b = [], []
        for _ in range(reps):  # alternated
            a.append(timed(sdpa, 1))
            b.append(timed(flex_call, 1))
        out["sdpa_s"], out["flex_s"] = statistics.median(a), statistics.median(b)
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        out["flex_error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
        out["sdpa_s"] = timed(sdpa, reps)
    return out


def memory(T: int) -> dict:
    torch.manual_seed(0)
    model = GPT(preset("gpt-small-cpu", d_model=256, n_layer=4, seq_len=T, vocab_size=256))
    idx = torch.randint(0, 256, (1, T))
    doc = doc_ids_for(1, T, seed=1)
    starts = torch.cat([torch.tensor([True]), doc[0, 1:] != doc[0, :-1]])
    pos = torch.arange(T) - torch.cummax(torch.where(starts, torch.arange(T), 0), 0).values
    res = {}
    for name, kw in (("unpacked", {}), ("packed", {"position_ids": pos[None], "doc_ids": doc})):
        seen = {}

        def pack(t):
            key = (t.untyped_storage().data_ptr(), t.dtype)
            seen[key] = max(seen.get(key, 0), t.untyped_storage().nbytes())
            return t
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(idx, **kw).float().logsumexp(-1).mean()
        loss.backward()
        res[name] = {"saved_bytes": sum(seen.values()), "largest_saved_bytes": max(seen.values())}
    res["mask_bytes"] = T * T * 4
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", default="512,1024,2048")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows = [speed(int(t), a.reps) for t in a.seq.split(",")]
    mem = memory(2048)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    lines = [f"Command: `python bench/attention_mask.py --seq {a.seq} --reps {a.reps} --threads {a.threads}`", "",
             "| T | documents per row | SDPA + additive mask ms | flex_attention ms | flex compile s |",
             "|---:|---|---:|---:|---:|"]
    for r in rows:
        flex = f"{r['flex_s'] * 1e3:.1f}" if "flex_s" in r else f"failed ({r['flex_error'][:80]})"
        comp = f"{r['flex_compile_s']:.1f}" if "flex_compile_s" in r else "-"
        lines.append(f"| {r['T']} | {r['documents_per_row']} | {r['sdpa_s'] * 1e3:.1f} | {flex} | {comp} |")
    u, k = mem["unpacked"], mem["packed"]
    lines += ["", f"GPT d_model=256 n_layer=4, one 2048-token row: saved for backward unpacked "
              f"{u['saved_bytes'] / 2**20:.1f} MiB, packed {k['saved_bytes'] / 2**20:.1f} MiB (+"
              f"{(k['saved_bytes'] - u['saved_bytes']) / 2**20:.1f} MiB; one fp32 (T, T) mask is "
              f"{mem['mask_bytes'] / 2**20:.1f} MiB); largest saved tensor {u['largest_saved_bytes'] / 2**20:.1f} vs "
              f"{k['largest_saved_bytes'] / 2**20:.1f} MiB"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"attention_mask-{stamp}.json").write_text(json.dumps({"args": vars(a), "speed": rows, "memory": mem},
                                                                 indent=1) + "\n")
    (out / f"attention_mask-{stamp}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
