"""Test hooks: deterministic faults and switches for the tests, off unless their variable is set.

Production code calls `fire(point, **where)` at a few named points. The environment is read
once, at import (`load()` reads it again: `zerotrain prepare` does at its start, since tests run
it several times in one process); with no variable set, `fire` finds no hook and returns False,
so a real run reads nothing in its loop.

ZEROTRAIN_INJECT_NAN="3,4"   "nan_loss": rank 0's loss becomes NaN at those optimizer steps (1-based).
ZEROTRAIN_INJECT_KILL="1:70" "after_step": rank 1 SIGKILLs itself once optimizer step 70 is done
                             (logged, evaluated, saved): a crashed rank at a known step, no racing
                             a test's kill against a fast loop.
Under torchrun's elastic agent (set in one node's environment only), also "after_step":
ZEROTRAIN_INJECT_KILL_NODE=8 the node dies once step 8 is done: each of its ranks SIGKILLs its
                             launcher (the agent, so nothing restarts there) and its own process
                             group (torchrun starts every rank in a session of its own).
ZEROTRAIN_INJECT_HOLD=9      once step 9 is done, wait (at most 600 s) for SIGTERM/SIGINT before
                             the next step: a membership change (the agent's SIGTERM) lands at a
                             known step however fast the loop is.
ZEROTRAIN_INJECT_KILL_IN_SAVE=5  "saved_file": each rank SIGKILLs itself after its first file of
                             step 5's checkpoint (a crash in the middle of a save); "1:5": rank 1
                             only. With checkpoint.async the file is written by the background
                             thread: the kill lands during the background write.
ZEROTRAIN_INJECT_SIGTERM_IN_WRITE=5  "writing" (checkpoint.async): after its first file of step 5's
                             checkpoint, each rank's writer thread sends SIGTERM to its own process
                             (a scheduler's preemption), then holds the write until the loop waits
                             for it (at most 120 s): the stop always meets a write in flight.
ZEROTRAIN_PREPARE_STOP_AFTER=K   "shard_written": `zerotrain prepare` stops after K shards, as an
                             interruption would.
ZEROTRAIN_PLANT_BUG=<name>   a known kind of wrong-numbers bug, planted in runs of 2 or more
                             processes only (a 1-process run, `zerotrain verify`'s reference, stays
                             right; lr_behind: any run of its backend), for tests/test_verify.py
                             to show verify catches it:
  grad_times_world     "plant_grad_times_world": under ZeRO, the loss (so the gradient) times the
                       world size, as a sum where a mean belongs;
  skip_clip            "plant_skip_clip": under DDP, no clipping (train.grad_clip ignored);
  lr_ahead             "plant_lr_ahead": the trainer sets the LR of the next step;
  drop_partition       "plant_drop_partition": under ZeRO-1/2, the last rank zeroes its partition
                       of the reduced gradient before the norm and the step;
  loss_accum_twice     "plant_loss_accum_twice": under DDP, backward divides the loss by the
                       accumulation steps once more;
  lr_behind            "plant_lr_behind": under ZeRO, each step runs with the LR of the step before
                       (0 at step 1). Also in 1-process runs: a bug in the ZeRO code path, which a
                       1-process run of the same JSON carries too (verify's floor must not hide it);
  wd_off               "plant_wd_off": under ZeRO-3, the optimizer steps without weight decay (the
                       param groups still say it: only the update shows it);
  decay_all            "plant_decay_all": under ZeRO, every parameter group decays (norms and
                       biases too), set in the optimizer before step 1.
ZEROTRAIN_INJECT_DESYNC=<kind>:<rank>:<step>   ranks that part ways (debug.collectives' tests,
                             tests/test_collectives.py): at optimizer step <step> (1-based), rank
                             <rank> only
  extra_allreduce      "desync_extra_allreduce": runs one all-reduce more, once its micro-batches are done;
  vote_shape           "desync_vote_shape": casts its stop vote with a tensor of one more element;
  eval                 "desync_eval": evaluates after the step (the others do not);
  save                 "desync_save": saves after the step (the others do not);
  stuck_loader         "desync_stuck_loader": sleeps forever fetching the step's first micro-batch
                       (a data loader deadlock).
ZEROTRAIN_INJECT_SLOW_START=<rank>:<seconds>  "slow_start": that rank sleeps so long before its
                             first step (ranks far apart at start-up: debug.collectives' long
                             timeout until the first step is done).
ZEROTRAIN_MOE_LEAF=0         "no_moe_leaf": ZeRO-3 leaves sparse-MoE blocks to DeepSpeed's
                             per-module gathering (models/moe.py), to show what the leaf avoids.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

DESYNCS = ("extra_allreduce", "vote_shape", "eval", "save", "stuck_loader")
PLANTED_BUGS = ("grad_times_world", "skip_clip", "lr_ahead", "drop_partition", "loss_accum_twice", "lr_behind",
                "wd_off", "decay_all")
ANY_WORLD_BUGS = ("lr_behind",)  # planted in 1-process runs too (the rest: 2 or more processes only)
_armed: dict[str, Callable[..., bool]] = {}  # point -> hook; empty in every real run


def fire(point: str, **where) -> bool:
    """Run the hook armed at `point`, if any. True asks the caller for the fault it names
    (a NaN loss, a stop, no leaf); a hook that kills or waits does so itself."""
    hook = _armed.get(point)
    return hook is not None and hook(**where)


def load(env=None) -> None:
    """(Re)arm the hooks from the environment."""
    env = os.environ if env is None else env
    _armed.clear()
    nan = {int(s) for s in env.get("ZEROTRAIN_INJECT_NAN", "").split(",") if s.strip()}
    if nan:
        _armed["nan_loss"] = lambda step, rank: rank == 0 and step in nan
    after = _after_step_hooks(env)
    if after:
        _armed["after_step"] = lambda **where: any(hook(**where) for hook in after)
    kill_in_save = env.get("ZEROTRAIN_INJECT_KILL_IN_SAVE")
    if kill_in_save:
        who, _, at = kill_in_save.rpartition(":")
        _armed["saved_file"] = lambda step, rank: step == int(at) and (not who or rank == int(who)) and _die()
    sigterm_in_write = env.get("ZEROTRAIN_INJECT_SIGTERM_IN_WRITE")
    if sigterm_in_write:
        _armed["writing"] = lambda step, waiting: step == int(sigterm_in_write) and _term_and_hold(waiting)
    stop_after = int(env.get("ZEROTRAIN_PREPARE_STOP_AFTER", "0") or 0)
    if stop_after:
        _armed["shard_written"] = lambda shards: shards >= stop_after
    bug = env.get("ZEROTRAIN_PLANT_BUG", "")
    if bug:
        if bug not in PLANTED_BUGS:
            raise ValueError(f"ZEROTRAIN_PLANT_BUG={bug}: one of {', '.join(PLANTED_BUGS)}")
        # drop_partition: the last rank's partition only.
        _armed["plant_" + bug] = lambda world, rank=None: ((world > 1 or bug in ANY_WORLD_BUGS)
                                                           and rank in (None, world - 1))
    desync = env.get("ZEROTRAIN_INJECT_DESYNC", "")
    if desync:
        kind, who, at = desync.split(":")
        if kind not in DESYNCS:
            raise ValueError(f"ZEROTRAIN_INJECT_DESYNC={desync}: <kind>:<rank>:<step>, kind one of {', '.join(DESYNCS)}")
        act = {"extra_allreduce": _extra_allreduce, "stuck_loader": _sleep_forever}.get(kind, lambda: True)
        _armed["desync_" + kind] = lambda step, rank: (rank, step) == (int(who), int(at)) and act()
    slow_start = env.get("ZEROTRAIN_INJECT_SLOW_START", "")
    if slow_start:
        late, seconds = (int(x) for x in slow_start.split(":"))
        _armed["slow_start"] = lambda rank: rank == late and time.sleep(seconds)
    if env.get("ZEROTRAIN_MOE_LEAF", "1") == "0":
        _armed["no_moe_leaf"] = lambda: True


def _after_step_hooks(env) -> list[Callable[..., bool]]:
    """Once a step is done: kill this rank; under the elastic agent, kill the node or hold."""
    hooks = []
    kill = env.get("ZEROTRAIN_INJECT_KILL", "")
    if kill:
        at = tuple(int(x) for x in kill.split(":"))  # (rank, step)
        hooks.append(lambda step, rank, stop, elastic: (rank, step) == at and _die())
    kill_node = env.get("ZEROTRAIN_INJECT_KILL_NODE", "")
    if kill_node:
        hooks.append(lambda step, rank, stop, elastic: elastic and step == int(kill_node) and _kill_node())
    hold = env.get("ZEROTRAIN_INJECT_HOLD", "")
    if hold:
        hooks.append(lambda step, rank, stop, elastic: elastic and step == int(hold) and _hold(stop))
    return hooks


def _extra_allreduce() -> bool:
    import torch
    torch.distributed.all_reduce(torch.zeros(3))
    return False


def _sleep_forever() -> bool:
    while True:
        time.sleep(1)


def _die() -> bool:
    os.kill(os.getpid(), signal.SIGKILL)
    return False


_fired: set = set()


def _term_and_hold(waiting) -> bool:
    if "sigterm" in _fired:  # once: after the first file
        return False
    _fired.add("sigterm")
    os.kill(os.getpid(), signal.SIGTERM)
    waiting.wait(120)
    return False


def _kill_node() -> bool:
    os.kill(os.getppid(), signal.SIGKILL)
    os.killpg(os.getpgid(0), signal.SIGKILL)
    return False


def _hold(stop) -> bool:
    deadline = time.monotonic() + 600
    while not stop.flag and time.monotonic() < deadline:
        time.sleep(0.05)
    return False


load()
