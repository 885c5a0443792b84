"""The training loop: accumulation, clipping, LR, evaluation, logging, stopping cleanly.

Everything here is the same for DDP and every ZeRO stage; the differences live in the
Accelerator (distributed.py) and the two small `if self.ds.is_deepspeed` branches below
(DeepSpeed steps and clips inside `backward`, DDP here).
"""

from __future__ import annotations

import math
import resource
import signal
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from train.optim import set_lr


@dataclass
class TrainState:
    """Everything besides tensors that a resumed run needs (saved as JSON)."""

    step: int = 0            # optimizer steps completed
    epoch: int = 0
    offset: int = 0          # samples of `epoch` consumed (a multiple of the global batch)
    samples_seen: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0   # non-finite or fp16-overflow steps not applied
    wandb_run_id: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


class StopRequested:
    """SIGTERM/SIGINT: finish the current step, checkpoint, exit 0. A second SIGINT aborts."""

    def __init__(self):
        self.flag = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


def peak_memory_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class Trainer:
    def __init__(self, *, cfg, acc, topo, ds, batch, workload, data, model, optimizer, raw_optimizer,
                 train_loader, sampler, val_loader, max_steps, run_dir, loggers, checkpointer=None, banner=None):
        self.cfg, self.acc, self.topo, self.ds, self.batch = cfg, acc, topo, ds, batch
        self.workload, self.data, self.model = workload, data, model
        self.optimizer, self.raw_optimizer = optimizer, raw_optimizer
        self.train_loader, self.sampler, self.val_loader = train_loader, sampler, val_loader
        self.max_steps, self.run_dir, self.loggers, self.checkpointer = max_steps, run_dir, loggers, checkpointer
        self.state = TrainState()
        self.param_dtype = next(p for p in model.parameters()).dtype if ds.is_deepspeed else torch.float32
        self._it = None
        self.last_eval: dict = {}
        self.stop_reason = None

    # ------------------------------------------------------------------ data
    def _next_batch(self):
        if self._it is None:
            self.sampler.set_position(self.state.epoch, self.state.offset)
            self._it = iter(self.train_loader)
        b = next(self._it, None)
        if b is None:  # cannot happen mid-step: an epoch is a whole number of steps
            raise RuntimeError("data loader ran out inside an optimizer step")
        if self.ds.is_deepspeed and self.param_dtype != torch.float32:
            # DeepSpeed bf16/fp16 keeps the parameters themselves in half precision.
            b = {k: v.to(self.param_dtype) if v.is_floating_point() else v for k, v in b.items()}
        return b

    def _advance_position(self):
        g = self.batch.global_size
        self.state.offset += g
        self.state.samples_seen += g
        self.state.tokens_seen += g * self.data.items_per_sample
        if self.state.offset >= self.sampler.steps_per_epoch * g:
            self.state.epoch += 1
            self.state.offset = 0
            self._it = None

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        acc, model = self.acc, self.model
        lr = self.cfg.optim.lr_at(self.state.step, self.max_steps)
        set_lr(self.raw_optimizer, lr)
        t_data = 0.0
        loss_sum = torch.zeros((), dtype=torch.float64)
        grad_norm = None
        for _ in range(self.batch.accum):
            t0 = time.perf_counter()
            batch = self._next_batch()
            t_data += time.perf_counter() - t0
            with acc.accumulate(model):
                loss = self.workload.loss(model, batch)
                acc.backward(loss)
                if acc.sync_gradients:
                    grad_norm = self._clip_and_step()
            loss_sum += loss.detach().to(torch.float64).cpu()
        self._advance_position()
        self.state.step += 1
        return {"loss_sum": loss_sum, "lr": lr, "grad_norm": grad_norm, "data_s": t_data}

    def _clip_and_step(self):
        clip = self.cfg.train.grad_clip
        if self.ds.is_deepspeed:
            # The engine already unscaled, clipped and stepped inside backward().
            norm = self.model.get_global_grad_norm()
        else:
            norm = self.acc.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return None if norm is None else float(norm)

    def _loss_scale(self):
        if self.ds.precision != "fp16":
            return None, None
        if self.ds.is_deepspeed:
            return float(self.model.optimizer.cur_scale), int(self.model.skipped_steps)
        return float(self.acc.scaler.get_scale()), None

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        if self.val_loader is None:
            return {}
        self.model.eval()
        sums, count = {}, 0
        for batch in self.val_loader:
            if self.ds.is_deepspeed and self.param_dtype != torch.float32:
                batch = {k: v.to(self.param_dtype) if v.is_floating_point() else v for k, v in batch.items()}
            stats = self.acc.gather_for_metrics(self.workload.eval_stats(self.model, batch))
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + float(v.double().sum())
            count += len(next(iter(stats.values())))
        self.model.train()
        out = {f"val/{k}": v / max(1, count) for k, v in sums.items()}
        out["val/samples"] = count
        if "val/loss" in out and self.workload.task == "lm":
            out["val/ppl"] = math.exp(min(50.0, out["val/loss"]))
        return out

    # ------------------------------------------------------------------ sample text
    @torch.no_grad()
    def sample_text(self, prompt: bytes = b"def ") -> Optional[str]:
        n = self.cfg.train.sample_tokens
        if n == 0 or self.workload.family != "gpt" or self.data.decode is None or self.data.vocab_size != 256:
            return None
        model = self.acc.unwrap_model(self.model)
        model.eval()
        # Every rank runs the same generation (ZeRO-3 gathers parameters collectively).
        g = torch.Generator(device=self.acc.device).manual_seed(self.cfg.train.seed)
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=self.acc.device)
        out = model.generate(idx, max_new_tokens=n, temperature=0.8, top_k=50, generator=g)
        model.train()
        return self.data.decode(out[0].tolist())

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        acc, st = self.acc, self.state
        log_every = self.cfg.logging.every_steps
        eval_every = self.cfg.train.eval_every
        ckpt_every = self.cfg.checkpoint.every_steps
        bar = None
        if acc.is_main_process and self.cfg.train.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.max_steps, initial=st.step, desc="train", unit="step", dynamic_ncols=True)
        window = {"loss": torch.zeros((), dtype=torch.float64), "micro": 0, "data_s": 0.0, "t0": time.perf_counter(),
                  "steps": 0}
        last = {}
        self.model.train()
        with StopRequested() as stop:
            while st.step < self.max_steps:
                out = self.train_step()
                window["loss"] += out["loss_sum"]
                window["micro"] += self.batch.accum
                window["data_s"] += out["data_s"]
                window["steps"] += 1
                # One tiny collective a step so every rank agrees on stopping (a signal may
                # reach the ranks at different steps; stopping alone would hang the others).
                flags = acc.reduce(torch.tensor([float(stop.flag)], device=acc.device), reduction="sum")
                stopping = bool(flags[0] > 0)
                done = st.step >= self.max_steps
                if st.step % log_every == 0 or done or stopping:
                    last = self._log_window(window, out, bar)
                if eval_every and st.step % eval_every == 0 and not done:
                    self.last_eval = self.evaluate()
                    if self.last_eval:
                        self.loggers.log(self.last_eval, st.step)
                if self.checkpointer and ckpt_every and st.step % ckpt_every == 0 and not done:
                    self.checkpointer.save(st)
                if bar:
                    bar.update(1)
                if stopping:
                    self.stop_reason = "signal"
                    break
        if bar:
            bar.close()
        if self.stop_reason is None:
            self.last_eval = self.evaluate()
            if self.last_eval:
                self.loggers.log(self.last_eval, st.step)
        if self.checkpointer and (self.cfg.checkpoint.save_at_end or self.stop_reason):
            self.checkpointer.save(st)
        return {**last, **self.last_eval}

    def _log_window(self, w, out, bar) -> dict:
        acc = self.acc
        elapsed = time.perf_counter() - w["t0"]
        # Mean loss over every micro-batch of every rank in the window.
        mean_loss = float(acc.reduce(w["loss"].to(acc.device) / w["micro"], reduction="mean"))
        g = self.batch.global_size
        steps = w["steps"]
        m = {"loss": mean_loss, "lr": out["lr"], "epoch": self.state.epoch,
             "samples_per_s": g * steps / elapsed, "step_time_s": elapsed / steps,
             "data_wait_s": w["data_s"] / steps, "compute_s": (elapsed - w["data_s"]) / steps,
             "tokens_seen": self.state.tokens_seen, "peak_mem_bytes": peak_memory_bytes()}
        if out["grad_norm"] is not None:
            m["grad_norm"] = out["grad_norm"]
        if self.data.items_per_sample > 1:
            m["tokens_per_s"] = g * self.data.items_per_sample * steps / elapsed
        if self.workload.flops_per_item and torch.cuda.is_available():
            from train.perf import mfu
            util = mfu(self.workload.flops_per_item * self.data.items_per_sample * g * steps / elapsed,
                       self.topo.world_size, self.cfg.logging.peak_flops)
            if util is not None:
                m["mfu"] = util
        scale, skipped = self._loss_scale()
        if scale is not None:
            m["loss_scale"] = scale
        if skipped is not None:
            self.state.skipped_steps = skipped
        m["skipped_steps"] = self.state.skipped_steps
        self.loggers.log(m, self.state.step)
        if bar:
            post = {"loss": f"{mean_loss:.4f}"}
            if "tokens_per_s" in m:
                post["tok/s"] = f"{m['tokens_per_s']:.0f}"
            bar.set_postfix(post, refresh=False)
        w.update(loss=torch.zeros((), dtype=torch.float64), micro=0, data_s=0.0, t0=time.perf_counter(), steps=0)
        return m

    # ------------------------------------------------------------------ start / finish / close
    def start(self):
        from train import report
        self._t_start = time.perf_counter()
        if self.acc.is_main_process:
            print(report.config_text(self.resolved_config), flush=True)
            print(report.banner(self), flush=True)

    def finish(self, result: dict):
        from train import report
        elapsed = time.perf_counter() - self._t_start
        sample = self.sample_text() if self.stop_reason is None else None
        ckpt = self.checkpointer.latest_path() if self.checkpointer else None
        exported = None
        if self.checkpointer and self.cfg.checkpoint.export and self.stop_reason is None:
            exported = self.checkpointer.export()
        if self.acc.is_main_process:
            final = {"final/" + k: v for k, v in result.items() if not isinstance(v, str)}
            final["final/elapsed_s"] = elapsed
            self.loggers.log(final, self.state.step)
            print(report.summary(self, result, elapsed, sample, exported, ckpt), flush=True)

    def close(self):
        self.loggers.close()
        try:
            self.acc.end_training()
        finally:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
