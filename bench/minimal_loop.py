"""The baseline for the trainer-overhead measurement: the same GPT, data and DeepSpeed JSON
as train/main.py, driven by the smallest hand-written loop (deepspeed.initialize +
engine.backward/step; torch DDP + AdamW for a "ddp" file). No Accelerate, no Trainer, no
logging, no per-step host syncs. Reuses zerotrain only to read the config (so the resolved
DeepSpeed dict, the model and the bytes it trains on are identical).

    torchrun --nproc_per_node 2 bench/minimal_loop.py --ds-config ds_configs/zero2.json \\
        --steps 30 --window 5 --out /tmp/minimal.json -- --model.name gpt-small-cpu --data.seq_len 64

Writes (rank 0) {"window_tokens_per_s": [...], "window_s": [...], ...} to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.launch import device_env  # noqa: E402

device_env.apply()  # as train/main.py does, before torch: huge pages, ZEROTRAIN_DEVICE=cpu

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ds-config", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--window", type=int, required=True, help="steps per timed window")
    p.add_argument("--out", required=True)
    p.add_argument("overrides", nargs="*", help="the trainer's dotted options after --")
    return p.parse_args(argv)


def setup(args):
    """Config, batch, resolved DeepSpeed JSON, data: exactly what train/training/build.py computes."""
    from models import gpt_config
    from models import resolve as resolve_model
    from train.args import parse_train_args
    from train.config import load_config
    from train.data import build_data
    from train.dsconfig import resolve
    targs = parse_train_args(args.overrides)
    cfg = load_config(targs.config, targs.overrides)
    world = int(os.environ.get("WORLD_SIZE", 1))
    batch = cfg.train.batch(world)
    gcfg = gpt_config(cfg.model, vocab_size=256)
    seq = cfg.data.seq_len or gcfg.seq_len
    data = build_data(cfg.data, seq, cfg.train.seed)
    gcfg = gpt_config(cfg.model, vocab_size=data.vocab_size)
    ds = resolve(args.ds_config, cfg, batch, args.steps, cuda=torch.cuda.is_available(),
                 hidden_size=resolve_model(cfg.model).hidden_size)
    return cfg, batch, gcfg, seq, data, ds


def batches(dataset, micro, rank, world, seed, device):
    from torch.utils.data import DataLoader, DistributedSampler
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=micro, sampler=sampler, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        for b in loader:
            yield b["input_ids"].to(device, non_blocking=True), b["labels"].to(device, non_blocking=True)
        epoch += 1


def lm_loss(model, x, y):
    logits = model(x).float()                                   # (B, T, V)
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))


def build_deepspeed(cfg, gcfg, ds, device):
    import deepspeed
    from models.gpt import GPT
    from train.optim.optimizer import param_groups
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(cfg.train.seed)
    init = deepspeed.zero.Init(config_dict_or_path=ds.resolved) if ds.stage == 3 else contextlib.nullcontext()
    with init:
        model = GPT(gcfg)
    groups = param_groups(model, cfg.optim.weight_decay)
    kw = dict(lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
    if ds.offload_optimizer:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        opt = DeepSpeedCPUAdam(groups, adamw_mode=True, **kw)
    else:
        opt = torch.optim.AdamW(groups, **kw)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds.resolved)

    def step(micro_batches):
        for x, y in micro_batches:
            loss = lm_loss(engine, x, y)
            engine.backward(loss)
            engine.step()
    return step


def build_ddp(cfg, gcfg, ds, device, local_rank):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from models.gpt import GPT
    from train.optim.optimizer import param_groups
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(cfg.train.seed)
    model = GPT(gcfg).to(device)
    ddp = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None, **ds.ddp_kwargs)
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                            betas=tuple(cfg.optim.betas), eps=cfg.optim.eps, fused=device.type == "cuda" or None)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(ds.precision)
    scaler = torch.amp.GradScaler(device.type) if ds.precision == "fp16" else None
    clip = cfg.train.grad_clip

    def step(micro_batches):
        for i, (x, y) in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            with (contextlib.nullcontext() if sync else ddp.no_sync()), \
                    torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = lm_loss(ddp, x, y)
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        (scaler.step(opt), scaler.update()) if scaler else opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "ddp" not in json.loads(Path(args.ds_config).read_text()):
        # the trainer's allocator setting for DeepSpeed on CPU (train.host_malloc auto), so both loops allocate alike
        from train.launch.device_memory import compact_host_malloc
        compact_host_malloc()
    cfg, batch, gcfg, seq, data, ds = setup(args)
    if ds.is_deepspeed:
        step = build_deepspeed(cfg, gcfg, ds, device)
    else:
        step = build_ddp(cfg, gcfg, ds, device, local_rank)
    it = batches(data.train, batch.micro, rank, world, cfg.train.seed, device)
    tokens_per_step = batch.global_size * seq

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    window_s, window_end = [], []   # duration; wall clock at the end (for the CPU-time trace)
    sync()
    start = [time.time()]
    t0 = time.perf_counter()
    for s in range(1, args.steps + 1):
        step([next(it) for _ in range(batch.accum)])
        if s % args.window == 0:
            sync()
            t1 = time.perf_counter()
            window_s.append(t1 - t0)
            window_end.append(time.time())
            t0 = t1
    if rank == 0:
        out = {"window_s": window_s, "window_bounds": start + window_end, "window_steps": args.window,
               "tokens_per_step": tokens_per_step,
               "window_tokens_per_s": [args.window * tokens_per_step / w for w in window_s],
               "flops_per_token": gcfg.flops_per_token(seq), "world_size": world, "device": str(device)}
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
