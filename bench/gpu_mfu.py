"""MFU of the GPT, timed without the trainer: the model of models/gpt.py built directly, bf16
autocast over fp32 weights (what the trainer's DDP path runs), torch AdamW (fused on CUDA),
random tokens already on the device (no data loading), N steps timed between two
torch.cuda.synchronize() calls.

    MFU = model FLOPs per token (GPTConfig.flops_per_token, the trainer's own formula)
          x tokens / seconds / peak FLOP/s (train/observe/perf.py's table: 989e12 for H100/H200 dense bf16)

    python bench/gpu_mfu.py --out /tmp/mfu.json                       # GPT-2-124M, eager then compiled
    python bench/gpu_mfu.py --modes eager --micro-batch 16 --out x.json
    python bench/gpu_mfu.py --device cpu --preset gpt-tiny --precision fp32 --peak-flops 1e11 ...  # smoke run

Writes {"flops_per_token", "peak_flops", "modes": {"eager": {"tokens_per_s", "mfu", ...}, ...}}
(a mode that fails records its error and the next one runs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--d-model", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, allocator)")
    p.add_argument("--modes", default="eager,compile", help="comma-separated: eager, compile")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp32"), help="bf16 = autocast over fp32 weights")
    p.add_argument("--device", default="auto")
    p.add_argument("--peak-flops", type=float, help="per-device peak; default: train/observe/perf.py's table for this GPU")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def measure(a, cfg, device, mode: str) -> dict:
    from zerotrain.models.gpt import GPT
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=(device.type == "cuda") or None)
    fwd = torch.compile(model) if mode == "compile" else model
    gen = torch.Generator(device=device).manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq_len + 1), device=device, generator=gen)
            for _ in range(4)]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")

    def step(i):
        b = data[i % len(data)]
        x, y = b[:, :-1], b[:, 1:]
        with autocast:
            logits = fwd(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    for i in range(a.warmup):
        loss0 = step(i)
    sync()
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for i in range(a.steps):
        loss = step(i)
    sync()
    seconds = time.perf_counter() - t0
    tokens = a.steps * a.micro_batch * a.seq_len
    out = {"seconds": seconds, "steps": a.steps, "tokens": tokens, "tokens_per_s": tokens / seconds,
           "step_s": seconds / a.steps, "warmup_s": warm_s, "first_loss": float(loss0), "last_loss": float(loss)}
    out["model_flops_per_s"] = cfg.flops_per_token(a.seq_len) * out["tokens_per_s"]
    out["mfu"] = out["model_flops_per_s"] / a.peak_flops if a.peak_flops else None
    if device.type == "cuda":
        out["peak_mem_bytes"] = torch.cuda.max_memory_allocated()
    return out


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    from zerotrain.models.gpt import preset
    from zerotrain.train.observe.perf import device_peak_flops
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)
    cfg = preset(a.preset, d_model=a.d_model, n_layer=a.n_layer, vocab_size=a.vocab_size,
                 seq_len=a.seq_len)
    a.peak_flops = a.peak_flops or (device_peak_flops() if device.type == "cuda" else None)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    res = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "model": a.preset, "config": cfg.to_dict(), "params": cfg.num_params(),
           "flops_per_token": cfg.flops_per_token(a.seq_len), "peak_flops": a.peak_flops,
           "micro_batch": a.micro_batch, "seq_len": a.seq_len, "dtype": a.precision, "modes": {}}
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        try:
            r = measure(a, cfg, device, mode)
        except Exception as e:  # noqa: BLE001 - recorded; the other modes still run
            r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
        res["modes"][mode] = r
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        if "error" in r:
            print(f"[gpu_mfu] {mode}: FAILED {r['error']}", flush=True)
        else:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (unknown peak)"
            print(f"[gpu_mfu] {mode}: {r['tokens_per_s']:,.0f} tok/s, {r['step_s'] * 1e3:.1f} ms/step, MFU {mfu} "
                  f"(loss {r['first_loss']:.3f} -> {r['last_loss']:.3f})", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0 if all("error" not in r for r in res["modes"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
