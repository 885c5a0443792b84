"""The independent baseline of the trainer-overhead benchmark (issue 24): the smallest loop a
user would write around models/gpt.py, sharing nothing else with zerotrain.

- the model: models/gpt.py (its only import from this repository);
- the data: the same bytes file the trainer reads (`--data`), cut into seq_len+1 windows,
  shuffled with a seeded permutation and split over the ranks;
- torch AdamW, F.cross_entropy, a fixed LR. `--groups 2` (the default): decay on matrices only,
  no decay on the rest, as any GPT recipe and as the trainer's AdamW (train/optim/optimizer.py,
  decay / no-decay groups), so that trainer/plain measures the trainer's loop and not a different
  optimizer layout (under ZeRO-1/2 DeepSpeed flattens and partitions each group on its own);
  `--groups 1`: one group, weight decay 0.1 on everything (issue 41's plain loop), to measure
  what the layout itself costs;
- torch's threads: whatever the environment gives (OMP_NUM_THREADS, which torch honours, or
  torch's default of every core per process); bench/stages.py runs it both ways and records the
  count each rank saw (`torch_threads`);
- DeepSpeed: deepspeed.initialize with the config dict written out below from the same numbers
  (no zerotrain config reader); DDP: a plain torch DistributedDataParallel loop; FSDP2: torch's
  fully_shard per block and root (`build_fsdp2`);
- nothing set in the environment by this file (no huge pages, no allocator settings, no device
  override): bench/stages.py launches it in a clean environment.

    deepspeed --num_gpus 2 bench/plain_loop.py --stage 2 --data corpus.bin --steps 45 --window 5 \\
        --d-model 256 --n-layer 4 --seq-len 256 --micro-batch 8 --out /tmp/plain.json

Writes (rank 0) {"window_tokens_per_s": [...], "window_s": [...], ...} to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from zerotrain.models.gpt import GPT, preset  # noqa: E402


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", required=True, choices=("ddp", "0", "1", "2", "3", "fsdp2", "fsdp2_keep"),
                   help="ddp, a ZeRO stage, or FSDP2 (fsdp2_keep: reshard_after_forward false)")
    p.add_argument("--offload", action="store_true", help="ZeRO optimizer offload to CPU (DeepSpeedCPUAdam)")
    p.add_argument("--data", required=True, help="the corpus bytes (byte-level tokens)")
    p.add_argument("--model", default="gpt-small-cpu")
    p.add_argument("--d-model", type=int, required=True)
    p.add_argument("--n-layer", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--micro-batch", type=int, required=True)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--groups", type=int, default=2, choices=(1, 2),
                   help="AdamW parameter groups: 2 = decay / no decay (as the trainer), 1 = one group")
    p.add_argument("--overlap-comm", choices=("json", "on", "off"), default="json",
                   help="ZeRO-1/2 overlap_comm: as the shipped ds_configs/zero<stage>.json (stage 1 off, "
                        "stage 2 on), or forced")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--window", type=int, required=True, help="steps per timed window")
    p.add_argument("--out", required=True)
    p.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher's
    return p.parse_args(argv)


def ds_config(a, world: int) -> dict:
    """The DeepSpeed dict a user writes for this run: batch, clipping, fp32, the ZeRO stage and
    the model-width bucket sizes (h*h buckets, as Hugging Face's integration fills "auto"); the
    stage's other settings as the shipped ds_configs/zero<stage>.json has them, so that both loops
    run the same DeepSpeed (stage 1: DeepSpeed's defaults, overlap_comm off; with it on, this
    loop's ZeRO-1 ran at 0.91 of its speed with it off on 2 CPU cores, BENCHMARKS.md "Trainer
    against the best plain loop")."""
    h = a.d_model
    cfg = {"train_micro_batch_size_per_gpu": a.micro_batch, "gradient_accumulation_steps": a.grad_accum,
           "train_batch_size": a.micro_batch * a.grad_accum * world, "gradient_clipping": a.clip,
           "bf16": {"enabled": False}, "fp16": {"enabled": False}, "steps_per_print": 10**9,
           "zero_allow_untested_optimizer": True}
    zero = {"stage": int(a.stage)}
    if zero["stage"] == 1:
        zero.update(reduce_bucket_size=h * h, allgather_bucket_size=h * h)
    if zero["stage"] == 2:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_scatter=True,
                    reduce_bucket_size=h * h, allgather_bucket_size=h * h)
    if zero["stage"] in (1, 2) and a.overlap_comm != "json":
        zero["overlap_comm"] = a.overlap_comm == "on"
    if zero["stage"] == 3:
        zero.update(overlap_comm=True, contiguous_gradients=True, reduce_bucket_size=h * h,
                    stage3_prefetch_bucket_size=int(0.9 * h * h), stage3_param_persistence_threshold=10 * h,
                    stage3_max_live_parameters=24 * h * h, stage3_max_reuse_distance=24 * h * h,
                    sub_group_size=24 * h * h)
    if a.offload:
        zero["offload_optimizer"] = {"device": "cpu"}
        cfg["zero_force_ds_cpu_optimizer"] = False
    cfg["zero_optimization"] = zero
    return cfg


def batches(path: str, seq: int, micro: int, rank: int, world: int, seed: int):
    """Endless (x, y) micro-batches: this rank's share of a seeded permutation of the windows."""
    data = torch.from_numpy(np.fromfile(path, dtype=np.uint8).astype(np.int64))
    n = (len(data) - 1) // seq
    epoch = 0
    while True:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        mine = order[rank::world]
        for i in range(0, len(mine) - micro + 1, micro):
            starts = mine[i:i + micro] * seq
            rows = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
            yield rows[:, :-1], rows[:, 1:]
        epoch += 1


def optimizer(model, a):
    if a.groups == 1:
        groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
    else:
        decay = [p for p in model.parameters() if p.dim() >= 2]
        rest = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    if a.offload:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        return DeepSpeedCPUAdam(groups, lr=a.lr, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=a.lr)


def loss_of(model, x, y):
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.size(-1)).float(), y.reshape(-1))


def build_deepspeed(a, gcfg, world):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(a.seed)
    cfg = ds_config(a, world)
    if cfg["zero_optimization"]["stage"] == 3:
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            model = GPT(gcfg)
    else:
        model = GPT(gcfg)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer(model, a), config=cfg)

    def step(micro_batches):
        for x, y in micro_batches:
            engine.backward(loss_of(engine, x, y))
            engine.step()
    return step


def build_ddp(a, gcfg):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(a.seed)
    model = GPT(gcfg)
    ddp = DDP(model)
    opt = optimizer(model, a)

    def step(micro_batches):
        for i, (x, y) in enumerate(micro_batches):
            if i < len(micro_batches) - 1:
                with ddp.no_sync():
                    (loss_of(ddp, x, y) / len(micro_batches)).backward()
            else:
                (loss_of(ddp, x, y) / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def build_fsdp2(a, gcfg):
    """torch's own FSDP2 recipe (torchtitan's): fully_shard each block, then the root; AdamW over
    the DTensor shards; clip by the global norm (a DTensor reduction); no_sync-free accumulation."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    torch.manual_seed(a.seed)
    model = GPT(gcfg).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=a.stage == "fsdp2")
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt = optimizer(model, a)

    def step(micro_batches):
        for x, y in micro_batches:
            (loss_of(model, x.to(device), y.to(device)) / len(micro_batches)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    gcfg = preset(a.model, d_model=a.d_model, n_layer=a.n_layer, seq_len=a.seq_len, vocab_size=256)
    step = (build_ddp(a, gcfg) if a.stage == "ddp" else build_fsdp2(a, gcfg) if a.stage.startswith("fsdp2")
            else build_deepspeed(a, gcfg, world))
    it = batches(a.data, a.seq_len, a.micro_batch, rank, world, a.seed)
    tokens_per_step = a.micro_batch * a.grad_accum * world * a.seq_len
    window_s, bounds = [], [time.time()]
    t0 = time.perf_counter()
    for s in range(1, a.steps + 1):
        step([next(it) for _ in range(a.grad_accum)])
        if s % a.window == 0:
            t1 = time.perf_counter()
            window_s.append(t1 - t0)
            bounds.append(time.time())
            t0 = t1
    if rank == 0:
        out = {"window_s": window_s, "window_bounds": bounds, "window_steps": a.window,
               "tokens_per_step": tokens_per_step,
               "window_tokens_per_s": [a.window * tokens_per_step / w for w in window_s], "world_size": world,
               "torch_threads": torch.get_num_threads(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "param_groups": a.groups}
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
