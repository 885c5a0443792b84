"""The training loop: accumulation, clipping, LR, evaluation, logging, stopping cleanly.

fit() reads as the loop it is: step, agree, log?, eval?, save?, stop? Its collaborators decide
the rest: StopVote (train/training/stop.py) what every rank agreed on, Health
(train/training/health.py) whether the run is still sound, Evaluator (train/training/evaluate.py)
and SaveCadence (train/checkpoint/cadence.py) when to evaluate and save, DataPosition
(train/data/position.py) where the data stands, Window (train/training/window.py) the
statistics of one logging interval.

An optimizer step's loss is the mean over its global batch: of samples, or for language-model
data with masked labels (sft) of labelled tokens, counted over every micro-batch and rank before
the first backward (_token_denominator).

Nothing here depends on the backend: what differs between DDP and the ZeRO stages (clipping
and stepping, the fp16 loss scale, the dtype of float inputs) is the Strategy's
(train/strategy/).

The Trainer's fields are every component it works with, declared in one place; build.py
assembles them and nothing is attached to a Trainer afterwards.
"""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from models.losses import IGNORE_INDEX
from train import process_group, testhooks
from train.checkpoint.cadence import SaveCadence
from train.checkpoint.state import TrainState
from train.data.position import DataPosition
from train.observe import report, wandb_logger
from train.observe.memory import MemoryReport
from train.observe.metrics import reduce_window
from train.observe.perf import device_peak_flops, throughput
from train.optim.optimizer import set_lr
from train.optim.schedule import lr_at
from train.training.evaluate import Evaluator
from train.training.health import Health
from train.training.stop import StopRequested, StopVote
from train.training.window import StepResult, Window

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from models.workload import Workload
    from train.checkpoint.manager import Checkpointer
    from train.config import Batch, RunConfig
    from train.data.bundle import DataBundle
    from train.data.sampler import GlobalBatchSampler
    from train.strategy import Strategy
    from train.launch.distributed import Topology
    from train.launch.elastic import ElasticRun
    from train.launch.sequence_parallel import SPRun
    from train.observe.metrics import Loggers
    from train.observe.wandb_logger import WandbSink
    from train.plan.memory_plan import MemoryPlan


@dataclass(eq=False)
class _Loop:
    """What one fit() carries from step to step."""

    vote: StopVote
    cadence: SaveCadence
    memory_probe: MemoryReport     # measures one early step's model-state bytes (mem/* metrics)
    window: Window
    bar: object = None             # rank 0's tqdm bar with train.progress, else None
    last: dict = field(default_factory=dict)  # the last log line's metrics
    saved_at: Optional[int] = None  # the step the loop last saved (a stop at that step needs no second save)


@dataclass(eq=False, repr=False, kw_only=True)
class Trainer:
    """One run: start() -> fit() -> finish() -> close(). Every collaborator is a field below,
    passed in by build.py; the fields after them are the loop's own bookkeeping."""

    # -- what the run is
    cfg: RunConfig                        # the run config, read only
    resolved_config: dict                 # <run_dir>/config.json's content: also the W&B run's config
    topo: Topology                        # this rank, the world size, nodes, launcher, device
    strategy: Strategy                    # the backend: DDP or a ZeRO stage (train/strategy/), bound to the engine
    batch: Batch                          # micro x accum x world samples per optimizer step
    max_steps: int
    run_dir: Path
    # -- the distributed runtime and what it prepared
    acc: Accelerator                      # device, accumulate / backward / clip, gather, DDP's GradScaler
    model: torch.nn.Module                # accelerate.prepare's: a DeepSpeed engine, a DDP wrapper or the module
    optimizer: torch.optim.Optimizer      # accelerate.prepare's wrapper: steps and zeroes gradients under DDP
    raw_optimizer: torch.optim.Optimizer  # the torch optimizer inside it: its LR is set every step
    # -- the model's task and its data
    workload: Workload                    # loss, eval statistics, FLOPs per item of the model family
    data: DataBundle                      # the splits and what they hold (tokens per sample, decode)
    train_loader: DataLoader
    sampler: GlobalBatchSampler           # the resumable global data order, positioned from `state`
    val_loader: Optional[DataLoader]
    # -- services
    loggers: Loggers                      # metrics sinks: metrics.jsonl on rank 0, W&B added by start()
    checkpointer: Optional[Checkpointer]  # save / export; None: the run writes no checkpoint
    memory_plan: Optional[MemoryPlan]     # the run's one memory plan: banner lines, plan/* metrics
    # -- where training stands: saved in checkpoints; a resumed run passes the restored one
    state: TrainState
    # -- torchrun's elastic agent: this attempt of the job (restarts, membership); None otherwise
    elastic: Optional[ElasticRun] = None
    # -- distributed.sequence_parallel > 1: this rank's SP group (its slice of each row); None: off
    seq_parallel: Optional[SPRun] = None

    # -- the loop's own bookkeeping (not passed in)
    input_dtype: Optional[torch.dtype] = field(init=False)  # float inputs cast to it (Strategy.input_dtype)
    position: DataPosition = field(init=False)   # moves `state` through the data, yields the batches
    health: Health = field(init=False)           # non-finite steps, fp16 scale collapse: whether to stop
    evaluator: Evaluator = field(init=False)     # val/* metrics (train.eval_every), the closing sample text
    last_eval: dict = field(init=False, default_factory=dict)
    stop_reason: Optional[str] = field(init=False, default=None)       # None | "signal" | "diverged"
    wandb: Optional[WandbSink] = field(init=False, default=None)        # rank 0's W&B sink, once start() ran
    wandb_status: Optional[str] = field(init=False, default=None)      # rank 0's banner line about W&B
    start_counts: tuple = field(init=False, default=(0, 0, 0))         # (step, samples, tokens) at start()
    _t_start: float = field(init=False, default=0.0)
    _finished: bool = field(init=False, default=False)  # finish() completed: close() reports success to W&B

    def __post_init__(self):
        self.input_dtype = self.strategy.input_dtype()
        self.position = DataPosition(self.data, self.sampler, self.train_loader, self.batch.global_size)
        self.health = Health(train=self.cfg.train, strategy=self.strategy, is_main=self.acc.is_main_process)
        self.evaluator = Evaluator(cfg=self.cfg, acc=self.acc, model=self.model, workload=self.workload, data=self.data,
                                   val_loader=self.val_loader, seq_parallel=self.seq_parallel, cast=self._cast_inputs)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Trains to max_steps or a stop. Returns the last log line's metrics and evaluation."""
        st, loop = self.state, self._start_fit()
        with StopRequested() as signals:
            while st.step < self.max_steps:
                t_step = time.perf_counter()
                loop.memory_probe.before_step(st.step)
                out = self.train_step()
                # Every rank agrees on stopping (a signal may reach the ranks at different steps;
                # stopping alone would hang the others) and on rank 0's checkpoint.every_minutes
                # clock: an async vote, read one step later.
                agreed = loop.vote(signals.flag, loop.cadence.ticket())
                loop.window.add(out, self.batch.accum, time.perf_counter() - t_step)
                loop.memory_probe.after_step(st.step)
                done = st.step >= self.max_steps
                save = self.checkpointer is not None and loop.cadence.due(st.step, agreed.ticket, done) is not None
                log = st.step % self.cfg.logging.every_steps == 0 or done or agreed.stop
                # The interval's one read of device values (also before a checkpoint, whose state
                # counts the skipped steps).
                diverged = (log or save) and self.health.check(st)
                if log or diverged:
                    loop.last = self._log_window(loop.window, out, loop.bar)
                if self.evaluator.due(st.step, done):
                    self._evaluate_and_log()
                if save and not diverged:
                    self._save(loop)
                self._step_done(loop, signals)
                if agreed.stop or diverged:
                    self.stop_reason = "diverged" if diverged else "signal"
                    break
            if loop.vote.finish() and self.stop_reason is None:  # a signal during the last step
                self.stop_reason = "signal"
        return self._end_fit(loop)

    def _start_fit(self) -> _Loop:
        bar = None
        if self.acc.is_main_process and self.cfg.train.progress:
            from tqdm.auto import tqdm  # deferred: a run without a bar (log files, other ranks) skips its import
            bar = tqdm(total=self.max_steps, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True)
        window = Window(self.acc.device)
        self.model.train()
        if self.checkpointer:
            self.checkpointer.on_fit_start()  # a resumed run's RNG streams, right before the first step
        # Measured model-state bytes of one early step (mem/* metrics), next to the plan's.
        memory_probe = MemoryReport(acc=self.acc, model=self.model, raw_optimizer=self.raw_optimizer,
                                    step_target=self.strategy.step_target(), start_step=self.state.step,
                                    max_steps=self.max_steps, log=self.loggers.log,
                                    plan=self.memory_plan.estimate if self.memory_plan else None)
        vote = StopVote(self.acc)
        cadence = SaveCadence(self.cfg.checkpoint.every_steps, self.cfg.checkpoint.every_minutes,
                              self.acc.is_main_process)
        return _Loop(vote=vote, cadence=cadence, memory_probe=memory_probe, window=window, bar=bar)

    def _evaluate_and_log(self):
        self.last_eval = self.evaluator.run()
        if self.last_eval:
            self.loggers.log(self.last_eval, self.state.step)

    def _save(self, loop: _Loop):
        self.checkpointer.save(self.state)
        loop.cadence.saved()
        loop.saved_at = self.state.step

    def _step_done(self, loop: _Loop, signals: StopRequested):
        """After a step's log, eval and save: the progress bar, rank 0's elastic progress (what a
        restart counts as lost) and the test hooks (train/testhooks.py; nothing when unset)."""
        if loop.bar:
            loop.bar.update(1)
        if self.elastic:
            self.elastic.progress(self.state.step)
        testhooks.fire("after_step", step=self.state.step, rank=self.topo.rank, stop=signals,
                       elastic=self.elastic is not None)

    def _end_fit(self, loop: _Loop) -> dict:
        """After the loop: a run that reached max_steps evaluates; then the last checkpoint
        (checkpoint.save_at_end, or any stop) unless the loop has just written it."""
        if loop.bar:
            loop.bar.close()
        if self.stop_reason is None:
            self._evaluate_and_log()
        final_save = self.cfg.checkpoint.save_at_end or self.stop_reason is not None
        if self.checkpointer and final_save and loop.saved_at != self.state.step:
            # Signals are caught again while it saves: a SIGTERM now (another node's elastic
            # restart) waits for the save instead of killing it half-written.
            with StopRequested():
                self.checkpointer.save(self.state)
        return {**loop.last, **self.last_eval}

    def _log_window(self, w: Window, out: StepResult, bar) -> dict:
        red = reduce_window(self.acc, w.loss, w.micro, w.data_s)
        steps, elapsed = w.steps, w.train_s
        m = {"loss": red["loss"], "lr": out.lr, "epoch": self.state.epoch,
             **throughput(samples=self.batch.global_size * steps, seconds=elapsed,
                          items_per_sample=self.data.items_per_sample, flops_per_item=self.workload.flops_per_item,
                          world_size=self.topo.world_size,
                          peak_per_device=self.cfg.logging.peak_flops or device_peak_flops(), real_items=w.real),
             "step_time_s": elapsed / steps, "data_wait_s": red["data_wait_s"] / steps,
             "compute_s": (elapsed - red["data_wait_s"]) / steps,
             "samples_seen": self.state.samples_seen, "tokens_seen": self.state.tokens_seen,
             **{f"data/tokens/{name}": n for name, n in self.state.source_tokens.items()},
             "peak_mem_bytes": red["peak_mem_bytes"]}
        m.update(self.health.log_fields(self.state))  # grad_norm, loss_scale, skipped_steps
        if self.workload.moe is not None:  # loss/lm, loss/aux, tokens per expert (models/moe.py)
            moe_metrics, warnings = self.workload.moe.window(self.acc)
            m.update(moe_metrics)
            for line in warnings if self.acc.is_main_process else ():
                print(f"zerotrain: WARNING: {line}", flush=True)
        self.loggers.log(m, self.state.step)
        if bar:
            post = {"loss": f"{m['loss']:.4f}"}
            if "tokens_per_s" in m:
                post["tok/s"] = report.human(m["tokens_per_s"])
            bar.set_postfix(post, refresh=False)
        elif self.acc.is_main_process:  # no bar (train.progress false, e.g. log files): one line per interval
            print(report.progress_line(m, self.state.step, self.max_steps), flush=True)
        w.reset()
        return m

    # ------------------------------------------------------------------ one step
    def train_step(self) -> StepResult:
        acc, model = self.acc, self.model
        lr = lr_at(self.cfg.optim, self.state.step, self.max_steps)
        set_lr(self.raw_optimizer, lr)
        t_data = 0.0
        # Summed where it is computed: reading a loss is a host-device sync, so the trainer reads
        # its device values only at logging intervals (tests/test_sync_free.py counts).
        loss_sum = self._zero()
        grad_norm = None
        prefetched, denominator = [], None
        if self.data.masked_labels or self.seq_parallel is not None:
            # The step's micro-batches first: their labelled tokens, counted over every rank,
            # normalise the loss before the first backward (_token_denominator).
            t0 = time.perf_counter()
            prefetched = [self._next_batch() for _ in range(self.batch.accum)]
            t_data += time.perf_counter() - t0
            denominator = self._token_denominator(prefetched)
        for i in range(self.batch.accum):
            t0 = time.perf_counter()
            batch = prefetched[i] if prefetched else self._next_batch()
            t_data += time.perf_counter() - t0
            with acc.accumulate(model):
                loss = self.workload.loss(model, batch, denominator)
                if testhooks.fire("nan_loss", step=self.state.step + 1, rank=self.topo.rank):
                    loss = loss * float("nan")
                acc.backward(loss)
                if acc.sync_gradients:
                    # Clip, step and zero the gradients (DeepSpeed did the first two inside
                    # backward): the global norm stays on the device until the next health check.
                    grad_norm = self.strategy.step(self.cfg.train.grad_clip)
            # _log_window logs the mean over micro-batches and ranks: with a token denominator
            # that mean is the step's normalised loss, sum / global count.
            loss_sum += loss.detach().to(torch.float64)
        real = self.position.advance(self.state)
        self.state.step += 1
        self.health.record(self.state.step, grad_norm)
        return StepResult(loss_sum, lr, t_data, real)

    def _zero(self) -> torch.Tensor:
        """A loss accumulator on the device (read at log lines only)."""
        return torch.zeros((), dtype=torch.float64, device=self.acc.device)

    def _next_batch(self) -> dict:
        b = self.position.next_batch(self.state)
        if self.cfg.train.trace_data:
            self._trace(b)
        if self.seq_parallel is not None:
            b = self.seq_parallel.slice_batch(b)  # this rank's contiguous slice of each row
        return self._cast_inputs(b)

    def _cast_inputs(self, b: dict) -> dict:
        """Float inputs in the parameters' dtype where the strategy keeps the parameters themselves
        in 16 bits (DeepSpeed bf16/fp16)."""
        if self.input_dtype is None:
            return b
        return {k: v.to(self.input_dtype) if v.is_floating_point() else v for k, v in b.items()}

    def _trace(self, b):
        key = next(iter(b))
        rows = [zlib.crc32(t.cpu().numpy().tobytes()) for t in b[key]]
        path = self.run_dir / "ranks" / f"rank{self.topo.rank}.data.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({"step": self.state.step, "epoch": self.state.epoch, "crc": rows}) + "\n")

    def _token_denominator(self, batches: list[dict]) -> torch.Tensor:
        """What each micro-batch's summed token loss is divided by, so that the step's gradient
        is d(sum of every labelled token's loss / their number) over the whole global batch.

        Both engines average the micro-batch losses of a step: accelerate's backward divides the
        loss by the accumulation steps (DDP), DeepSpeed's engine.backward does it itself
        (scale_wrt_gas), and DDP / ZeRO average the gradients over the ranks. The gradient of a
        step is therefore mean over (micro-batch, rank) of d(loss); with loss = summed loss /
        (N / (accum x world)), N the step's global count of labelled tokens, it is d(sum / N).
        N costs one all-reduce of a scalar per step (on the device: no host read). Uniform data
        (every label counted, masked_labels false) keeps the per-micro-batch mean: the same number,
        since there N / (accum x world) is exactly the micro-batch's own count, without the
        collective. A step whose global batch has no labelled token divides by 1 (loss 0)."""
        count = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in batches]).sum()  # int64 scalar
        if self.acc.num_processes > 1 and process_group.exists():
            torch.distributed.all_reduce(count)
        return (count.clamp(min=1).to(torch.float64) / (self.batch.accum * self.acc.num_processes)).to(torch.float32)

    # ------------------------------------------------------------------ start / finish / close
    def start(self):
        # After build() restored the checkpoint state: a resumed run continues its W&B run.
        self.wandb, self.wandb_status = wandb_logger.start(self.acc, self.cfg, self.state, self.run_dir,
                                                           self.resolved_config)
        if self.wandb:
            self.loggers.sinks.append(self.wandb)
        if self.elastic:
            self.elastic.note_wandb(self.state.wandb_run_id)
        self._t_start = time.perf_counter()
        self.start_counts = (self.state.step, self.state.samples_seen, self.state.tokens_seen)
        if self.acc.is_main_process:
            # The full resolved config is <run_dir>/config.json (record.py); the banner names it.
            print(report.banner(self), flush=True)
            if self.elastic and self.elastic.event:  # a membership change: one line, one metrics/W&B row
                print(self.elastic.line, flush=True)
                self.loggers.event(self.elastic.event, self.state.step)

    def finish(self, result: dict):
        elapsed = time.perf_counter() - self._t_start
        sample = self.evaluator.sample_text() if self.stop_reason is None else None
        ckpt = self.checkpointer.latest_path() if self.checkpointer else None
        exported = None
        if self.checkpointer and self.cfg.checkpoint.export and self.stop_reason is None:
            exported = self.checkpointer.export()
        if self.acc.is_main_process:
            final = {"final/" + k: v for k, v in result.items() if not isinstance(v, str)}
            final["final/elapsed_s"] = elapsed
            if self.elastic:
                final["final/elastic_restarts"] = self.elastic.restarts
                final["final/steps_recomputed"] = self.elastic.steps_recomputed
            self.loggers.log(final, self.state.step)
            if self.wandb and self.stop_reason == "signal":
                self.wandb.mark_preempting()
            print(report.summary(self, result, elapsed, sample, exported, ckpt), flush=True)
        self._finished = True

    def close(self):
        if self.data.stream is not None:
            self.data.stream.close()  # its tokenizer pool, before the exit hooks join it (train/data/stream.py)
        self.loggers.close(failed=not self._finished or self.stop_reason == "diverged")
        if self.elastic:
            self.elastic.close()
        try:
            self.acc.end_training()
        finally:
            # Local for gloo (no collective), so safe after a failure on only some ranks too.
            if process_group.exists():
                torch.distributed.destroy_process_group()
