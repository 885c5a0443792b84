"""A plain `transformers.Trainer` run (one CPU process) that writes an HF Trainer checkpoint
(`checkpoint-N/`: model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth,
trainer_state.json, training_args.bin) for tests/test_import.py, then continues and records
its losses.

It mirrors a zerotrain step so that zerotrain resumed from the imported checkpoint must see the
same losses: zerotrain's model (an hf:<dir> model) and data set, the batches in zerotrain's
order (GlobalBatchSampler, global batch = per-device batch here), zerotrain's loss function,
AdamW with the run file's hyper-parameters (weight decay 0: the two group the parameters
differently), a constant LR, gradient clipping train.grad_clip.

    python tests/hf_trainer_loop.py RUN.yaml OUT_DIR SAVE_AT CONTINUE
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main():
    cfg_path, out, save_at, cont = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    from accelerate.utils import set_seed
    from transformers import Trainer, TrainingArguments

    from zerotrain.models import build_workload
    from zerotrain.models import resolve as resolve_model
    from zerotrain.train.config import load_config
    from zerotrain.train.data import build_data
    from zerotrain.train.data.sampler import GlobalBatchSampler

    cfg = load_config(cfg_path)
    assert cfg.optim.schedule == "constant" and cfg.optim.warmup_steps == 0 and cfg.optim.weight_decay == 0
    gb = cfg.train.global_batch_size
    spec = resolve_model(cfg.model)
    data = build_data(cfg.data, cfg.data.seq_len or spec.context, cfg.train.seed)
    sampler = GlobalBatchSampler(len(data.train), gb, 1, 1, cfg.train.seed)
    order = sampler.order(0)[: sampler.steps_per_epoch * gb].tolist()
    set_seed(cfg.train.seed)
    workload = build_workload(spec, data)
    losses = []

    class ZerotrainOrder(Trainer):
        def _get_train_sampler(self, *a, **k):
            return order  # a list is a valid sampler: zerotrain's epoch-0 order

        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            loss = workload.loss(model, inputs)
            losses.append(float(loss.detach()))
            return loss

    args = TrainingArguments(
        output_dir=str(out), max_steps=save_at + cont, save_strategy="steps", save_steps=save_at,
        per_device_train_batch_size=gb, learning_rate=cfg.optim.lr, lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=cfg.optim.betas[0], adam_beta2=cfg.optim.betas[1], adam_epsilon=cfg.optim.eps,
        max_grad_norm=cfg.train.grad_clip, optim="adamw_torch", logging_steps=1, report_to=[], use_cpu=True,
        seed=cfg.train.seed, remove_unused_columns=False, dataloader_drop_last=True,
        disable_tqdm=True)
    ZerotrainOrder(model=workload.model, args=args, train_dataset=data.train).train()
    (out / "losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    main()
