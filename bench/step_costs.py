"""What the trainer does per step that a plain loop does not, each timed on its own (issue 24).

    python bench/step_costs.py [--d-model 256 --n-layer 4 --seq-len 256 --micro-batch 8]

Starts itself on 2 processes (torchrun, gloo, a clean environment as bench/stages.py gives it)
and times, on each rank, with the trainer's own code where it has one:
  - step: one plain DDP step of the benchmark GPT (forward, F.cross_entropy, backward, gradient
    all-reduce, AdamW): the denominator of every share below;
  - vote: `StopVote` (an async all-reduce of a 2-float CPU tensor, the previous one read back);
  - cadence: `SaveCadence.ticket()` + `.due()` with checkpoint.every_minutes set (a clock read);
  - token_denominator: the labelled-token count of the step's micro-batches, all-reduced
    (instruction data only: `data.masked_labels`);
  - loss_chunked_extra: models/losses.py's chunked cross-entropy minus F.cross_entropy, forward
    and backward on the step's (micro * seq, vocab) fp32 logits;
  - bookkeeping: the LR schedule and set_lr, the health entry, the memory report's two step
    checks (the probe itself runs once per run, not per step).
Each item is the median of many calls in a loop with nothing else running; work that overlaps
the step (the vote's all-reduce runs on gloo's thread) is counted at its caller's cost only.
Rank 0 writes bench/results/step_costs-<time>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt-small-cpu")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="timed plain steps (after 3 warm-up steps)")
    p.add_argument("--reps", type=int, default=300, help="calls per timed item")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    return p.parse_args(argv)


def timed(fn, reps: int) -> float:
    """Median seconds of one call of fn over reps calls (after 5 untimed ones)."""
    for _ in range(5):
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def rank_main(a) -> dict:
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from zerotrain.models.gpt import GPT, preset
    from zerotrain.models.losses import cross_entropy
    from zerotrain.train.checkpoint.cadence import SaveCadence
    from zerotrain.train.optim.optimizer import set_lr
    from zerotrain.train.optim.schedule import lr_at
    from zerotrain.train.training.tick import StopVote
    from zerotrain.train.training.trainer import Trainer

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(0)
    gcfg = preset(a.model, d_model=a.d_model, n_layer=a.n_layer, seq_len=a.seq_len, vocab_size=256)
    model = GPT(gcfg)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    x = torch.randint(0, 256, (a.micro_batch, a.seq_len))
    y = torch.randint(0, 256, (a.micro_batch, a.seq_len))

    def plain_step():
        logits = ddp(x)
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        plain_step()
    steps = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        plain_step()
        steps.append(time.perf_counter() - t0)
    step_s = statistics.median(steps)

    acc = SimpleNamespace(num_processes=world)
    vote = StopVote(acc, 2)
    cadence = SaveCadence(0, 30.0, rank == 0)
    counter = iter(range(10**9))
    items = {
        "vote": lambda: vote([0.0, cadence.ticket()]),
        "cadence": lambda: cadence.due(next(counter), 0.0, False),  # the vote's ticket: 0 within 30 minutes
    }
    shim = SimpleNamespace(acc=acc, batch=SimpleNamespace(accum=1))
    labels = y.clone()
    labels[:, : a.seq_len // 2] = -100
    items["token_denominator"] = lambda: Trainer._token_denominator(shim, [{"labels": labels}])

    logits = torch.randn(a.micro_batch * a.seq_len, 256, requires_grad=True)
    targets = y.reshape(-1)

    def torch_ce():
        F.cross_entropy(logits, targets).backward()

    def chunked_ce():
        cross_entropy(logits, targets).backward()
    t_torch, t_chunked = timed(torch_ce, a.reps // 3), timed(chunked_ce, a.reps // 3)

    from zerotrain.train.config import OptimConfig
    optim_cfg = OptimConfig()
    health = []
    at = 5

    def bookkeeping():
        set_lr(opt, lr_at(optim_cfg, 100, 1000))
        health.append((100, None, None))
        if len(health) > 100:
            health.clear()
        _ = 100 == at
        _ = 101 == at + 1
    items["bookkeeping"] = bookkeeping
    cost = {k: timed(fn, a.reps) for k, fn in items.items()}
    vote.finish()
    cost["loss_chunked_extra"] = t_chunked - t_torch
    row = {"rank": rank, "step_s": step_s, "cost_s": cost, "ce_torch_s": t_torch, "ce_chunked_s": t_chunked}
    rows = [None] * world
    torch.distributed.all_gather_object(rows, row)
    torch.distributed.destroy_process_group()
    return {"rows": rows} if rank == 0 else {}


def report(a, rows: list[dict]) -> str:
    step = statistics.median(r["step_s"] for r in rows)
    per_step_items = ("vote", "cadence", "bookkeeping", "loss_chunked_extra")
    lines = [f"plain DDP step (GPT d_model={a.d_model} n_layer={a.n_layer}, {a.micro_batch}x{a.seq_len} tokens "
             f"per rank, {len(rows)} ranks): {step * 1e3:.1f} ms (median of ranks' medians)", "",
             "| per-step item | rank 0 us | rank 1 us | share of a step (max over ranks) |", "|---|---:|---:|---:|"]
    total = 0.0
    for k in rows[0]["cost_s"]:
        us = [r["cost_s"][k] * 1e6 for r in rows]
        share = max(r["cost_s"][k] / r["step_s"] for r in rows)
        if k in per_step_items:
            total += share
        cells = " | ".join(f"{u:.1f}" for u in us[:2])
        lines.append(f"| {k} | {cells} | {100 * share:.3f} % |")
    lines += ["", f"every-step items together (vote, cadence, bookkeeping, chunked loss): {100 * total:.3f} % of a step; "
              f"token_denominator only for instruction data",
              f"cross-entropy fwd+bwd on ({a.micro_batch * a.seq_len}, 256) fp32 logits: F.cross_entropy "
              f"{rows[0]['ce_torch_s'] * 1e3:.2f} ms, chunked {rows[0]['ce_chunked_s'] * 1e3:.2f} ms (rank 0)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    if "RANK" not in os.environ:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("ZEROTRAIN_", "MALLOC_", "WANDB_")) and k != "THP_MEM_ALLOC_ENABLE"}
        return subprocess.call([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(a.nproc),
                                "--master_port", "29731", __file__, *sys.argv[1:]], env=env)
    res = rank_main(a)
    if res:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        text = report(a, res["rows"])
        (out / f"step_costs-{stamp}.json").write_text(json.dumps({"args": vars(a), **res}, indent=1) + "\n")
        (out / f"step_costs-{stamp}.md").write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
