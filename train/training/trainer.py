"""The training loop: accumulation, clipping, LR, evaluation, logging, stopping cleanly.

fit() reads as the loop it is: step, agree, then every component in turn
(train/training/components.py: health, the log line, evaluation, the run's features, the
checkpoint, progress and test hooks), each deciding from the step's Tick whether the step is its
own; the last step goes through the same path. LoopControl (train/training/tick.py) makes the
Tick, the one place that says what every rank agreed; DataPosition (train/data/position.py)
where the data stands, Window (train/training/window.py) the statistics of one logging interval.

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

import contextlib
import json
import time
import zlib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from zerotrain.models.losses import IGNORE_INDEX
from zerotrain.train import process_group, testhooks
from zerotrain.train.checkpoint.cadence import SaveCadence
from zerotrain.train.checkpoint.state import TrainState
from zerotrain.train.data.position import DataPosition
from zerotrain.train.launch import collectives
from zerotrain.train.observe import report, trackers
from zerotrain.train.observe.memory import MemoryReport
from zerotrain.train.optim.optimizer import set_lr
from zerotrain.train.optim.schedule import lr_at
from zerotrain.train.training.evaluate import Evaluator, cast_floats
from zerotrain.train.training.health import Health
from zerotrain.train.training import components as components_
from zerotrain.train.training.tick import LoopControl, StopReason, StopRequested
from zerotrain.train.training.window import StepResult, Window

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from zerotrain.models.workload import Workload
    from zerotrain.train.checkpoint.manager import Checkpointer
    from zerotrain.train.config import Batch, RunConfig
    from zerotrain.train.data.bundle import DataBundle
    from zerotrain.train.data.sampler import GlobalBatchSampler
    from zerotrain.train.strategy import Strategy
    from zerotrain.train.launch.distributed import Topology
    from zerotrain.train.launch.elastic import ElasticRun
    from zerotrain.train.launch.sequence_parallel import SPRun
    from zerotrain.train.observe.metrics import Loggers
    from zerotrain.train.observe.wandb_logger import WandbTracker
    from zerotrain.train.plan.memory_plan import MemoryPlan


def _nothing(_) -> None:
    """An optional component hook (before_step, after_last) the component does not have."""


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
    # -- the model's task and its data
    workload: Workload                    # loss, eval statistics, FLOPs per item of the model family
    data: DataBundle                      # the splits and what they hold (tokens per sample, decode)
    train_loader: DataLoader
    sampler: GlobalBatchSampler           # the resumable global data order, positioned from `state`
    # -- services
    loggers: Loggers                      # logging.trackers on rank 0: metrics.jsonl, the others added by start()
    checkpointer: Optional[Checkpointer]  # save / export; None: the run writes no checkpoint
    memory_plan: Optional[MemoryPlan]     # the run's one memory plan: banner lines, plan/* metrics
    evaluator: Evaluator                  # val/* metrics (train.eval_every), the closing sample text
    # -- where training stands: saved in checkpoints; a resumed run passes the restored one
    state: TrainState
    # -- the run's features (train/training/features.py): components built with the services,
    #    before the resume, registered with the checkpointer
    features: list = field(default_factory=list)
    # -- torchrun's elastic agent: this attempt of the job (restarts, membership); None otherwise
    elastic: Optional[ElasticRun] = None
    # -- distributed.sequence_parallel > 1: this rank's SP group (its slice of each row); None: off
    seq_parallel: Optional[SPRun] = None

    # -- the loop's own bookkeeping (not passed in)
    input_dtype: Optional[torch.dtype] = field(init=False)  # float inputs cast to it (Strategy.input_dtype)
    position: DataPosition = field(init=False)   # moves `state` through the data, yields the batches
    health: Health = field(init=False)           # non-finite steps, fp16 scale collapse: whether to stop
    evaluation: components_.Evaluation = field(init=False)  # its last metrics (fit() returns them)
    log: Optional[components_.LogLine] = field(init=False, default=None)  # the log line, once fit() runs
    stop: Optional[StopReason] = field(init=False, default=None)  # why the run ended before max_steps
    wandb: Optional[WandbTracker] = field(init=False, default=None)     # rank 0's W&B tracker, once start() ran
    tracker_lines: list = field(init=False, default_factory=list)      # rank 0's banner lines: where W&B, TensorBoard, MLflow log
    start_counts: tuple = field(init=False, default=(0, 0, 0))         # (step, samples, tokens) at start()
    _t_start: float = field(init=False, default=0.0)
    _finished: bool = field(init=False, default=False)  # finish() completed: close() reports success to W&B

    # -- the distributed runtime and what it prepared: the strategy's (Strategy.prepare)
    @property
    def acc(self) -> Accelerator:
        """Device, accumulate, gather; DDP's GradScaler."""
        return self.strategy.acc

    @property
    def model(self) -> torch.nn.Module:
        """accelerate.prepare's: a DeepSpeed engine, a DDP wrapper or the module."""
        return self.strategy.engine

    @property
    def raw_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer: its LR is set every step."""
        return self.strategy.raw_optimizer

    def __post_init__(self):
        self.input_dtype = self.strategy.input_dtype()
        self.position = DataPosition(self.data, self.sampler, self.train_loader, self.batch.global_size)
        self.health = Health(train=self.cfg.train, strategy=self.strategy, is_main=self.acc.is_main_process,
                             skipped=self.state.skipped_steps)
        self.evaluation = components_.Evaluation(self.evaluator, self.topo.rank)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Trains to max_steps or a stop: step, agree (LoopControl makes the step's Tick), then
        every component in turn, each deciding from the Tick whether this step is its. Returns
        the last log line's metrics and evaluation."""
        self.model.train()
        if self.checkpointer:
            self.checkpointer.on_fit_start()  # a resumed run's RNG streams, right before the first step
        with StopRequested() as signals, self._progress_bar() as bar:
            components = self._components(bar, signals)
            control = LoopControl(self.acc, components, signals, self.max_steps, self.loggers.log)
            testhooks.fire("slow_start", rank=self.topo.rank)  # tests: one rank comes late to its first step
            tick = None
            while tick is None or not tick.last:
                for c in components:
                    getattr(c, "before_step", _nothing)(self.state.step)
                process_group.at("training step", self.state.step + 1)  # for a failed collective's message
                out = self.train_step() if self.state.step < self.max_steps else None
                tick = control.agree(self.state.step, out, self.state)
                for c in components:
                    c.on_step(tick)
            control.finish()
            for c in components:
                getattr(c, "after_last", _nothing)(tick)
            self.stop = tick.stop_reason
        self.state = self.snapshot()
        if self.stop is not None:  # why the run ended early: a row of its own in every tracker
            self.loggers.event({"stop/reason": self.stop.name, "stop/message": self.stop.message}, self.state.step)
        return {**self.log.last, **self.evaluation.last}

    def _components(self, bar, signals: StopRequested) -> list:
        """The loop's components, in the order they see each step (components.py says why), with
        the run's features (train/training/features.py) after the evaluation."""
        window = Window(self.acc.device)
        # Measured model-state bytes of one early step (mem/* metrics), next to the plan's.
        report = MemoryReport(acc=self.acc, model=self.model, raw_optimizer=self.raw_optimizer,
                              step_target=self.strategy.step_target(), measure=self.strategy.measure_model_states,
                              start_step=self.state.step,
                              max_steps=self.max_steps, log=self.loggers.log,
                              plan=self.memory_plan.estimate if self.memory_plan else None)
        self.log = components_.LogLine(
            window=window, bar=bar, acc=self.acc, every_steps=self.cfg.logging.every_steps,
            global_batch=self.batch.global_size, max_steps=self.max_steps, data=self.data, workload=self.workload,
            world_size=self.topo.world_size, peak_flops=self.cfg.logging.peak_flops, health=self.health,
            log=self.loggers.log)
        save = None
        if self.checkpointer is not None:
            cadence = SaveCadence(self.cfg.checkpoint.every_steps, self.cfg.checkpoint.every_minutes,
                                  self.acc.is_main_process)
            save = components_.Checkpointing(self.checkpointer, cadence, self.cfg.checkpoint.save_at_end,
                                             self.snapshot, self.topo.rank)
        reads = [self.log.due] + ([save.due] if save else [])
        steps = [components_.StepTimer(window, self.batch.accum), components_.MemoryProbe(report),
                 components_.HealthCheck(self.health, reads), self.log]
        if self.cfg.debug.param_checksum:  # before an evaluation's forward (ZeRO-3 leaves parameters in flight)
            steps.append(components_.ParamChecksum(self.strategy, self.topo.world_size, self.run_dir,
                                                      self.acc.is_main_process))
        steps.append(self.evaluation)
        steps.extend(self.features)
        if save is not None:
            steps.append(save)
        steps.append(components_.StepDone(bar, self.elastic, self.topo.rank, signals))
        if collectives.on():  # debug.collectives: its short timeout once the first step is done
            steps.insert(0, collectives.FirstStepDone())
        return steps

    def snapshot(self) -> TrainState:
        """Where training stands now, as a checkpoint saves it: the run's state with Health's
        count of skipped steps."""
        return replace(self.state, skipped_steps=self.health.skipped)

    @contextlib.contextmanager
    def _progress_bar(self):
        """Rank 0's tqdm bar with logging.progress, else None."""
        if not (self.acc.is_main_process and self.cfg.logging.progress):
            yield None
            return
        from tqdm.auto import tqdm  # deferred: a run without a bar (log files, other ranks) skips its import
        bar = tqdm(total=self.max_steps, initial=self.state.step, desc="train", unit="step", dynamic_ncols=True)
        try:
            yield bar
        finally:
            bar.close()

    # ------------------------------------------------------------------ one step
    def train_step(self) -> StepResult:
        acc, model = self.acc, self.model
        ahead = testhooks.fire("plant_lr_ahead", world=self.topo.world_size)  # a planted bug (zerotrain verify's tests)
        lr = lr_at(self.cfg.optim, self.state.step + (1 if ahead else 0), self.max_steps)
        set_lr(self.raw_optimizer, lr)
        t_data = 0.0
        # Summed where it is computed: reading a loss is a host-device sync, so the trainer reads
        # its device values only at logging intervals (tests/test_sync_free.py counts).
        loss_sum = self._zero()
        grad_norm = None
        positions = 0  # token positions this rank's forwards run on (the batches as built)
        prefetched, denominator = [], None
        token_count = self.data.masked_labels or self.seq_parallel is not None
        if token_count or self.cfg.debug.reverse_micro_batches:
            # The step's micro-batches first: their labelled tokens, counted over every rank,
            # normalise the loss before the first backward (_token_denominator).
            t0 = time.perf_counter()
            prefetched = [self._next_batch() for _ in range(self.batch.accum)]
            t_data += time.perf_counter() - t0
            if token_count:
                denominator = self._token_denominator(prefetched)
            if self.cfg.debug.reverse_micro_batches:  # zerotrain verify's rounding floor: another summation order
                prefetched.reverse()
        for i in range(self.batch.accum):
            t0 = time.perf_counter()
            batch = prefetched[i] if prefetched else self._next_batch()
            t_data += time.perf_counter() - t0
            with acc.accumulate(model):
                loss = self.workload.loss(model, batch, denominator)
                positions += self.workload.positions(batch)
                if testhooks.fire("nan_loss", step=self.state.step + 1, rank=self.topo.rank):
                    loss = loss * float("nan")
                self.strategy.backward(loss)
                if acc.sync_gradients:
                    # Clip, step and zero the gradients (DeepSpeed did the first two inside
                    # backward): the global norm stays on the device until the next health check.
                    grad_norm = self.strategy.step(self.cfg.train.grad_clip)
            # _log_window logs the mean over micro-batches and ranks: with a token denominator
            # that mean is the step's normalised loss, sum / global count.
            loss_sum += loss.detach().to(torch.float64)
        testhooks.fire("desync_extra_allreduce", step=self.state.step + 1, rank=self.topo.rank)  # tests: one rank only
        moved, real = self.position.advance(self.state)
        self.state = replace(moved, step=moved.step + 1)
        self.health.record(self.state.step, grad_norm)
        return StepResult(loss_sum, lr, t_data, real, positions)

    def _zero(self) -> torch.Tensor:
        """A loss accumulator on the device (read at log lines only)."""
        return torch.zeros((), dtype=torch.float64, device=self.acc.device)

    def _next_batch(self) -> dict:
        testhooks.fire("desync_stuck_loader", step=self.state.step + 1, rank=self.topo.rank)  # tests: sleeps forever
        b = self.position.next_batch(self.state)
        if self.cfg.debug.trace_data:
            self._trace(b)
        if self.seq_parallel is not None:
            b = self.seq_parallel.slice_batch(b)  # this rank's contiguous slice of each row
        return cast_floats(b, self.input_dtype)

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
        # After build() restored the checkpoint state: a resumed run continues its W&B and MLflow runs.
        self.wandb, self.tracker_lines, self.state.wandb_run_id, self.state.mlflow_run_id = trackers.start(
            self.acc, self.cfg, self.loggers, self.state.wandb_run_id, self.run_dir, self.resolved_config,
            self.state.mlflow_run_id)
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
        process_group.at("end of training", self.state.step)
        elapsed = time.perf_counter() - self._t_start
        completed = self.stop is None or self.stop.final
        sample = self.evaluator.sample_text() if completed else None
        ckpt = self.checkpointer.latest_path() if self.checkpointer else None
        exported = None
        if self.checkpointer and self.cfg.checkpoint.export and completed:
            with contextlib.ExitStack() as weights:  # a feature may choose the weights exported (train.ema)
                for c in self.features:
                    if hasattr(c, "exporting"):
                        weights.enter_context(c.exporting())
                exported = self.checkpointer.export()
        if self.acc.is_main_process:
            final = {"final/" + k: v for k, v in result.items() if not isinstance(v, str)}
            final["final/elapsed_s"] = elapsed
            if self.elastic:
                final["final/elastic_restarts"] = self.elastic.restarts
                final["final/steps_recomputed"] = self.elastic.steps_recomputed
            self.loggers.log(final, self.state.step)
            if self.wandb and self.stop is not None and not self.stop.final and self.stop.failure is None:
                # a pause (a signal): W&B marks the run preempted, to be resumed
                self.loggers.submit(self.wandb.mark_preempting)
            print(report.summary(self, result, elapsed, sample, exported, ckpt), flush=True)
        self._finished = True

    def close(self):
        if self.checkpointer is not None:
            self.checkpointer.close()  # checkpoint.async: the write in flight ends before the process does
        if self.data.stream is not None:
            self.data.stream.close()  # its tokenizer pool, before the exit hooks join it (train/data/stream.py)
        self.loggers.close(failed=not self._finished or (self.stop is not None and self.stop.failure is not None))
        if self.elastic:
            self.elastic.close()
        try:
            self.acc.end_training()
        finally:
            # Local for gloo (no collective), so safe after a failure on only some ranks too.
            if process_group.exists():
                torch.distributed.destroy_process_group()
