"""FSDP2's fp16 (train/strategy/fsdp2.py, loss_scale.DynamicScale) driven through the real
FSDP2Strategy on CPU, for tests/test_fsdp2_fp16.py (test harness, never shipped use).

fp16 needs a CUDA GPU in zerotrain; the only refusal lifted here is that one (load_ds_setup's
`cuda=True`, as tests/fp16_on_cpu.py does). torch computes fp16 Linear, Embedding and
cross-entropy on CPU, FSDP2 shards over gloo, and the strategy's code is the GPU's.

    torchrun --nproc_per_node 2 tests/fsdp2_fp16_driver.py OUT_DIR

runs the two-rank check: at step 2 rank 1 alone finds an inf in its own gradient shard (after
the reduce-scatter: no other rank sees it); each rank writes OUT_DIR/rank<R>.json with the
scale after every step and a checksum of the whole parameters before and after each step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent

VOCAB, WIDTH, ROWS = 16, 8, 4
CLIP = 1.0
FP16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 3, "hysteresis": 1}


class Net(torch.nn.Module):
    """Embedding, two residual blocks (FSDP2's units: an outermost ModuleList) and a head."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
                                          for _ in range(2))
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return torch.nn.functional.cross_entropy(self.head(h).float().view(-1, VOCAB), y.view(-1))


def model() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, rank: int = 0):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (ROWS, 5), generator=g)
    return x, torch.randint(0, VOCAB, (ROWS, 5), generator=g)


def strategy_file(d: Path, fp16: dict | None = None) -> str:
    data = json.loads((REPO / "ds_configs" / "fsdp2.json").read_text())
    data.update(bf16={"enabled": False}, fp16=fp16 or FP16)
    path = Path(d) / "fsdp2_fp16_test.json"
    path.write_text(json.dumps(data))
    return str(path)


def build(d: Path, world: int, fp16: dict | None = None):
    """(strategy, sharded model): the real load_ds_setup (its fp16-needs-CUDA refusal lifted),
    FSDP2Strategy's Accelerator, sharding, fused AdamW and prepare."""
    import zerotrain.train.strategy as strategy
    from zerotrain.train.config import Batch, RunConfig
    from zerotrain.train.strategy.ds_config import load_ds_setup
    cfg = RunConfig()
    b = Batch(micro=ROWS, accum=1, world=world)
    ds = load_ds_setup(strategy_file(d, fp16), cfg, b, 10, cuda=True)
    s = strategy.for_setup(ds)
    acc = s.build_accelerator(b, 60)
    m = model()
    opt = s.build_optimizer(m, cfg.optim)
    s.prepare(acc, m, opt, torch.utils.data.DataLoader(list(range(ROWS * world)), batch_size=ROWS * world))
    return s, m


def full_params(m) -> list[torch.Tensor]:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in m.parameters()]


def step(s, m, n: int, rank: int = 0, loss_mult: float = 1.0, poison=None):
    """Optimizer step n: one micro-batch's forward and backward through the strategy, `poison`
    (a function of the model) between backward and step, then strategy.step; returns the norm."""
    x, y = batch(n, rank)
    s.backward(m(x, y) * loss_mult)
    if poison is not None:
        poison(m)
    return s.step(CLIP)


def two_ranks(out: Path) -> None:
    import torch.distributed as dist
    s, m = build(out, 2)
    rank = dist.get_rank()

    def poison(model):  # rank 1's own shard of the first block's weight: an inf no other rank has
        if rank == 1:
            model.blocks[0][0].weight.grad.to_local().view(-1)[0] = float("inf")

    record = {"scale": [], "before": [], "after": [], "norm": []}
    for n in range(1, 6):
        record["before"].append([float(p.double().sum()) for p in full_params(m)])
        norm = step(s, m, n, rank, poison=poison if n == 2 else None)
        record["after"].append([float(p.double().sum()) for p in full_params(m)])
        record["norm"].append(float(norm))
        record["scale"].append(float(s.loss_scale()))
    record["adam_steps"] = sorted({int(st["step"]) for st in s.raw_optimizer.state.values()})
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    two_ranks(Path(sys.argv[1]))
