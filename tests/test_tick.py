"""The loop's control without a launch: LoopControl (train/training/tick.py) on two simulated
ranks whose votes are summed and read one step later, as StopVote's async all-reduce does, with
the real components deciding their own cadence from the Tick.

  - a stop requested on one rank ends both ranks at the same step, one vote later;
  - a save due by minutes (rank 0's clock only) happens at the same step on both ranks;
  - a last step that is also a save step saves once;
  - early stopping decided at an evaluation ends the run at that step, saves it, and the log
    line of its interval is still written.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from zerotrain.train.checkpoint.cadence import SaveCadence
from zerotrain.train.checkpoint.state import TrainState
from zerotrain.train.config.schema import EarlyStopConfig
from zerotrain.train.training import components
from zerotrain.train.training.early_stop import EarlyStop
from zerotrain.train.training.tick import LoopControl, StopReason


class Exchange:
    """The ranks' casts of each step, summed; read back one call later (StopVote's timing). Each
    rank runs in its own thread, and reading a vote waits until every rank cast it, as the
    all-reduce's wait() does."""

    def __init__(self, ranks: int):
        self.ranks, self.casts = ranks, {}
        self.cond = threading.Condition()

    def vote(self, rank: int):
        ex = self

        class Vote:
            pending = None

            def __call__(self, values, step=0):
                with ex.cond:
                    ex.casts.setdefault(step, {})[rank] = list(values)
                    ex.cond.notify_all()
                previous, self.pending = self.pending, step
                return ex.total(previous)

            def finish(self):
                previous, self.pending = self.pending, None
                return ex.total(previous)
        return Vote()

    def total(self, step):
        if step is None:
            return None
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.casts.get(step, {})) == self.ranks, timeout=10), \
                f"a rank waits for a vote of step {step} another rank never cast"
            casts = self.casts[step]
        return tuple(sum(c[i] for c in casts.values()) for i in range(len(next(iter(casts.values())))))


class Signals:
    flag = False


class Asker:
    """Requests a stop on its own rank at one step (a rank-local condition)."""
    name = "asker"

    def __init__(self, at: int | None):
        self.at = at

    def on_step(self, tick):
        if tick.step == self.at:
            tick.request_stop(self, StopReason("asker", f"asked at step {tick.step}"))


class Recorder:
    name = "recorder"

    def __init__(self):
        self.ticks = []

    def on_step(self, tick):
        self.ticks.append((tick.step, tick.stop_reason.name if tick.stop_reason else None, tick.last))


class FakeCheckpointer:
    def __init__(self):
        self.saved = []

    def write_status(self):
        return (0.0, 0.0, 0.0, 0.0)

    def poll(self, writes, step, last=False):
        assert writes == (0.0, 0.0, 0.0, 0.0)

    def save(self, state):
        self.saved.append(state.step)

    def flush(self, step, last=False):
        return 0.0

    def unsaved_at_end(self, step):
        return None


def run(ranks: int, max_steps: int, make_components, log=lambda m, s: None):
    """Drives every rank's LoopControl step by step; returns each rank's components."""
    ex = Exchange(ranks)
    per_rank = [make_components(r) for r in range(ranks)]
    controls = []
    for r, comps in enumerate(per_rank):
        c = LoopControl(SimpleNamespace(num_processes=1), comps, Signals(), max_steps, log)
        c.vote = ex.vote(r)
        controls.append(c)
    ends, errors = [None] * ranks, []

    def loop(r):
        try:
            step, tick = 0, None
            while tick is None or not tick.last:
                step += 1
                tick = controls[r].agree(step, object(), TrainState(step=step))
                for comp in per_rank[r]:
                    comp.on_step(tick)
            ends[r] = step
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    assert len(set(ends)) == 1, f"ranks ended at different steps: {ends}"
    return per_rank


def test_a_stop_requested_on_one_rank_stops_every_rank_at_the_same_step():
    got = run(2, 50, lambda r: [Asker(5 if r == 1 else None), Recorder()])
    ends = [comps[1].ticks[-1] for comps in got]
    # cast at step 6's vote (the request came after step 5's), read at step 7
    assert ends == [(7, "asker", True), (7, "asker", True)]
    assert got[0][1].ticks[-1] == (7, "asker", True)


def test_a_save_due_by_minutes_happens_on_every_rank_at_the_same_step():
    clocks = [[0.0], [1000.0]]  # rank clocks far apart: only rank 0's counts

    def make(r):
        clock = clocks[r]

        class Tock:
            name = "tock"

            def on_step(self, tick):
                clock[0] += 7.0 if r == 0 else 1.0

        cad = SaveCadence(0, 1.0, is_main=(r == 0), clock=lambda: clock[0])
        ck = FakeCheckpointer()
        return [Tock(), components.Checkpointing(ck, cad, save_at_end=False, snapshot=lambda: TrainState(step=0), rank=r)]

    got = run(2, 30, make)
    saves = [comps[1].ckpt.saved for comps in got]
    assert saves[0] == saves[1] and len(saves[0]) >= 2


def test_a_last_step_that_is_also_a_save_step_saves_once():
    state = {"step": 0}

    def make(r):
        cad = SaveCadence(5, 0.0, is_main=(r == 0))
        return [components.Checkpointing(FakeCheckpointer(), cad, save_at_end=True,
                                         snapshot=lambda: TrainState(step=state["step"]), rank=r)]

    class Counter:
        name = "counter"

        def on_step(self, tick):
            state["step"] = tick.step

    got = run(2, 10, lambda r: [Counter(), *make(r)])
    assert [comps[1].ckpt.saved for comps in got] == [[5, 10], [5, 10]]


def test_early_stopping_at_a_log_step_stops_saves_and_logs():
    rows = []
    vals = {2: 3.0, 4: 2.0, 6: 2.5, 8: 2.4, 10: 1.0}

    class Eval:
        name = "evaluation"

        def on_step(self, tick):
            if tick.step in vals:
                tick.add_metrics({"val/loss": vals[tick.step]})

    def make(r):
        cad = SaveCadence(0, 0.0, is_main=(r == 0))
        return [Recorder(), Eval(), EarlyStop(EarlyStopConfig(patience=2)),
                components.Checkpointing(FakeCheckpointer(), cad, save_at_end=False,
                                         snapshot=lambda: TrainState(step=8), rank=r)]

    got = run(2, 100, make, log=lambda m, s: rows.append((s, m)))
    for comps in got:
        early, ckpt = comps[2], comps[3].ckpt
        assert (early.best, early.best_step, early.bad) == (2.0, 4, 2)
        assert ckpt.saved == [8]  # no periodic saves: the stop's save, once
    assert (8, {"early_stop/best": 2.0, "early_stop/bad_evals": 2}) in rows
    # the state comes back: a fresh EarlyStop loaded from it stops at its next bad evaluation
    again = EarlyStop(EarlyStopConfig(patience=3))
    again.load_state_dict(got[0][2].state_dict(), TrainState(step=8))
    assert (again.best, again.bad) == (2.0, 2)
