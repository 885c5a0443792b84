"""checkpoint.every_minutes (issue 17): which steps save, decided from rank 0's clock alone, and
DeepSpeed's /dev/shm buffers: released by their owners, stale ones swept, live ones never touched.

In-process: the save decision of train/checkpoint/cadence.py driven by fake clocks through a
vote that behaves like the trainer's StopVote (summed over the ranks, read one step later), and
the real StopVote on a one-process gloo group. The real 2-process agreement is checked by
tests/test_reliability.py (time-based saves during the SIGTERM run), the real release by
tests/test_launchers.py (the deepspeed-launcher run). The shm tests use real files in /dev/shm
and real child processes holding them.
"""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import free_port
from zerotrain.train.checkpoint.cadence import SaveCadence
from zerotrain.train.config import load_config
from zerotrain.train.errors import ConfigError
from zerotrain.train.launch import shm_buffers


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def simulate(steps: int, every_steps: int, every_minutes: float, step_s: list[float], save_s: float,
             delay: int = 1) -> list[list[tuple[int, str]]]:
    """The trainer's loop on len(step_s) ranks: each step advances rank r's clock by step_s[r];
    the tickets are summed and read back `delay` steps later (StopVote: 1; one process: 0); a
    save advances every clock by save_s. Returns each rank's [(step, why)] of saves."""
    ranks = len(step_s)
    clocks = [FakeClock(1000.0 * r) for r in range(ranks)]   # rank clocks far apart: only rank 0's counts
    cad = [SaveCadence(every_steps, every_minutes, is_main=(r == 0), clock=clocks[r]) for r in range(ranks)]
    in_flight, saves = [], [[] for _ in range(ranks)]
    for step in range(1, steps + 1):
        for r in range(ranks):
            clocks[r].t += step_s[r]
        in_flight.append(sum(c.ticket() for c in cad))
        voted = in_flight.pop(0) if len(in_flight) > delay else 0.0
        done = step == steps
        whys = [c.due(step, voted, done) for c in cad]
        for r in range(ranks):
            if whys[r]:
                saves[r].append((step, whys[r]))
                clocks[r].t += save_s
                cad[r].saved()
    return saves


def test_every_minutes_saves_one_step_after_rank_0s_clock_runs_out():
    """1 minute, 7 s steps, 5 s saves on rank 0's clock. Rank 0's ticket first shows at the end of
    step 9 (63 s), is read at step 10: save. The clock restarts when the save ends (75 s), so
    the next ticket shows at step 19 (7*19 + 5 = 138 >= 75 + 60), save at 20; then 30. The vote
    cast at step 10, read after that save, carries the old number and does not save again.
    Rank 1's clock (1000 s ahead, 3 s steps) plays no part: every rank saves at the same steps."""
    saves = simulate(35, every_steps=0, every_minutes=1.0, step_s=[7.0, 3.0], save_s=5.0)
    assert saves[0] == saves[1] == [(10, "minutes"), (20, "minutes"), (30, "minutes")]


def test_every_steps_and_every_minutes_whichever_comes_first():
    """every_steps 12 and every_minutes 1 (7 s steps, 5 s saves): minutes at 10, steps at 12 (its
    multiples do not move) - the step save restarts the clock at 7*12 + 5 + 5 = 94, so the next
    ticket shows at 7k + 10 >= 154, k = 21, save at 22; then the step save at 24 restarts it
    at 7*24 + 15 + 5 = 188: ticket at 7k + 20 >= 248, k = 33 - the step save at 36 comes first."""
    saves = simulate(40, every_steps=12, every_minutes=1.0, step_s=[7.0, 7.0, 7.0, 7.0], save_s=5.0)
    assert saves[0] == [(10, "minutes"), (12, "steps"), (22, "minutes"), (24, "steps"), (34, "minutes"),
                        (36, "steps")]
    assert saves[1] == saves[2] == saves[3] == saves[0]


def test_one_process_reads_its_own_clock_at_once_and_the_last_step_never_saves():
    """One process (no vote delay): the ticket of step 9 saves at step 9. The last step is left to
    checkpoint.save_at_end, and every_minutes 0 saves nothing."""
    assert simulate(30, 0, 1.0, [7.0], 0.0, delay=0)[0] == [(9, "minutes"), (18, "minutes"), (27, "minutes")]
    assert simulate(9, 0, 1.0, [7.0], 0.0, delay=0)[0] == []
    assert simulate(50, 0, 0.0, [7.0, 7.0], 0.0) == [[], []]


def test_the_stop_vote_carries_the_ticket_one_step_late():
    """The real StopVote (an async all-reduce of a CPU tensor) on a one-process gloo group: the
    stop flag and the ticket come back together, one call later."""
    import torch
    import torch.distributed as dist
    from zerotrain.train.training.tick import StopVote
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        class Acc:
            num_processes = 2  # as if distributed: the vote goes through the collective
        vote = StopVote(Acc(), 2)
        assert vote.dist
        got = []
        for flag, ticket in [(False, 0.0), (False, 3.0), (False, 0.0), (True, 0.0)]:
            got.append(vote([float(flag), ticket]))  # (stop, ticket) as cast a step ago
        assert got == [None, (0.0, 0.0), (0.0, 3.0), (0.0, 0.0)]
        assert vote.finish() == (1.0, 0.0)
        assert all(b.device == torch.device("cpu") for b in vote.buffers)
    finally:
        dist.destroy_process_group()


def test_every_minutes_is_validated():
    assert load_config(None, [("checkpoint.every_minutes", "0.5")]).checkpoint.every_minutes == 0.5
    assert load_config(None, []).checkpoint.every_minutes == 0.0
    for bad in ("-1", "nan", "inf", "soon"):
        with pytest.raises(ConfigError, match="checkpoint.every_minutes"):
            load_config(None, [("checkpoint.every_minutes", bad)])


# ---------------------------------------------------------------------------- /dev/shm buffers

HOLDER = r"""
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 4096)
if sys.argv[2] == "map-only":
    os.close(fd)                       # only /proc/<pid>/maps shows it now
print("ready", flush=True)
sys.stdin.readline()                   # the test says when to read
print(m[:5].decode(), flush=True)      # the bytes the other side wrote, after the unlink
"""


class Holder:
    """A child process that opens and maps `path` (fd kept, or closed: mapping only)."""

    def __init__(self, path: Path, how: str):
        self.proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), how], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def read_back(self) -> str:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        out = self.proc.stdout.readline().strip()
        self.proc.wait(timeout=10)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def shm_files():
    made = []

    def make(port, rank, uid=None, name=None) -> Path:
        p = shm_buffers.SHM_DIR / (name or shm_buffers.buffer_name(rank, "127.0.0.1", str(port), uid))
        p.write_bytes(b"\0" * 4096)
        made.append(p)
        return p
    yield make
    for p in made:
        p.unlink(missing_ok=True)


def test_sweep_removes_only_buffers_no_live_job_can_own(shm_files):
    """Real files in /dev/shm. Removed: the unheld buffer of a port nobody listens on. Kept: one
    a child process has open, one a child has only mapped (fd closed), one whose port has a
    listener (a live job's rendezvous store), one younger than min_age_s, another uid's, and a
    file that is not a DeepSpeed buffer."""
    if not shm_buffers.SHM_DIR.is_dir():
        pytest.skip("no /dev/shm")
    dead = free_port()
    stale = shm_files(dead, 0)
    held, mapped = shm_files(dead, 1), shm_files(dead, 2)
    other_uid = shm_files(dead, 0, uid=os.geteuid() + 4242)
    unrelated = shm_files(dead, 0, name=f"zerotrain_test_not_a_buffer_{dead}")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    live_port = listener.getsockname()[1]
    of_live_job = shm_files(live_port, 0)
    holders = [Holder(held, "open"), Holder(mapped, "map-only")]
    try:
        young = shm_files(dead, 3)
        old = time.time() - 3600
        for p in (stale, held, mapped, other_uid, unrelated, of_live_job):
            os.utime(p, (old, old))
        removed = shm_buffers.sweep_stale(min_age_s=60)  # (also any stale buffer ended jobs left)
        assert stale in removed and not stale.exists()
        assert all(p.exists() for p in (held, mapped, other_uid, unrelated, of_live_job, young))
        # Once the holders are gone (and the listener closed), those are stale too.
    finally:
        for h in holders:
            h.stop()
        listener.close()
    assert {held, mapped, of_live_job, young} <= set(shm_buffers.sweep_stale(min_age_s=0))
    assert other_uid.exists() and unrelated.exists()


def test_a_rank_releases_its_own_buffer_while_a_peer_keeps_using_it(shm_files, monkeypatch):
    """What every exit path runs (release_at_exit): this process maps both ranks' buffers of its
    job (as shm.cpp leaves them), so it unlinks rank 0's - its own - and not rank 1's. A peer
    that mapped rank 0's buffer still reads what is written into it after the unlink. A process
    that has not mapped all of its job's buffers (still inside shm_initialize) unlinks nothing."""
    port = free_port()
    own, peer_file = shm_files(port, 0), shm_files(port, 1)
    maps = []
    for p in (own, peer_file):
        with open(p, "r+b") as f:
            maps.append(mmap.mmap(f.fileno(), 4096))
    peer = Holder(own, "map-only")
    try:
        for k, v in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(port)}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setitem(shm_buffers._state, "rank", None)
        monkeypatch.setitem(shm_buffers._state, "world", None)
        assert shm_buffers.own_buffer(0) == own
        shm_buffers.release_at_exit()
        assert not own.exists() and peer_file.exists()
        maps[0][:5] = b"alive"
        assert peer.read_back() == "alive"
        # Rank 1 of a 3-rank job that has mapped only 2 buffers: a peer may still need the name.
        monkeypatch.setenv("RANK", "1")
        monkeypatch.setenv("WORLD_SIZE", "3")
        monkeypatch.setenv("LOCAL_SIZE", "3")
        shm_buffers.release_at_exit()
        assert peer_file.exists()
    finally:
        peer.stop()
        for m in maps:
            m.close()


def test_buffer_names_are_parsed_as_deepspeed_forms_them():
    name = shm_buffers.buffer_name(1, "10.0.0.5", "29500", uid=1000)
    assert name == "deepspeed_allreduce_buffer_1000_10.0.0.5_29500_1"
    assert shm_buffers.parse_name(name) == {"uid": 1000, "addr": "10.0.0.5", "port": 29500, "rank": 1}
    unset = shm_buffers.buffer_name(12, "", "", uid=0)  # MASTER_ADDR and MASTER_PORT unset
    assert shm_buffers.parse_name(unset) == {"uid": 0, "addr": "", "port": None, "rank": 12}
    assert shm_buffers.parse_name("something_else_0_1") is None
