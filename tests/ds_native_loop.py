"""A plain DeepSpeed training loop (no zerotrain trainer, no Accelerate) that writes native
DeepSpeed checkpoints with `engine.save_checkpoint`, for tests/test_import.py.

Launched once with torchrun (2 processes, gloo, fp32): for each ZeRO stage in --stages it
builds a fresh engine in the same process group, trains SAVE_AT steps, saves
`<out>/stage<k>/global_step<SAVE_AT>`, then continues CONTINUE steps and records the losses
(mean over ranks, what zerotrain logs). The loop mirrors a zerotrain step so that a zerotrain
run resumed from the imported checkpoint must see the same losses: zerotrain's own model,
data set and sampler (GlobalBatchSampler: global micro-batches, each rank its contiguous
slice, like Accelerate's split_batches), its AdamW parameter groups and hyper-parameters,
a constant LR, gradient clipping train.grad_clip.

    torchrun --nproc_per_node 2 tests/ds_native_loop.py RUN.yaml OUT_DIR SAVE_AT CONTINUE [STAGES]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    cfg_path, out, save_at, cont = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    stages = [int(s) for s in (sys.argv[5] if len(sys.argv) > 5 else "0,1,2,3").split(",")]
    import deepspeed
    import torch.distributed as dist
    from accelerate.utils import set_seed
    from torch.utils.data import default_collate

    from zerotrain.models import build_workload
    from zerotrain.models import resolve as resolve_model
    from zerotrain.train.config import load_config
    from zerotrain.train.data import build_data
    from zerotrain.train.data.sampler import GlobalBatchSampler
    from zerotrain.train.optim.optimizer import param_groups

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = load_config(cfg_path)
    assert cfg.optim.schedule == "constant" and cfg.optim.warmup_steps == 0, "the loop runs a constant LR"
    micro = cfg.train.micro_batch_size
    spec = resolve_model(cfg.model)
    data = build_data(cfg.data, cfg.data.seq_len or spec.context, cfg.train.seed)
    sampler = GlobalBatchSampler(len(data.train), micro, world, 1, cfg.train.seed)
    results = {}
    for stage in stages:
        set_seed(cfg.train.seed)
        workload = build_workload(spec, data)
        model = workload.model
        opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
        ds_cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
                  "gradient_clipping": cfg.train.grad_clip, "steps_per_print": 10**9,
                  "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
        sampler.set_position(0, 0)
        it = iter(sampler)
        losses = []
        for step in range(save_at + cont):
            idx = next(it)[rank * micro:(rank + 1) * micro]
            batch = default_collate([data.train[i] for i in idx])
            loss = workload.loss(engine, batch)
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
            if step + 1 == save_at:
                engine.save_checkpoint(str(out / f"stage{stage}"))
        results[stage] = losses
        engine.destroy()
        del engine, model, opt
        dist.barrier()
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
