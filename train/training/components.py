"""The loop's own components: each decides its own cadence from the step it is shown (a Tick,
train/training/tick.py), is handed only what it works with (never the Trainer), and owns its
state, so Trainer.fit() is: step, agree, then every component in turn. The last step (max_steps,
or a stop) goes through the same path as every other: its evaluation and its checkpoint are
these components' decisions at that step, not a separate ending.

A component is any object with `on_step(tick)`. Optional: `before_step(step)` (the memory probe
arms its hooks there), `vote()` (numbers every rank must agree on, summed over the ranks and read
back one step later as `tick.agreed(self)`), `after_last(tick)` (once, after the last step's
components all ran). Features (EMA, early stopping) are components too, built with the services
before the resume (train/training/features.py) so that their state comes back.

Order matters where one decision reads another's: Health reads the interval's device values
first (a diverged step is logged, not saved as a periodic checkpoint, and ends the run), then
the log line, the evaluation, the features, the checkpoint, and last the progress bar, elastic
progress and the test hooks.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

from zerotrain.train import process_group, testhooks
from zerotrain.train.errors import CheckpointError, TrainingDiverged
from zerotrain.train.observe import report
from zerotrain.train.observe.metrics import reduce_window
from zerotrain.train.observe.perf import device_peak_flops, throughput
from zerotrain.train.training.tick import StopReason

if TYPE_CHECKING:
    from zerotrain.train.checkpoint.cadence import SaveCadence
    from zerotrain.train.training.tick import StopRequested
    from zerotrain.train.training.tick import Tick


class HealthCheck:
    """Health (train/training/health.py) reads the interval's gradient norms and fp16 scales in
    one transfer where the step already reads device values: where any of `reads` is due (the
    log line, a checkpoint, whose state counts the skipped steps). Between them, nothing is read
    (tests/test_sync_free.py). Divergence is decided from the global norm, the same on every
    rank: a stop at this step."""

    name = "health"

    def __init__(self, health, reads: list[Callable]):
        self.health, self.reads = health, reads

    def on_step(self, tick: Tick) -> None:
        if any(due(tick) for due in self.reads) and self.health.read_interval():
            tick.stop(StopReason("diverged", self.health.diverged_reason, failure=TrainingDiverged))


class LogLine:
    """The metrics of a logging interval (loss, LR, throughput, memory, health) at
    logging.every_steps, at the last step and at a stop or a divergence."""

    name = "log"

    def __init__(self, *, window, bar, acc, every_steps: int, global_batch: int, max_steps: int, data, workload,
                 world_size: int, peak_flops, health, log: Callable[[dict, int], None]):
        self.window, self.bar, self.acc, self.every = window, bar, acc, every_steps
        self.global_batch, self.max_steps, self.data, self.workload = global_batch, max_steps, data, workload
        self.world_size, self.peak_flops, self.health, self.log = world_size, peak_flops, health, log
        self.last: dict = {}          # the last log line's metrics (fit() returns them)
        self.peak_mem = 0             # the largest peak_mem_bytes logged (the worst rank's), for the summary

    def due(self, tick: Tick) -> bool:
        return tick.step % self.every == 0 or tick.last

    def on_step(self, tick: Tick) -> None:
        if self.due(tick) and self.window.steps:
            process_group.at("log line", tick.step)
            self.last = self.write(tick)

    def after_last(self, tick: Tick) -> None:
        """A stop decided after this component ran (early stopping at an evaluation): the
        interval's steps still get their line."""
        self.on_step(tick)

    def write(self, tick: Tick) -> dict:
        w, st = self.window, tick.state
        red = reduce_window(self.acc, w.loss, w.micro, w.data_s, w.positions)
        steps, elapsed = w.steps, w.train_s
        m = {"loss": red["loss"], "lr": tick.out.lr, "epoch": st.epoch,
             **throughput(samples=self.global_batch * steps, seconds=elapsed,
                          items_per_sample=self.data.items_per_sample, flops_per_item=self.workload.flops_per_item,
                          world_size=self.world_size, peak_per_device=self.peak_flops or device_peak_flops(),
                          real_items=w.real, built_items=red["positions"] or None),
             "step_time_s": elapsed / steps, "data_wait_s": red["data_wait_s"] / steps,
             "compute_s": (elapsed - red["data_wait_s"]) / steps,
             "samples_seen": st.samples_seen, "tokens_seen": st.tokens_seen,
             **{f"data/tokens/{name}": n for name, n in st.source_tokens.items()},
             "peak_mem_bytes": red["peak_mem_bytes"]}
        self.peak_mem = max(self.peak_mem, red["peak_mem_bytes"])
        m.update(self.health.log_fields())  # grad_norm, loss_scale, skipped_steps
        if self.workload.moe is not None:  # loss/lm, loss/aux, tokens per expert (models/moe.py)
            moe_metrics, warnings = self.workload.moe.window(self.acc)
            m.update(moe_metrics)
            for line in warnings if self.acc.is_main_process else ():
                print(f"zerotrain: WARNING: {line}", flush=True)
        if self.workload.preference is not None:  # rewards/*, logps/* under TRL's names (models/preference.py)
            m.update(self.workload.preference.window(self.acc))
        self.log(m, tick.step)
        if self.bar:
            post = {"loss": f"{m['loss']:.4f}"}
            if "tokens_per_s" in m:
                post["tok/s"] = report.human(m["tokens_per_s"])
            self.bar.set_postfix(post, refresh=False)
        elif self.acc.is_main_process:  # no bar (logging.progress false, e.g. log files): one line per interval
            print(report.progress_line(m, tick.step, self.max_steps), flush=True)
        w.reset()
        return m


class Evaluation:
    """val/* at train.eval_every, and once at the end of a run that completed (not at a stop
    that pauses it)."""

    name = "evaluation"

    def __init__(self, evaluator, rank: int):
        self.evaluator, self.rank = evaluator, rank
        self.last: dict = {}          # the last evaluation's metrics

    def due(self, tick: Tick) -> bool:
        return self.evaluator.due(tick.step, tick.done) or tick.completed

    def on_step(self, tick: Tick) -> None:
        # desync_eval: a test's evaluation on one rank only (train/testhooks.py)
        if self.due(tick) or testhooks.fire("desync_eval", step=tick.step, rank=self.rank):
            process_group.at("evaluation", tick.step)
            self.last = self.evaluator.run()
            tick.add_metrics(self.last)


class Checkpointing:
    """checkpoint.every_steps / every_minutes (SaveCadence: the same step on every rank, rank 0's
    clock agreed through the vote), and at the last step checkpoint.save_at_end or any stop,
    once: a diverged run saves its last good state (its skipped steps never touched the
    weights), not a periodic checkpoint. With checkpoint.async a save's write runs on in the
    background: each step the vote says whether every rank's write has ended (then rank 0
    commits it), and the last step waits for it, so the run (a stop included) ends with its
    checkpoint complete. `snapshot()`: the TrainState to save."""

    name = "checkpoint"

    def __init__(self, checkpointer, cadence: SaveCadence, save_at_end: bool, snapshot: Callable, rank: int):
        self.ckpt, self.cadence, self.save_at_end, self.snapshot, self.rank = (
            checkpointer, cadence, save_at_end, snapshot, rank)

    def vote(self) -> tuple:
        """Rank 0's every_minutes ticket and this rank's state of the write in flight."""
        return (self.cadence.ticket(), *self.ckpt.write_status())

    def due(self, tick: Tick) -> bool:
        """A periodic save at this step (not the last: see on_step)."""
        return self.cadence.due(tick.step, tick.agreed(self)[0], tick.done) is not None

    def on_step(self, tick: Tick) -> None:
        periodic = self.due(tick) and tick.stop_reason is None
        final = tick.last and (self.save_at_end or tick.stop_reason is not None)
        self.ckpt.poll(tick.agreed(self)[1:], tick.step, last=tick.last and not (periodic or final))
        try:
            if periodic or final or testhooks.fire("desync_save", step=tick.step, rank=self.rank):
                process_group.at("save", tick.step)  # desync_save: a test's save on one rank only
                self.ckpt.save(self.snapshot())
            if periodic:
                self.cadence.saved()
            lost = self.ckpt.unsaved_at_end(tick.step) if tick.last else None
        except CheckpointError as e:
            if not tick.last:
                raise  # a synchronous save mid-run: the run stops here, its error says why
            lost = self.ckpt.lost_line(str(e), tick.step)  # every rank raised (Checkpointer._on_every_rank)
        if lost is not None:
            # The run must not end as a success over a lost save: a failure stop (summary, exit 2).
            tick.stop(StopReason("save_failed", lost, failure=CheckpointError))


class ParamChecksum:
    """debug.param_checksum: every step, the parameters' checksum as the step left it
    (Strategy.param_checksum), logged as debug/param_checksum and its scale
    debug/param_checksum_sq next to the step's loss and grad_norm, and what the steps changed:
    debug/update_checksum, the checksum of theta_t - theta_0 (the checksum is linear: this step's
    less the one before step 1), and in a 1-process run (it keeps a host copy of the weights
    before step 1) debug/update_sq, that update's own scale. Before step 1, rank 0 writes the
    optimizer's parameter groups to <run_dir>/param_groups.json (Strategy.param_groups).
    `zerotrain verify` reads them all."""

    name = "param_checksum"

    def __init__(self, strategy, world: int, run_dir, is_main: bool):
        self.strategy, self.run_dir, self.is_main = strategy, run_dir, is_main
        self.origin: list | None = [] if world == 1 else None
        self.start: float | None = None

    def before_step(self, step: int) -> None:
        if self.start is not None:
            return
        self.start = self.strategy.param_checksum(self.origin)[0]  # every rank: a gather under ZeRO-3
        if self.is_main:
            import json
            from pathlib import Path
            Path(self.run_dir, "param_groups.json").write_text(
                json.dumps({"step": step, "groups": self.strategy.param_groups()}, indent=1) + "\n")

    def on_step(self, tick: Tick) -> None:
        if tick.out is None:
            return
        value, sq, moved = self.strategy.param_checksum(self.origin)  # every rank: a gather under ZeRO-3
        tick.add_metrics({"debug/param_checksum": value, "debug/param_checksum_sq": sq,
                          "debug/update_checksum": value - self.start,
                          **({"debug/update_sq": moved} if self.origin is not None else {})})


class StepDone:
    """After a step's log, eval and save: the progress bar, rank 0's elastic progress (what a
    restart counts as lost) and the test hooks (train/testhooks.py; nothing when unset)."""

    name = "step_done"

    def __init__(self, bar, elastic, rank: int, signals: StopRequested):
        self.bar, self.elastic, self.rank, self.signals = bar, elastic, rank, signals

    def on_step(self, tick: Tick) -> None:
        if tick.out is None:
            return
        if self.bar:
            self.bar.update(1)
        if self.elastic:
            self.elastic.progress(tick.step)
        testhooks.fire("after_step", step=tick.step, rank=self.rank, stop=self.signals,
                       elastic=self.elastic is not None)


class StepTimer:
    """The step's wall time and result into the logging interval's Window (before anything
    else: evaluation and checkpoint pauses are not step time)."""

    name = "step_timer"

    def __init__(self, window, accum: int):
        self.window, self.accum, self.t0 = window, accum, 0.0

    def before_step(self, step: int) -> None:
        self.t0 = time.perf_counter()

    def on_step(self, tick: Tick) -> None:
        if tick.out is not None:
            self.window.add(tick.out, self.accum, time.perf_counter() - self.t0)


class MemoryProbe:
    """Measures one early step's model-state bytes (train/observe/memory.py MemoryReport: the
    mem/* metrics next to the plan's)."""

    name = "memory_probe"

    def __init__(self, report):
        self.report = report

    def before_step(self, step: int) -> None:
        self.report.before_step(step)

    def on_step(self, tick: Tick) -> None:
        if tick.out is not None:
            self.report.after_step(tick.step)
