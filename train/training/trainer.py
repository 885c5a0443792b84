"""The training loop: accumulation, clipping, LR, evaluation, logging, stopping cleanly.

fit() reads as the loop it is: step, agree, then every component in turn
(train/training/components.py: health, the log line, evaluation, the checkpoint, progress and
test hooks), each deciding from the step's Tick whether the step is its own; the last step goes
through the same path. StopVote (train/training/stop.py) is what every rank agreed on,
SaveCadence (train/checkpoint/cadence.py) when to save, DataPosition (train/data/position.py)
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
from zerotrain.train.observe.metrics import reduce_window
from zerotrain.train.observe.perf import device_peak_flops, throughput
from zerotrain.train.optim.optimizer import set_lr
from zerotrain.train.optim.schedule import lr_at
from zerotrain.train.training.evaluate import Evaluator
from zerotrain.train.training.health import Health
from zerotrain.train.training import components as components_
from zerotrain.train.training.stop import NO_WRITES, NOTHING, StopRequested, StopVote
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


def _nothing(step: int) -> None:
    """A component without before_step."""


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
    val_loader: Optional[DataLoader]
    # -- services
    loggers: Loggers                      # logging.trackers on rank 0: metrics.jsonl, the others added by start()
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
    wandb: Optional[WandbTracker] = field(init=False, default=None)     # rank 0's W&B tracker, once start() ran
    tracker_lines: list = field(init=False, default_factory=list)      # rank 0's banner lines: where W&B, TensorBoard, MLflow log
    start_counts: tuple = field(init=False, default=(0, 0, 0))         # (step, samples, tokens) at start()
    peak_mem: int = field(init=False, default=0)  # the largest peak_mem_bytes logged (the worst rank's), for the summary
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
        self.health = Health(train=self.cfg.train, strategy=self.strategy, is_main=self.acc.is_main_process)
        self.evaluator = Evaluator(cfg=self.cfg, acc=self.acc, model=self.model, workload=self.workload, data=self.data,
                                   val_loader=self.val_loader, seq_parallel=self.seq_parallel, cast=self._cast_inputs)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        """Trains to max_steps or a stop: step, agree, then every component in turn (each decides
        from the Tick whether this step is its: train/training/components.py). Returns the last
        log line's metrics and evaluation."""
        self.model.train()
        if self.checkpointer:
            self.checkpointer.on_fit_start()  # a resumed run's RNG streams, right before the first step
        vote = StopVote(self.acc)
        cadence = SaveCadence(self.cfg.checkpoint.every_steps, self.cfg.checkpoint.every_minutes,
                              self.acc.is_main_process)
        testhooks.fire("slow_start", rank=self.topo.rank)  # tests: one rank comes late to its first step
        with StopRequested() as signals, self._progress_bar() as bar:
            components, log = self._components(cadence, bar, signals)
            tick = None
            while tick is None or not tick.last:
                for c in components:
                    getattr(c, "before_step", _nothing)(self.state.step)
                process_group.at("training step", self.state.step + 1)  # for a failed collective's message
                out = self.train_step() if self.state.step < self.max_steps else None
                tick = self._agree(out, vote, cadence, signals)
                for c in components:
                    c.on_step(tick)
            vote.finish()  # a stop before the last step leaves one vote in flight (every rank has one)
            self.stop_reason = tick.stop_reason
        return {**log.last, **self.last_eval}

    def _components(self, cadence: SaveCadence, bar, signals: StopRequested) -> tuple[list, components_.LogLine]:
        """The loop's components, in the order they see each step (components.py says why)."""
        window = Window(self.acc.device)
        # Measured model-state bytes of one early step (mem/* metrics), next to the plan's.
        report = MemoryReport(acc=self.acc, model=self.model, raw_optimizer=self.raw_optimizer,
                              step_target=self.strategy.step_target(), start_step=self.state.step,
                              max_steps=self.max_steps, log=self.loggers.log,
                              plan=self.memory_plan.estimate if self.memory_plan else None)
        log = components_.LogLine(self, window, bar)
        steps = [components_.StepTimer(window, self.batch.accum), components_.MemoryProbe(report),
                 components_.HealthCheck(self), log]
        if self.cfg.debug.param_checksum:  # before an evaluation's forward (ZeRO-3 leaves parameters in flight)
            steps.append(components_.ParamChecksum(self))
        steps.append(components_.Evaluation(self))
        if self.checkpointer is not None:
            steps.append(components_.Checkpointing(self, cadence))
        steps.append(components_.StepDone(self, bar, signals))
        if collectives.on():  # debug.collectives: its short timeout once the first step is done
            steps.insert(0, collectives.FirstStepDone())
        return steps, log

    def _agree(self, out, vote: StopVote, cadence: SaveCadence, signals: StopRequested) -> components_.Tick:
        """What every rank decides about the step just taken. Every rank agrees on stopping (a
        signal may reach the ranks at different steps; stopping alone would hang the others) and
        on rank 0's checkpoint.every_minutes clock: an async vote, read one step later. The last
        step also collects the vote still in flight (a signal during that step). The vote also
        carries each rank's state of an asynchronous checkpoint write (checkpoint.async): the
        checkpointer commits it once every rank's write is durable."""
        step = self.state.step
        writes = self.checkpointer.write_status() if self.checkpointer else NO_WRITES
        process_group.at("stop vote", step)
        agreed = vote(signals.flag, cadence.ticket(), writes, step=step) if out is not None else NOTHING
        done = step >= self.max_steps
        if done or agreed.stop:
            agreed = agreed._replace(stop=vote.finish() or agreed.stop)
        save = self.checkpointer is not None and cadence.due(step, agreed.ticket, done) is not None
        log = step % self.cfg.logging.every_steps == 0 or done or agreed.stop
        return components_.Tick(step=step, out=out, agreed=agreed, done=done, save_due=save, log_due=log)

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
        self.peak_mem = max(self.peak_mem, red["peak_mem_bytes"])
        m.update(self.health.log_fields(self.state.skipped_steps))  # grad_norm, loss_scale, skipped_steps
        self.state.skipped_steps = m["skipped_steps"]  # the engine's own count, where it keeps one
        if self.workload.moe is not None:  # loss/lm, loss/aux, tokens per expert (models/moe.py)
            moe_metrics, warnings = self.workload.moe.window(self.acc)
            m.update(moe_metrics)
            for line in warnings if self.acc.is_main_process else ():
                print(f"zerotrain: WARNING: {line}", flush=True)
        if self.workload.preference is not None:  # rewards/*, logps/* under TRL's names (models/preference.py)
            m.update(self.workload.preference.window(self.acc))
        self.loggers.log(m, self.state.step)
        if bar:
            post = {"loss": f"{m['loss']:.4f}"}
            if "tokens_per_s" in m:
                post["tok/s"] = report.human(m["tokens_per_s"])
            bar.set_postfix(post, refresh=False)
        elif self.acc.is_main_process:  # no bar (logging.progress false, e.g. log files): one line per interval
            print(report.progress_line(m, self.state.step, self.max_steps), flush=True)
        w.reset()
        return m

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
        return StepResult(loss_sum, lr, t_data, real)

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
        self.wandb, self.tracker_lines, self.state.wandb_run_id = trackers.start(
            self.acc, self.cfg, self.loggers, self.state.wandb_run_id, self.run_dir, self.resolved_config)
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
                self.loggers.submit(self.wandb.mark_preempting)
            print(report.summary(self, result, elapsed, sample, exported, ckpt), flush=True)
        self._finished = True

    def close(self):
        if self.checkpointer is not None:
            self.checkpointer.close()  # checkpoint.async: the write in flight ends before the process does
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
