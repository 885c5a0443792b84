"""Elastic multi-node runs (issue 17): torchrun's elastic agents lose a node, re-form a smaller
group, and zerotrain resumes by itself from the newest checkpoint with the same global batch;
the node comes back and is taken in at the next restart.

Real agents (`torchrun --nnodes 1:2 --max-restarts 3`, c10d rendezvous) on loopback: two agents
on this machine play the two nodes. A node dies at a known step (ZEROTRAIN_INJECT_KILL_NODE in
its environment only: its rank SIGKILLs its agent and itself, so nothing of that node is left),
and the single-node attempt holds after a known step until the agent's scale-up SIGTERM arrives
(ZEROTRAIN_INJECT_HOLD), so every step number below is exact however fast or slow the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from helpers import BIN, MAIN, REPO, TINY, data_trace, free_port, metrics, run_train, subprocess_env
from wandb_offline import read_run, run_files, wandb_env

STEPS, EVERY, KILL_AT, HOLD_AT = 14, 3, 8, 9   # saves at 3, 6 | node 1 dies after 8 | alone: 7..10 | both: 11..14
GLOBAL = 16                                      # micro 4 x accum 2 x 2 ranks, or x accum 4 x 1 rank
WAIT_S = 600                                     # bounds every wait: a hang fails with the logs
DEATH_S = 15                                     # a SIGKILLed node's processes are gone within this
RDZV_CONF = "last_call_timeout=2,join_timeout=300,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"


def elastic_args(ds_json: str, run_dir: Path) -> list[str]:
    return [*TINY, "--ds-config", ds_json, "--train.max_steps", str(STEPS), "--train.eval_every", "0",
            "--debug.trace_data", "true", "--train.global_batch_size", str(GLOBAL),
            "--checkpoint.every_steps", str(EVERY), "--checkpoint.keep_last", "10", "--checkpoint.export", "true",
            "--checkpoint.export_dtype", "fp32", "--distributed.timeout_s", "60", "--train.run_dir", str(run_dir)]


def clean_shm():
    """DeepSpeed's CPU comm buffers left by killed ranks (66 MB each), unless a process has them open."""
    if not shutil.which("fuser"):
        return
    for f in Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"):
        if subprocess.run(["fuser", "-s", str(f)], capture_output=True).returncode != 0:
            f.unlink(missing_ok=True)


class Agent:
    """One torchrun elastic agent (a "node"), its output in a log file, in a session of its own."""

    def __init__(self, name: str, port: int, is_host: bool, args: list[str], workdir: Path, env: dict | None = None):
        self.name, self.log = name, workdir / f"{name}.log"
        cmd = [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "3",
               "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", f"zt-elastic-{port}",
               "--rdzv_conf", f"is_host={int(is_host)},{RDZV_CONF}", "--local_addr", "127.0.0.1", MAIN, *args]
        # torch 2.14.1: with the rendezvous store shared with the workers (its default), a node that
        # joins a later round waits forever for the round's MASTER_ADDR when the rank-0 node kept
        # its rank (dynamic_rendezvous.py next_rendezvous only publishes it on a node's first round
        # or when it newly becomes rank 0): docs/multinode.md, fault-tolerant recipe.
        env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **(env or {})}
        with open(self.log, "w") as fh:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=subprocess_env(env), stdout=fh, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.pid = self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(stat.parent.name))
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out += kids.get(p, [])
        todo += kids.get(p, [])
    return out


def kill_all(agents: list[Agent]):
    """Teardown: every agent's process group and each of its ranks' (torchrun starts every rank
    in a session of its own)."""
    for a in agents:
        for pid in [*descendants(a.pid), a.pid]:
            for kill in (os.killpg, os.kill):   # a rank leads its own group; its helpers may not
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        if a.proc.poll() is None:
            a.proc.kill()
        a.proc.wait(timeout=30)


def logs(agents: list[Agent]) -> str:
    return "\n".join(f"--- {a.name} (exit {a.proc.poll()})\n{a.output()[-6000:]}" for a in agents)


def wait_until(what: str, cond, agents: list[Agent], timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{logs(agents)}")
        time.sleep(0.2)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def events(run_dir: Path) -> list[dict]:
    return [r for r in metrics(run_dir) if r.get("event") == "membership"]


def left_text(node_rank: int, pid: int) -> str:
    return f"node {node_rank} ({socket.gethostname()}, 127.0.0.1; rank {node_rank}; launcher pid {pid})"


def step_samples(run_dir: Path, ranks, steps) -> dict[int, list[int]]:
    """Every sample (crc) trained at each optimizer step (1-based), over the given ranks' traces.
    A rank's trace is appended by every attempt that had that rank: a step trained again after a
    resume keeps the rows of the last attempt (an attempt starts where the step goes back)."""
    out: dict[int, list[int]] = {}
    for r in ranks:
        seen: dict[int, list[int]] = {}
        last = -1
        for row in data_trace(run_dir, r):
            step = row["step"] + 1   # the trace records the step being trained, 0-based
            if step < last:          # a new attempt: what it trains again replaces the old rows
                for s in [s for s in seen if s >= step]:
                    del seen[s]
            last = step
            seen.setdefault(step, []).extend(row["crc"])
        for s, crcs in seen.items():
            if s in steps:
                out.setdefault(s, []).extend(crcs)
    return {s: sorted(v) for s, v in out.items()}


@pytest.mark.multiproc
def test_elastic_loses_a_node_resumes_alone_then_takes_it_back(tmp_path, fp32_configs):
    """Two agents (nodes) train ZeRO-2 fp32; node B dies (agent and rank) after step 8, with the
    last checkpoint at step 6. Without anyone relaunching: A's rank fails fast, A's agent re-forms
    a group of one, the new rank resumes from step 6 with accumulation 4 instead of 2 (global batch
    16 kept) and says who left and that 2 steps were lost. Its losses equal a 1-process run resumed
    from a copy of that checkpoint. Then B is started again: A's agent SIGTERMs its rank for the
    scale-up (after step 9 the rank waits for it), which saves step 10 and exits 0; both nodes
    resume from step 10 (0 steps lost) and finish; the final weights load back."""
    clean_shm()
    ds, run = fp32_configs["zero2"], tmp_path / "run"
    args = elastic_args(ds, run)
    port = free_port()
    wb = wandb_env(tmp_path / "wandb-home")   # W&B offline: one run throughout
    t0 = time.monotonic()
    # B first: as a client it waits for the store that A hosts, so both join the first round together.
    b = Agent("B", port, False, args, tmp_path, {**wb, "ZEROTRAIN_INJECT_KILL_NODE": str(KILL_AT)})
    a = Agent("A", port, True, args, tmp_path, {**wb, "ZEROTRAIN_INJECT_HOLD": str(HOLD_AT)})
    agents = [a, b]
    try:
        wait_until("node B dies after step 8", lambda: b.proc.poll() is not None, agents)
        assert b.proc.returncode == -signal.SIGKILL, logs(agents)
        assert descendants(b.pid) == [], "a process of the dead node is still running"
        t_kill = time.time()
        record = run / "elastic.json"
        wait_until("A restarts alone", lambda: (read_json(record) or {}).get("restarts") == 1, agents)
        # B returns once A, alone, has done step 9 and waits there for the agent's SIGTERM: the
        # scale-up restart then always lands between steps 9 and 10.
        wait_until("A alone reaches step 9", lambda: any(r.get("step") == HOLD_AT and "loss" in r and r["time"] > t_kill
                                                        for r in metrics(run)), agents)
        b2 = Agent("B2", port, False, args, tmp_path, wb)   # the node comes back (no fault this time)
        agents.append(b2)
        for x in (a, b2):
            wait_until(f"{x.name} finishes", lambda x=x: x.proc.poll() is not None, agents)
        assert (a.proc.returncode, b2.proc.returncode) == (0, 0), logs(agents)
    finally:
        kill_all(agents)
        clean_shm()
    elapsed = time.monotonic() - t0
    first = min(r["time"] for r in metrics(run) if r.get("step") == KILL_AT - 1 and "loss" in r and r["time"] > t_kill)
    print(f"\nelastic loopback: node B's death -> A's first resumed step (7) logged: {first - t_kill:.1f} s")
    out = a.output() + b2.output()

    # Where each node sat: the rendezvous orders nodes by (address, agent pid) - both 127.0.0.1 here.
    b_rank = int(b.pid > a.pid)
    lost = (f"zerotrain: elastic restart 1: {left_text(b_rank, b.pid)} left; world size 2 -> 1 (global batch 16 = "
            f"micro 4 x accum 4 x 1); resumed from {run}/checkpoints/step_00000006 (step 6); 2 steps lost "
            f"(the previous attempt had completed step 8)")
    assert lost in out, out[-6000:]
    b2_rank = int(b2.pid > a.pid)
    back = (f"zerotrain: elastic restart 2: {left_text(b2_rank, b2.pid)} joined; world size 1 -> 2 (global batch "
            f"16 = micro 4 x accum 2 x 2); resumed from {run}/checkpoints/step_00000010 (step 10); 0 steps lost "
            f"(the previous attempt had completed step 10)")
    assert back in out, out[-6000:]
    assert out.count("zerotrain: elastic restart") == 2
    ev = events(run)
    assert [{k: v for k, v in e.items() if k != "time"} for e in ev] == [
        {"step": 6, "event": "membership", "elastic/restart": 1, "elastic/left": left_text(b_rank, b.pid),
         "elastic/joined": "", "elastic/world_size": 1, "elastic/previous_world_size": 2,
         "elastic/resumed_from": f"{run}/checkpoints/step_00000006", "elastic/resumed_step": 6,
         "elastic/steps_lost": 2},
        {"step": 10, "event": "membership", "elastic/restart": 2, "elastic/left": "",
         "elastic/joined": left_text(b2_rank, b2.pid), "elastic/world_size": 2, "elastic/previous_world_size": 1,
         "elastic/resumed_from": f"{run}/checkpoints/step_00000010", "elastic/resumed_step": 10,
         "elastic/steps_lost": 0}]
    summary = f"  elastic      2 restarts of job zt-elastic-{port}, 2 steps recomputed, now 2 process(es) on 2 node(s)"
    assert summary in out, out[-4000:]
    final = [r for r in metrics(run) if "final/elastic_restarts" in r]
    # Each attempt that ended by itself logged its final row: A stopped for the scale-up, then the end.
    assert [(r["step"], r["final/elastic_restarts"], r["final/steps_recomputed"]) for r in final] == [(10, 1, 2),
                                                                                                       (14, 2, 2)]
    rec = read_json(run / "elastic.json")
    assert (rec["restarts"], rec["steps_recomputed"], rec["world_size"], rec["global_batch"]) == (2, 2, 2, 16)
    # One W&B run: each attempt's rank 0 (B's first, then A's twice) wrote to the same run id, and
    # the membership rows reached its summary.
    runs = [read_run(f) for f in run_files(run / "wandb")]
    assert len(runs) == 3 and {i for r in runs for i in r.run_ids} == {rec["wandb_run_id"]}, runs
    assert [(r.summary.get("elastic/restart"), r.summary.get("elastic/steps_lost")) for r in runs[1:]] == \
        [(1, 2), (2, 0)]

    # The checkpoint the reference resumes from: step 6, saved by 2 ranks before node B died.
    ref_ckpt = tmp_path / "ref_ckpt" / "step_00000006"
    shutil.copytree(run / "checkpoints" / "step_00000006", ref_ckpt)
    assert json.loads((ref_ckpt / "manifest.json").read_text())["world_size"] == 2
    ref = tmp_path / "ref"
    run_train("python", 1, [*elastic_args(ds, ref), "--resume", str(ref_ckpt)])
    got, want = {s: v for s, v in metrics_losses(run).items()}, metrics_losses(ref)
    assert sorted(want) == list(range(7, STEPS + 1))
    # Node A alone (7..10): the same world size as the reference, the same arithmetic.
    assert {s: got[s] for s in range(7, 11)} == pytest.approx({s: want[s] for s in range(7, 11)}, rel=1e-6, abs=1e-6)
    # Both nodes again (11..14), resumed from the SIGTERM save at step 10: world 2, accumulation 2.
    assert {s: got[s] for s in range(11, STEPS + 1)} == pytest.approx(
        {s: want[s] for s in range(11, STEPS + 1)}, rel=1e-6, abs=1e-6)
    # Every step trained the samples the reference trained: A alone, then the two ranks together.
    ref_data = step_samples(ref, [0], range(7, STEPS + 1))
    assert step_samples(run, [0], range(7, 11)) == {s: ref_data[s] for s in range(7, 11)}
    assert step_samples(run, [0, 1], range(11, STEPS + 1)) == {s: ref_data[s] for s in range(11, STEPS + 1)}
    # The final weights load back and equal the reference's.
    from safetensors.torch import load_file
    mine, theirs = (load_file(str(d / "export" / "model.safetensors")) for d in (run, ref))
    assert sorted(mine) == sorted(theirs) and len(mine) > 0
    for k in mine:
        assert mine[k].dtype == theirs[k].dtype and mine[k].shape == theirs[k].shape
        assert (mine[k] - theirs[k]).abs().max().item() <= 1e-5, k
    print(f"elastic loopback: the whole sequence {elapsed:.0f} s (reference launch excluded)")


def metrics_losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss as last logged (a step trained again after a resume replaces the lost attempt's)."""
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


# ---------------------------------------------------------------------------------------- two-node rig
@pytest.mark.multiproc
@pytest.mark.multinode
def test_elastic_two_nodes_lose_node1_and_finish_on_node0(two_nodes, fp32_configs, tmp_path):
    """The same on the two-node rig (network namespaces, traffic over the veth): a 2-node elastic
    ZeRO-2 fp32 run, every process of node1 killed after step 8 (last checkpoint: step 6); node0's
    agent restarts alone and the run finishes there without a relaunch; its losses after step 6
    equal a 1-process run resumed from a copy of that checkpoint, and the final weights load back."""
    from multinode.fixture import finish, logs as rig_logs, node_env, start
    clean_shm()
    rig, ds = two_nodes, fp32_configs["zero2"]
    node0, node1 = rig.nodes
    run, port = tmp_path / "run", rig.port()
    args = elastic_args(ds, run)

    def agent(node, **env):
        return start(rig, node, [str(BIN / "torchrun"), "--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts",
                                 "3", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"node0:{port}", "--rdzv_id",
                                 f"zt{port}", "--rdzv_conf", f"is_host={int(node is node0)},{RDZV_CONF}",
                                 "--local_addr", node.addr, MAIN, *args], tmp_path, "elastic",
                     node_env(rig, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", **env}))

    la1 = agent(node1, ZEROTRAIN_INJECT_KILL_NODE=str(KILL_AT))   # the client first: both join round 0 together
    la0 = agent(node0)
    launches = [la0, la1]
    try:
        deadline = time.monotonic() + WAIT_S
        while la1.proc.poll() is None:
            assert time.monotonic() < deadline, f"node1 still alive after {WAIT_S} s\n{rig_logs(launches)}"
            time.sleep(0.2)
        t_kill = time.time()
        # The rank kills the agent, then its own process group: SIGKILL lands at once, but a
        # dying process with torch's address space takes a moment to go. Allow it that, no more.
        gone_by = time.monotonic() + DEATH_S
        while (left_on_node1 := rig.processes(node1)) and time.monotonic() < gone_by:
            time.sleep(0.1)
        codes = finish(rig, launches, WAIT_S)
    finally:
        clean_shm()
    assert left_on_node1 == [], f"processes of node1 survived its death: {left_on_node1}"
    assert codes == [0, -signal.SIGKILL], rig_logs(launches)
    out = la0.output()
    first = min(r["time"] for r in metrics(run) if r.get("step") == KILL_AT - 1 and "loss" in r and r["time"] > t_kill)
    print(f"\nelastic rig: node1's death -> node0's first resumed step (7) logged: {first - t_kill:.1f} s")
    assert "zerotrain: 2 nodes joined: node 0 (node0, 10.77.0.1; rank 0); node 1 (node1, 10.77.0.2; rank 1)" in out
    line = (f"zerotrain: elastic restart 1: node 1 (node1, {node1.addr}; rank 1; launcher pid {la1.proc.pid}) left; "
            f"world size 2 -> 1 (global batch 16 = micro 4 x accum 4 x 1); resumed from "
            f"{run}/checkpoints/step_00000006 (step 6); 2 steps lost (the previous attempt had completed step 8)")
    assert line in out, out[-6000:]
    assert f"  elastic      1 restart of job zt{port}, 2 steps recomputed, now 1 process(es) on 1 node(s)" in out

    ref_ckpt = tmp_path / "ref_ckpt" / "step_00000006"
    shutil.copytree(run / "checkpoints" / "step_00000006", ref_ckpt)
    ref = tmp_path / "ref"
    run_train("python", 1, [*elastic_args(ds, ref), "--resume", str(ref_ckpt)])
    got, want = metrics_losses(run), metrics_losses(ref)
    assert sorted(want) == list(range(7, STEPS + 1))
    assert {s: got[s] for s in want} == pytest.approx(want, rel=1e-6, abs=1e-6)
    from safetensors.torch import load_file
    mine, theirs = (load_file(str(d / "export" / "model.safetensors")) for d in (run, ref))
    assert sorted(mine) == sorted(theirs) and len(mine) > 0
    assert all(bool((mine[k] - theirs[k]).abs().max() <= 1e-6) for k in mine)


# ---------------------------------------------------------------------------------------- no processes
def _node(rank: int, agent: str, pid: int, host: str = "h") -> dict:
    return {"node_rank": rank, "host": host, "addr": f"10.0.0.{rank + 1}", "agent": agent, "agent_pid": pid,
            "ranks": [rank]}


def test_only_a_restart_of_the_same_job_resumes_by_itself(tmp_path):
    """A start is a restart when the rendezvous run id matches elastic.json and one of its
    launchers (torchrun agents: boot id, pid, start time) already ran this job; a relaunched job in
    the same run dir has only new agents and starts fresh; an explicit --resume still wins."""
    from zerotrain.train.config import RunConfig
    from zerotrain.train.errors import ConfigError
    from zerotrain.train.launch.elastic import PROGRESS, RECORD, ElasticRun
    a, b, c = _node(0, "boot:100:7", 100), _node(1, "boot:200:9", 200, "h1"), _node(1, "boot:300:11", 300, "h2")
    (tmp_path / RECORD).write_text(json.dumps({"run_id": "job", "agents": [a["agent"], b["agent"]], "nodes": [a, b],
                                               "world_size": 2, "global_batch": 16, "restarts": 0,
                                               "steps_recomputed": 0, "wandb_run_id": "w1"}))
    (tmp_path / PROGRESS).write_text(f"{8:>20d}\n")
    assert ElasticRun._decide(tmp_path, "other-job", [a]) == {}            # another rendezvous id
    assert ElasticRun._decide(tmp_path, "job", [_node(0, "boot:100:8", 100)]) == {}  # pid reused, not the agent
    d = ElasticRun._decide(tmp_path, "job", [a])                           # b is gone
    assert (d["restart"], d["number"], d["left"], d["joined"], d["previous_world"], d["previous_step"],
            d["global_batch"], d["wandb_run_id"]) == (True, 1, [b], [], 2, 8, 16, "w1")
    d = ElasticRun._decide(tmp_path, "job", [a, c])                        # b replaced by c
    assert (d["left"], d["joined"]) == ([b], [c])
    assert ElasticRun._decide(tmp_path / "none", "job", [a]) == {}        # first start: nothing recorded

    run = ElasticRun(run_dir=tmp_path, run_id="job", is_main=True, world=1, nodes=[a],
                     **ElasticRun._decide(tmp_path, "job", [a]))
    cfg = RunConfig()
    cfg.train.micro_batch_size = 4
    resume, train = run.layout(cfg)
    assert resume == "auto" and train.batch(1).accum == 4  # the job's global batch kept
    assert cfg.checkpoint.resume == "none" and cfg.train.global_batch_size is None  # derived: cfg as loaded
    cfg = RunConfig()
    cfg.train.micro_batch_size, cfg.checkpoint.resume = 4, "/ckpt/step_00000003"
    assert run.layout(cfg)[0] == "/ckpt/step_00000003"                  # the user's choice wins
    first = ElasticRun(run_dir=tmp_path, run_id="job", is_main=True, world=1, nodes=[a])
    cfg = RunConfig()
    resume, train = first.layout(cfg)
    assert resume == "none" and train.global_batch_size is None
    cfg = RunConfig()
    cfg.train.micro_batch_size = 3
    with pytest.raises(ConfigError, match="the job's global batch of 16 samples is not divisible by "
                                          "train.micro_batch_size x world size = 3"):
        run.layout(cfg)
