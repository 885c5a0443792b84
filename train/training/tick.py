"""What every rank agreed about one optimizer step (the Tick), and the one place that makes it
(LoopControl).

A component of the loop (train/training/components.py) sees the step as a Tick: what it may
read (the step, the step's result, the TrainState after it, whether max_steps is reached, what
every rank voted, the metrics earlier components added) and what it may ask for (stop the run
with a reason, add metrics to the step's row). It never sees the Trainer.

Stopping, two ways, both ending every rank at the same step:
  tick.stop(reason)              a decision every rank makes identically at this step (from
                                 agreed values: the global gradient norm, a gathered val/loss):
                                 it takes effect at once, and components after it in this step
                                 see the step as the last (they log, save)
  tick.request_stop(by, reason)  a rank-local wish (a signal, a file appearing on one node): it
                                 travels in the next vote and every rank stops at the step where
                                 the vote is read, one step later (train/training/tick.py)

A stop reason is an open string with a message, supplied by the component; it decides the run's
summary line, its metrics row, whether the run counts as finished (final: evaluated, exported)
and its exit code (failure).

A signal reaches one rank (StopRequested), and every rank learns what all ranks cast one step
later (StopVote): the signal flag, the components' stop requests and their vote fields ride in
one vector."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from zerotrain.train import process_group, testhooks

if TYPE_CHECKING:
    from zerotrain.train.checkpoint.state import TrainState
    from zerotrain.train.training.window import StepResult


@dataclass(frozen=True)
class StopReason:
    """Why a run ends before max_steps."""

    name: str                  # short, for metrics and W&B: "signal", "diverged", "early_stop", ...
    message: str               # one line for the summary
    final: bool = False        # the run is over as at max_steps (it evaluates, exports); False: paused or failed
    failure: Optional[type] = None  # a UserError class: raised at the end (its exit code); None: exit 0


SIGNAL = StopReason("signal", "stopped by signal: resume with --resume auto")


def _elsewhere(component) -> StopReason:
    name = getattr(component, "name", type(component).__name__)
    return StopReason(name, f"{name}: a stop requested on another rank")


@dataclass(eq=False)
class Tick:
    """One optimizer step as every component sees it."""

    step: int                          # optimizer steps completed
    out: Optional[StepResult]          # the step's result (None: a resumed run already at max_steps ran no step)
    state: TrainState                  # where training stands after the step (read only)
    done: bool                         # max_steps reached
    stop_reason: Optional[StopReason] = None   # why the run ends at this step, if it does
    metrics: dict = field(default_factory=dict)  # what components added to this step's row so far
    _votes: dict = field(default_factory=dict)   # id(component) -> its vote fields, summed over the ranks
    _control: Optional[LoopControl] = None

    @property
    def last(self) -> bool:
        """The run's last step: max_steps, or a stop."""
        return self.done or self.stop_reason is not None

    @property
    def completed(self) -> bool:
        """The run is over as planned: max_steps with no stop, or a final stop (early stopping):
        it evaluates and exports at the end."""
        return (self.done and self.stop_reason is None) or (self.stop_reason is not None and self.stop_reason.final)

    def agreed(self, component) -> tuple:
        """`component`'s vote fields (its vote()), summed over the ranks, as cast one step ago
        (zeros before the first vote is read)."""
        return self._votes.get(id(component), ())

    def stop(self, reason: StopReason) -> None:
        """End the run at this step. Only for a decision every rank makes identically here; a
        failure wins over a stop already set that is not one."""
        if self.stop_reason is None or (reason.failure is not None and self.stop_reason.failure is None):
            self.stop_reason = reason

    def request_stop(self, by, reason: StopReason) -> None:
        """A rank-local request: every rank stops where the next vote is read."""
        self._control.requested[id(by)] = reason

    def add_metrics(self, metrics: dict) -> None:
        """Log `metrics` at this step (rank 0's trackers) and show them to later components."""
        if metrics:
            self.metrics.update(metrics)
            self._control.log(metrics, self.step)


class LoopControl:
    """Makes each step's Tick: casts this rank's vote (the signal flag, each component's stop
    request, each component's vote fields: Checkpointing's save ticket and write status) and
    reads the vote of a step ago. The last step (max_steps, or a stop read now) also collects
    the vote still in flight, so that a signal during it still counts."""

    def __init__(self, acc, components: list, signals, max_steps: int, log: Callable[[dict, int], None]):
        self.components, self.signals, self.max_steps, self.log = components, signals, max_steps, log
        self.requested: dict = {}       # id(component) -> StopReason asked on this rank, not yet cast
        # [signal] + per component: [its request] + its vote fields
        self.layout, at = [], 1
        for c in components:
            width = len(c.vote()) if hasattr(c, "vote") else 0
            self.layout.append((c, at, width))
            at += 1 + width
        self.width = at
        self.vote = StopVote(acc, at)
        self._local: dict = {}          # requests cast in the vote in flight: id -> StopReason

    def _cast(self) -> list:
        values = [0.0] * self.width
        values[0] = float(self.signals.flag)
        for c, at, width in self.layout:
            values[at] = float(id(c) in self.requested)
            if width:
                values[at + 1:at + 1 + width] = c.vote()
        if self.requested:
            self._local.update(self.requested)
            self.requested = {}
        return values

    def agree(self, step: int, out, state: TrainState) -> Tick:
        process_group.at("stop vote", step)
        read = self.vote(self._cast(), step=step) if out is not None else None
        done = step >= self.max_steps
        reason = self._reason(read)
        if done or reason is not None:
            late = self._reason(self.vote.finish())
            reason = reason or late
        votes = {id(c): tuple(read[at + 1:at + 1 + width]) if read else (0.0,) * width
                 for c, at, width in self.layout}
        return Tick(step=step, out=out, state=state, done=done, stop_reason=reason, _votes=votes, _control=self)

    def _reason(self, read: Optional[tuple]) -> Optional[StopReason]:
        """The first stop in a vote read back: a signal, else the first component's request."""
        if read is None:
            return None
        if read[0] > 0:
            return SIGNAL
        for c, at, _ in self.layout:
            if read[at] > 0:
                return self._local.get(id(c)) or _elsewhere(c)
        return None

    def finish(self) -> None:
        """A stop before the last step leaves one vote in flight (every rank has one)."""
        self.vote.finish()


# ---------------------------------------------------------------------------- signals and the vote

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


class StopVote:
    """Every rank agrees on a vector of numbers (each rank's cast, summed) without a blocking
    collective per step (its cost: BENCHMARKS.md "Trainer overhead against the independent
    baseline"): each step starts an async all-reduce of this rank's vector and reads the one
    started a step earlier, long finished in the background; so
    all ranks see the same sums at the same step, one step after they were cast. The vector is a
    CPU tensor on a gloo group (the default group under gloo, a side group under NCCL): reading it
    never waits for the accelerator, and gloo's wait() returns at once for a reduction finished a
    step ago, where NCCL's would only order the streams. One process: the cast comes back at once."""

    def __init__(self, acc, width: int):
        self.dist = acc.num_processes > 1 and process_group.exists()
        self.rank = torch.distributed.get_rank() if self.dist else 0  # (the test hook of another shape)
        self.width = width
        self.group = None
        if self.dist and torch.distributed.get_backend() != "gloo":
            self.group = torch.distributed.new_group(backend="gloo")  # collective: every rank builds its StopVote
        self.buffers = [torch.zeros(width), torch.zeros(width)]  # one in flight, one being filled
        self.views = [b.numpy() for b in self.buffers]    # filled through numpy: cheaper than torch indexing
        self.turn = 0
        self.pending = None  # (work, tensor) of the previous step

    def __call__(self, values: Sequence[float], step: int = 0) -> Optional[tuple]:
        """Cast this step's vector; returns the previous step's sums (None: nothing cast before)."""
        if not self.dist:
            return tuple(float(v) for v in values)
        t, view = self.buffers[self.turn], self.views[self.turn]
        self.turn ^= 1
        view[:] = values
        if testhooks.fire("desync_vote_shape", step=step, rank=self.rank):  # tests: another shape on one rank
            t = torch.cat([t, torch.zeros(1)])
        work = torch.distributed.all_reduce(t, async_op=True, group=self.group)
        previous, self.pending = self.pending, (work, t)
        return self._read(previous)

    def finish(self) -> Optional[tuple]:
        """Collect the vote still in flight (every rank has one, or none)."""
        previous, self.pending = self.pending, None
        return self._read(previous)

    @staticmethod
    def _read(vote) -> Optional[tuple]:
        if vote is None:
            return None
        vote[0].wait()
        return tuple(vote[1].tolist())  # a CPU tensor: no device sync
