"""The loop's components: each decides its own cadence from the step it is shown (`Tick`) and
owns its state, so Trainer.fit() is: step, agree, then every component in turn. The last step
(max_steps, or a stop every rank agreed on) goes through the same path as every other: its
evaluation and its checkpoint are these components' decisions at that step, not a separate
ending.

A component is any object with `on_step(tick)`; `before_step(step)` is optional (the memory
probe arms its hooks there). Adding a per-step feature is one class here (or anywhere) and one
line in Trainer._components. Order matters where one decision reads another's: Health reads
the interval's device values first (a diverged step is logged, not saved as a periodic
checkpoint, and ends the run), then the log line, the evaluation, the checkpoint, and last the
progress bar, elastic progress and the test hooks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from zerotrain.train import process_group, testhooks

if TYPE_CHECKING:
    from zerotrain.train.checkpoint.cadence import SaveCadence
    from zerotrain.train.training.stop import Agreed, StopRequested
    from zerotrain.train.training.window import StepResult


@dataclass(eq=False)
class Tick:
    """One optimizer step as every component sees it: decided once, before any component runs
    (what the cadences agree on), then what Health found."""

    step: int                   # optimizer steps completed
    out: Optional[StepResult]   # the step's result (None: a resumed run already at max_steps ran no step)
    agreed: Agreed              # what every rank voted: stop (a signal somewhere), rank 0's save ticket
    done: bool                  # max_steps reached
    save_due: bool              # checkpoint.every_steps / every_minutes (not at the last step: see `last`)
    log_due: bool               # logging.every_steps, the last step, or a stop
    diverged: bool = False      # Health: too many non-finite steps (set before the log line)

    @property
    def stop_reason(self) -> Optional[str]:
        """None | "signal" | "diverged": why the run ends early at this step."""
        return "diverged" if self.diverged else "signal" if self.agreed.stop else None

    @property
    def last(self) -> bool:
        """The run's last step: max_steps, or a stop."""
        return self.done or self.stop_reason is not None

    @property
    def completed(self) -> bool:
        """The run reached max_steps with no stop: it evaluates and exports at the end."""
        return self.done and self.stop_reason is None


class HealthCheck:
    """Health (train/training/health.py) reads the interval's gradient norms and fp16 scales in
    one transfer where the step already reads device values: at a log line or a checkpoint
    (whose state counts the skipped steps). Between them, nothing is read (tests/test_sync_free.py)."""

    def __init__(self, trainer):
        self.t = trainer

    def on_step(self, tick: Tick) -> None:
        if tick.log_due or tick.save_due:
            tick.diverged, self.t.state.skipped_steps = self.t.health.read_interval(self.t.state.skipped_steps)


class LogLine:
    """The metrics of a logging interval (loss, LR, throughput, memory, health) at
    logging.every_steps, at the last step and at a stop or a divergence."""

    def __init__(self, trainer, window, bar):
        self.t, self.window, self.bar = trainer, window, bar
        self.last: dict = {}          # the last log line's metrics (fit() returns them)

    def on_step(self, tick: Tick) -> None:
        if (tick.log_due or tick.diverged) and self.window.steps:
            process_group.at("log line", tick.step)
            self.last = self.t._log_window(self.window, tick.out, self.bar)


class Evaluation:
    """val/* at train.eval_every, and once at the end of a run that completed (not at a stop)."""

    def __init__(self, trainer):
        self.t = trainer

    def on_step(self, tick: Tick) -> None:
        # desync_eval: a test's evaluation on one rank only (train/testhooks.py)
        if self.t.evaluator.due(tick.step, tick.done) or tick.completed \
                or testhooks.fire("desync_eval", step=tick.step, rank=self.t.topo.rank):
            process_group.at("evaluation", tick.step)
            self.t.last_eval = self.t.evaluator.run()
            if self.t.last_eval:
                self.t.loggers.log(self.t.last_eval, tick.step)


class Checkpointing:
    """checkpoint.every_steps / every_minutes (SaveCadence: the same step on every rank), and at
    the last step checkpoint.save_at_end or any stop, once: a diverged run saves its last good
    state (its skipped steps never touched the weights), not a periodic checkpoint.
    With checkpoint.async a save's write runs on in the background: each step the vote says
    whether every rank's write has ended (then rank 0 commits it), and the last step waits for
    it, so the run (a stop included) ends with its checkpoint complete."""

    def __init__(self, trainer, cadence: SaveCadence):
        self.t, self.cadence = trainer, cadence

    def on_step(self, tick: Tick) -> None:
        ckpt = self.t.checkpointer
        ckpt.poll(tick.agreed.writes, tick.step)
        periodic = tick.save_due and not tick.diverged
        final = tick.last and (self.t.cfg.checkpoint.save_at_end or tick.stop_reason is not None)
        if periodic or final or testhooks.fire("desync_save", step=tick.step, rank=self.t.topo.rank):
            process_group.at("save", tick.step)  # desync_save: a test's save on one rank only
            ckpt.save(self.t.state)
        if periodic:
            self.cadence.saved()
        if tick.last:
            ckpt.flush(tick.step)


class ParamChecksum:
    """debug.param_checksum: every step, the parameters' checksum as the step left them
    (Strategy.param_checksum), logged as debug/param_checksum and its scale
    debug/param_checksum_sq next to the step's loss and grad_norm (`zerotrain verify` reads them)."""

    def __init__(self, trainer):
        self.t = trainer

    def on_step(self, tick: Tick) -> None:
        if tick.out is None:
            return
        value, sq = self.t.strategy.param_checksum()  # every rank: a gather under ZeRO-3
        if self.t.acc.is_main_process:
            self.t.loggers.log({"debug/param_checksum": value, "debug/param_checksum_sq": sq}, tick.step)


class StepDone:
    """After a step's log, eval and save: the progress bar, rank 0's elastic progress (what a
    restart counts as lost) and the test hooks (train/testhooks.py; nothing when unset)."""

    def __init__(self, trainer, bar, signals: StopRequested):
        self.t, self.bar, self.signals = trainer, bar, signals

    def on_step(self, tick: Tick) -> None:
        if tick.out is None:
            return
        if self.bar:
            self.bar.update(1)
        if self.t.elastic:
            self.t.elastic.progress(tick.step)
        testhooks.fire("after_step", step=tick.step, rank=self.t.topo.rank, stop=self.signals,
                       elastic=self.t.elastic is not None)


class StepTimer:
    """The step's wall time and result into the logging interval's Window (before anything
    else: evaluation and checkpoint pauses are not step time)."""

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

    def __init__(self, report):
        self.report = report

    def before_step(self, step: int) -> None:
        self.report.before_step(step)

    def on_step(self, tick: Tick) -> None:
        if tick.out is not None:
            self.report.after_step(tick.step)
