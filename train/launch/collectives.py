"""debug.collectives: ranks that run different collectives are named in seconds, not after a
30-minute hang (docs/troubleshooting.md "Collective mismatch").

torch's own desync detection does the checking: with TORCH_DISTRIBUTED_DEBUG=DETAIL (set here,
before the process group exists) every process group, the default one and those DeepSpeed makes
later, is wrapped in a ProcessGroupWrapper. Before each collective it runs a monitored barrier and
an all-gather of the collective's fingerprint (operation, shapes, dtypes) on a side gloo group:

- ranks at different collectives (an all-reduce on rank 0 only, a tensor of another shape on one
  rank, a save or an evaluation on some ranks only): every rank raises at once, naming both
  fingerprints; `explain` makes that one line per rank, with the step and the phase of the loop
  (train/process_group.py `at`, set at each step, stop vote, evaluation and save);
- ranks at collectives of *different process groups* (a user's all-reduce on the default group
  on one rank while the other is in DeepSpeed's gradient reduction on a group of its own): each
  group's check sees only that the other rank never came. So every collective called through
  torch.distributed's Python functions (DeepSpeed's included) is recorded while it runs
  (`_record_python_collectives`: operation, shapes, dtype, group, caller), and a rank that waited
  in vain asks the missing one what it is in: a rank in a collective answers with it, and both
  lines name the two collectives, their groups and callers;
- a rank that does not come at all (stuck in its data loader, an endless loop, one collective
  fewer): the monitored barrier names it after the collective timeout, which is
  debug.collectives_timeout_s from the end of the run's first step on (distributed.timeout_s
  before: ranks may be far apart at start-up; `shorten`). The waiting rank then asks the missing one,
  through the rendezvous store, for its Python stack: a thread in every rank (StackOnRequest)
  prints it (faulthandler, every thread) with one line saying where it stands, and ends it;
  unless that rank's own record or its main thread's stack says it is in a collective (above).

Cost: a barrier and a small all-gather per collective (bench/collective_checks.py,
BENCHMARKS.md), hence a switch that `zerotrain verify` turns on, not a default.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import re
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from zerotrain.train import process_group
from zerotrain.train.errors import say
from zerotrain.train.launch import peers

_STATE: dict = {"on": False, "timeout_s": None, "timeout_key": None, "run_dir": None, "helpers": [],
                "short_s": None, "start_s": None}
_MISMATCH = re.compile(r"Detected mismatch between collectives on ranks\. Rank (\d+) is running collective: "
                       r"(CollectiveFingerPrint\(.*?\)), but Rank (\d+) is running collective: "
                       r"(CollectiveFingerPrint\(.*?\))\.\s*Collectives differ", re.S)
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier in (\d+) ms")
# a rank other than 0 at the barrier: rank 0 (which collects the others) did not answer
_NO_ROOT = re.compile(r"received errors while waiting for send/recv from rank (\d+)")
ASK_EVERY_S = 0.5   # how often a rank looks whether a peer asked for its stack


def enable(cfg) -> int:
    """Turn the check on where cfg.debug.collectives asks (before any process group exists);
    returns the timeout the run's process group is made with: distributed.timeout_s. The check's
    own, shorter one (debug.collectives_timeout_s) applies from the end of the first step on
    (`shorten`, called by the loop's FirstStepDone): until then the ranks may be far apart
    legitimately (imports, a data prepare on rank 0 only, a slow first step)."""
    from torch.distributed import distributed_c10d
    _STATE["run_dir"] = Path(cfg.train.run_dir)
    if not cfg.debug.collectives:
        if _STATE["on"]:  # an earlier run in this process (tests) had it on
            dist.set_debug_level(dist.DebugLevel.OFF)
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
            distributed_c10d.default_pg_timeout = _STATE["default_timeout"]
            _STATE.update(on=False, timeout_s=None, timeout_key=None, short_s=None, helpers=[])
        return cfg.distributed.timeout_s
    if dist.is_initialized():  # too late: the group exists without the wrapper
        raise RuntimeError("debug.collectives must be set before the process group starts")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # torch read it at import: set the level too
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    _STATE.setdefault("default_timeout", distributed_c10d.default_pg_timeout)
    _ddp_logs_no_construction()
    _record_python_collectives()
    _STATE.update(on=True, short_s=cfg.debug.collectives_timeout_s, helpers=[])
    if _keep_the_checks_groups():
        _STATE.update(timeout_s=cfg.distributed.timeout_s, timeout_key="distributed.timeout_s",
                      start_s=cfg.distributed.timeout_s)
        return cfg.distributed.timeout_s
    # torch's wrapper is not the one this was written against: the short timeout from the start
    # (ranks more than debug.collectives_timeout_s apart at start-up then stop there).
    distributed_c10d.default_pg_timeout = datetime.timedelta(seconds=cfg.debug.collectives_timeout_s)
    _STATE.update(timeout_s=cfg.debug.collectives_timeout_s, timeout_key="debug.collectives_timeout_s",
                  start_s=cfg.debug.collectives_timeout_s)
    return cfg.debug.collectives_timeout_s


def _keep_the_checks_groups() -> bool:
    """Keep each ProcessGroupWrapper's side gloo group (the one its monitored barrier and
    fingerprint all-gather run on, with the timeout the group was made with), so that `shorten`
    can set its timeout: dist.set_timeout(group) does not reach it (torch 2.14: a rank late by
    more than a timeout set that way still passed; set on the side group, the other rank named it
    once the timeout had passed). torch builds the wrapper in distributed_c10d._create_process_group_wrapper;
    this is that function, the same three lines, keeping the side group. False (nothing changed)
    where torch's function is not the one these lines copy."""
    import inspect

    from torch.distributed import distributed_c10d as c10d
    made = c10d._create_process_group_wrapper
    if getattr(made, "zerotrain_keeps_side_group", False):
        return True
    expected = ["wrapped_pg", "store_prefix", "store", "rank", "world_size", "timeout"]
    if list(inspect.signature(made).parameters) != expected or not all(
            hasattr(c10d, n) for n in ("PrefixStore", "ProcessGroupGloo", "_ProcessGroupWrapper",
                                       "PG_WRAPPER_STORE_PREFIX")):
        return False

    def create_process_group_wrapper(wrapped_pg, store_prefix, store, rank, world_size,
                                     timeout=c10d.default_pg_timeout):
        store = c10d.PrefixStore(f"{c10d.PG_WRAPPER_STORE_PREFIX}:{store_prefix}", store)
        helper_pg = c10d.ProcessGroupGloo(store, rank, world_size, timeout=timeout)
        _STATE["helpers"].append(helper_pg)  # one per group, alive as long as the group (the run)
        if _STATE["timeout_key"] == "debug.collectives_timeout_s":  # a group made after the first step
            helper_pg.set_timeout(datetime.timedelta(seconds=_STATE["short_s"]))
        return c10d._ProcessGroupWrapper(wrapped_pg, helper_pg)

    create_process_group_wrapper.zerotrain_keeps_side_group = True
    c10d._create_process_group_wrapper = create_process_group_wrapper
    return True


def shorten() -> None:
    """From now on a rank that does not come to a collective is named after
    debug.collectives_timeout_s (each rank sets its own side groups; no collective)."""
    if not _STATE["on"] or _STATE["timeout_key"] == "debug.collectives_timeout_s":
        return
    from torch.distributed import distributed_c10d
    short = datetime.timedelta(seconds=_STATE["short_s"])
    for helper in _STATE["helpers"]:
        helper.set_timeout(short)
    distributed_c10d.default_pg_timeout = short  # groups made later (their side group: above)
    _STATE.update(timeout_s=_STATE["short_s"], timeout_key="debug.collectives_timeout_s")


class FirstStepDone:
    """A component of the loop (train/training/components.py), while the check is on: once the
    run's first step is done (its collectives, its stop vote), the short timeout applies."""

    def on_step(self, tick) -> None:
        shorten()


def _ddp_logs_no_construction() -> None:
    """torch 2.14: DDP's construction log (c10d::Logger::set_env_variables) casts the default
    group's gloo backend to ProcessGroupGloo; under the wrapper it is a ProcessGroupWrapper, and
    the process dies of SIGSEGV while DDP is built (measured: any DDP on gloo with DETAIL). The
    check skips that log line (torch's own usage log, read by nothing here); DDP is otherwise the
    same: its gradient all-reduces go through the wrapper and are checked like the rest."""
    if getattr(dist.Logger, "zerotrain_skips_construction_log", False):
        return

    class Logger(dist.Logger):
        zerotrain_skips_construction_log = True

        def set_construction_data_and_log(self, *args, **kwargs):
            pass

    dist.Logger = Logger


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "all_to_all",
               "all_to_all_single", "gather", "scatter", "barrier", "all_reduce_coalesced")
_RUNNING: list = []   # this rank's collectives in progress (the main thread's, innermost last)


def _record_python_collectives() -> None:
    """Wrap torch.distributed's collective functions so that each call is recorded while it runs
    (what a peer asks for when it waited in vain: `_in_collective`). Set before DeepSpeed builds
    its communication backend, which keeps references to these functions. Costs a list append
    and pop per collective, with the check only."""
    import functools
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None or getattr(fn, "zerotrain_records", False):
            continue

        def make(fn, name):
            @functools.wraps(fn)
            def recorded(*args, **kwargs):
                entry = (name, args, kwargs, sys._getframe(1))
                _RUNNING.append(entry)
                try:
                    return fn(*args, **kwargs)
                except BaseException:
                    _STATE["failed_in"] = describe(entry)  # read once this rank's line is due
                    raise
                finally:
                    _RUNNING.remove(entry)
            recorded.zerotrain_records = True
            return recorded
        setattr(dist, name, make(fn, name))


def _shapes(obj) -> str:
    import torch
    if isinstance(obj, torch.Tensor):
        return f"{list(obj.shape)} ({str(obj.dtype).removeprefix('torch.')})"
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(t, torch.Tensor) for t in obj):
        return f"{len(obj)} x {_shapes(obj[0])}"
    return ""


def _caller(frame) -> str:
    """The first frame outside torch.distributed and DeepSpeed's comm layer: file:line function."""
    while frame is not None and any(p in frame.f_code.co_filename
                                    for p in ("torch/distributed", "deepspeed/comm", "deepspeed/utils/nvtx")):
        frame = frame.f_back
    if frame is None:
        return "?"
    f = frame.f_code.co_filename
    short = f.split("site-packages/")[-1] if "site-packages/" in f else os.path.relpath(f) if f.startswith("/") else f
    return f"{short}:{frame.f_lineno} {frame.f_code.co_name}"


def describe(entry) -> str:
    """One recorded collective: operation, shapes, group, caller."""
    name, args, kwargs, frame = entry
    tensors = next((a for a in list(args) + list(kwargs.values()) if _shapes(a)), None)
    group = kwargs.get("group")
    if group is None:
        group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
    if group is None or group == dist.GroupMember.WORLD:
        where = "the default group"
    else:
        try:
            where = f"a group of ranks {dist.get_process_group_ranks(group)} other than the default one"
        except Exception:  # noqa: BLE001
            where = "a group other than the default one"
    shape = _shapes(tensors) if tensors is not None else ""
    return f"{name}{' of ' + shape if shape else ''} on {where}, called from {_caller(frame)}"


def _in_collective() -> str | None:
    """What this rank is in, where it is in a collective: its record (the innermost running, or
    the one that just failed), else a collective frame in its main thread's stack; None: it is not."""
    if _RUNNING:
        return describe(_RUNNING[-1])
    if _STATE.get("failed_in"):
        return _STATE["failed_in"]
    main = sys._current_frames().get(threading.main_thread().ident)
    frame = main
    while frame is not None:
        if "torch/distributed/distributed_c10d.py" in frame.f_code.co_filename:
            return f"{frame.f_code.co_name} (torch.distributed), called from {_caller(frame)}"
        frame = frame.f_back
    return None


def timeout_s(cfg) -> int:
    """The collective timeout a run's process group is made with (`enable` says which)."""
    return _STATE["start_s"] if cfg.debug.collectives and _STATE["on"] else cfg.distributed.timeout_s


def on() -> bool:
    return _STATE["on"]


# ---------------------------------------------------------------------------- one line per rank

def _fingerprint(text: str) -> tuple[str, str, str, str]:
    """(operation, shapes, dtypes, sequence number) of torch's CollectiveFingerPrint(...)."""
    def field(name, until):
        m = re.search(rf"{name}=(.*?)(?:, {until}=|\)$)", text, re.S)
        return m.group(1).strip() if m else "?"
    return (field("OpType", "TensorShape"), field("TensorShape", "TensorDtypes"),
            field("TensorDtypes", "TensorDeviceTypes").lower(), field("SequenceNumber", "OpType"))


def _checkpoint_line() -> str:
    run_dir = _STATE["run_dir"]
    latest = run_dir / "checkpoints" / "latest" if run_dir is not None else None
    try:
        name = latest.read_text().strip() if latest is not None else ""
    except OSError:
        name = ""
    if not name:
        return "No checkpoint had been saved yet."
    return (f"The last complete checkpoint, {latest.parent / name}, is intact: fix the cause, then "
            f"--checkpoint.resume auto continues from it.")


def _texts(exc: BaseException) -> str:
    texts, e = [], exc
    while e is not None and len(texts) < 8:
        texts.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(texts)


def explain(exc: BaseException) -> str | None:
    """This rank's one line for a collective check that failed (None: not one). For a rank that
    did not come, ask it for its stack first (it prints it and ends)."""
    if not _STATE["on"]:
        return None
    text = _texts(exc)
    me = os.environ.get("RANK", "?")
    where = process_group.where()
    m = _MISMATCH.search(text)
    if m:
        a, fa, b, fb = m.group(1), m.group(2), m.group(3), m.group(4)
        (op_a, shape_a, dt_a, seq), (op_b, shape_b, dt_b, _) = _fingerprint(fa), _fingerprint(fb)
        ours = f"{op_a} of shape {shape_a} ({dt_a})"
        theirs = f"{op_b} of shape {shape_b} ({dt_b})"
        if "?" in (shape_b, dt_b) or a != me:
            # torch decoded the other rank's fingerprint from a gather that itself mismatched (it
            # then reads e.g. "SCATTER of shape ?"): ask that rank what it runs, through the store.
            mine = ours + (f", called from {_STATE['failed_in'].split(', called from ')[-1]}"
                           if _STATE.get("failed_in") else "")
            told = _exchange(me, mine, b if a == me else a)
            if told:
                theirs = told
        return (f"[rank {me}] zerotrain: error: collective mismatch at {where}: rank {a} runs {ours} where rank {b} "
                f"runs {theirs} (collective #{seq}); ranks {min(a, b, key=int)} and {max(a, b, key=int)} differ. Every rank must run the same collectives in the same "
                f"order: look for work done on some ranks only (a save, an evaluation or a reduction under "
                f"`if rank == ...`) or a tensor whose shape depends on the rank (docs/troubleshooting.md "
                f"\"Collective mismatch\"). {_checkpoint_line()}")
    m, root = _MISSING.search(text), _NO_ROOT.search(text)
    if root and process_group.size() > 2:  # rank 0 may be the stuck one, or waiting for another: its line says
        return (f"[rank {me}] zerotrain: error: rank {root.group(1)} did not answer at the collective at {where} "
                f"within {_STATE['timeout_s']} s ({_STATE['timeout_key']}): it is stuck outside any collective, "
                f"or it names the rank that is in its own line. {_checkpoint_line()}")
    if m or root:
        missing = [int(r) for r in re.findall(r"\d+", m.group(1))] if m else [int(root.group(1))]
        waited = int(m.group(2)) / 1000 if m else _STATE["timeout_s"]
        answers = _ask_for_stacks(missing, waited)
        mine = _STATE.get("failed_in") or _in_collective() or "a collective"
        if answers:  # they are in collectives of other groups: name both, and tell them what this rank runs
            _tell(list(answers), f"{me}|{mine}")
            return _mismatch_line(me, mine, answers, where, waited)
        who = "rank" + ("s " if len(missing) > 1 else " ") + ", ".join(map(str, missing))
        return (f"[rank {me}] zerotrain: error: {who} did not come to the collective at {where} within "
                f"{waited:.0f} s ({_STATE['timeout_key']}): stuck outside any collective (a data loader, an "
                f"endless loop, work on that rank only) or one collective short; its Python stack is in its own "
                f"output (\"[rank {missing[0]}] zerotrain: error: this rank is stuck\"). "
                f"{_checkpoint_line()}")
    return None


def _mismatch_line(me: str, mine: str, others: dict, where: str, waited: float) -> str:
    """One rank's line where ranks wait in collectives of different process groups."""
    theirs = "; ".join(f"rank {r} runs {a}" for r, a in sorted(others.items(), key=lambda x: int(x[0])))
    ranks = ", ".join(sorted([me, *map(str, others)], key=lambda r: int(r) if r.isdigit() else -1))
    return (f"[rank {me}] zerotrain: error: collective mismatch at {where}: rank {me} runs {mine}, where {theirs}; "
            f"ranks {ranks} differ (collectives of different process groups never meet: found after {waited:.0f} s, "
            f"{_STATE['timeout_key']}). Every rank must run the same collectives in the same order: look for a "
            f"collective under `if rank == ...` in the code named (docs/troubleshooting.md \"Collective "
            f"mismatch\"). {_checkpoint_line()}")


def _tell(ranks: list[int], what: str) -> None:
    """Tell ranks that answered they are in a collective what this rank runs (they print their line)."""
    store = peers.store_client()
    if store is None:
        return
    try:
        for r in ranks:
            store.set(_stack_key(r) + "/peer", what)
    except Exception:  # noqa: BLE001 - the store is gone
        pass


def _exchange(me: str, mine: str, other: str, wait_s: float = 10.0) -> str | None:
    """Publish what this rank runs and read what `other` published (None after wait_s)."""
    store = peers.store_client()
    if store is None:
        return None
    start = peers.PEERS["roster"][0]["start"]
    try:
        store.set(f"zerotrain/runs/{start}/{me}", mine)
        key = f"zerotrain/runs/{start}/{other}"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not store.check([key]):
            time.sleep(0.05)
        return store.get(key).decode() if store.check([key]) else None
    except Exception:  # noqa: BLE001 - the store is gone
        return None


def report(exc: BaseException) -> bool:
    """Print this rank's one line for a collective check that failed (False: `exc` is not one).
    Ranks at different collectives all raise: each then waits (at most OTHERS_LINES_S) until the
    others printed theirs too, since the launcher stops every rank once one exits. The wait ends
    as soon as every rank has printed; its bound is generous because a loaded machine can delay
    a peer's raise by seconds."""
    line = explain(exc)
    if line is None:
        return False
    say(line)
    # A rank that never came prints its stack instead (_ask_for_stacks); ranks at different
    # collectives (of one group or of several) each print their own line: wait for theirs.
    if not _MISSING.search(_texts(exc)) or "collective mismatch" in line:
        _wait_for_the_others_lines()
    return True


OTHERS_LINES_S = 30.0


def _wait_for_the_others_lines(wait_s: float = OTHERS_LINES_S) -> None:
    store = peers.store_client()
    if store is None:
        return
    start = peers.PEERS["roster"][0]["start"]

    def key(rank) -> str:
        return f"zerotrain/desync/{start}/{rank}"

    try:
        store.set(key(os.environ.get("RANK", "?")), "1")
        others = [key(r["rank"]) for r in peers.PEERS["roster"]]
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not store.check(others):
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store's host is gone: nobody left to wait for
        pass


def _stack_key(rank: int) -> str:
    return f"zerotrain/stack/{peers.PEERS['roster'][0]['start']}/{rank}"


def _ask_for_stacks(ranks: list[int], waited_s: float, wait_s: float = 15.0) -> dict[int, str]:
    """Ask each rank in `ranks` for its stack, and wait (at most wait_s) until they printed it:
    this rank exiting first would have the launcher stop them before they do. Returns the
    answers of those that are in a collective ({rank: what it runs}): they print no stack."""
    store = peers.store_client()
    if store is None:
        return {}
    me = os.environ.get("RANK", "?")
    answers = {}
    try:
        for r in ranks:
            store.set(_stack_key(r), f"{me}:{waited_s:.0f}")
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not store.check([_stack_key(r) + "/done" for r in ranks]):
            time.sleep(0.1)
        for r in ranks:
            if store.check([_stack_key(r) + "/in"]):
                answers[r] = store.get(_stack_key(r) + "/in").decode()
    except Exception:  # noqa: BLE001 - the store's host is gone: nothing more to ask
        pass
    return answers


class StackOnRequest(threading.Thread):
    """Every rank, while the check is on: a peer that waited in vain for this rank asks, through
    the rendezvous store, for its stack. This thread then prints one line and the Python stack of
    every thread (faulthandler), and ends the process (its main thread is stuck)."""

    def __init__(self, rank: int):
        super().__init__(name="zerotrain-stack-on-request", daemon=True)
        self.rank = rank

    @classmethod
    def start_for(cls, rank: int) -> StackOnRequest | None:
        if not _STATE["on"] or process_group.size() < 2:
            return None
        t = cls(rank)
        t.start()
        return t

    def answer(self, store, key: str, inside: str, waited: str) -> None:
        """Asked while in a collective (of another group than the asker's): say which, then print
        this rank's own line once the asker said what it runs, and end (this rank's collective
        would wait until the asker's exit; the launcher then stops it before its own line)."""
        store.set(key + "/in", inside)
        store.set(key + "/done", "1")
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and not store.check([key + "/peer"]):
            time.sleep(0.1)
        if not store.check([key + "/peer"]):
            return
        asker, theirs = store.get(key + "/peer").decode().split("|", 1)
        say(_mismatch_line(str(self.rank), inside, {asker: theirs}, process_group.where(), float(waited)))
        try:
            store.set(f"zerotrain/desync/{peers.PEERS['roster'][0]['start']}/{self.rank}", "1")
        except Exception:  # noqa: BLE001
            pass
        time.sleep(1.0)
        os._exit(1)

    def run(self):
        store = peers.store_client(timeout_s=max(2.0, ASK_EVERY_S * 4))
        if store is None:
            return
        key = _stack_key(self.rank)
        while True:
            time.sleep(ASK_EVERY_S)
            try:
                if not store.check([key]):
                    continue
                asker, waited = store.get(key).decode().split(":")
                inside = _in_collective()
                if inside is not None:  # checked against its own record and stack: not stuck, elsewhere
                    self.answer(store, key, inside, waited)
                    continue
            except Exception:  # noqa: BLE001 - the store is gone (the run ended): stop asking
                return
            say(f"[rank {self.rank}] zerotrain: error: this rank is stuck outside any collective at "
                f"{process_group.where()}: rank {asker} waited {waited} s for it in a collective. Its Python "
                f"stack (most recent call first):")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
            try:
                store.set(key + "/done", "1")
            except Exception:  # noqa: BLE001
                pass
            time.sleep(1.0)  # the asking rank prints its line first: the launcher stops the others once one exits
            os._exit(1)


peers.PEERS_API.report_collective_failure = report  # user_errors (train/errors.py) asks it first
