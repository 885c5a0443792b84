"""Elastic restarts under torchrun's elastic agent (`--nnodes MIN:MAX --max-restarts N`, c10d
rendezvous): the workers the agent restarts on the nodes that are left (or on more nodes, when one
comes back) continue the same run from its newest complete checkpoint, with the same global
batch, and say what changed. docs/multinode.md ("Fault-tolerant multi-node") is the user's side.

How a worker knows it is a *restart* of the same job, not a new job in an old run directory:
rank 0 keeps `<run_dir>/elastic.json` (the rendezvous run id, TORCHELASTIC_RUN_ID; the launcher
processes, i.e. torchrun agents, that ran the job so far; the nodes of the last attempt; the
global batch; restarts and steps recomputed). A start is a restart when the run id matches and at
least one of the current agents (identified by boot id, pid and process start time, so a reused
pid does not count) already ran this job: an agent restarts its workers after a failure and after
a membership change (a scale-up restart does not increment TORCHELASTIC_RESTART_COUNT, so that
counter alone cannot tell), while a relaunched job has only new agents. A restart resumes with
`checkpoint.resume auto` unless the run asked for a checkpoint itself (an explicit --resume
wins); a first start never resumes by itself.

Steps lost: rank 0 writes the last completed step to `<run_dir>/elastic.step` after every step (a
few bytes, overwritten in place); a restart compares it with the step it resumed from.
"""

from __future__ import annotations

import dataclasses

import json
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

RECORD = "elastic.json"
PROGRESS = "elastic.step"


def active(env=None) -> bool:
    """Started by torchrun's agent (also `accelerate launch` with the standard multi-node launcher)."""
    return "TORCHELASTIC_RUN_ID" in (os.environ if env is None else env)


def restarts_left(env=None) -> bool:
    env = os.environ if env is None else env
    try:
        return active(env) and int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) > int(
            env.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return False


def _agent() -> dict:
    """The launcher process this rank runs under (torchrun's agent starts every worker itself):
    the same process through all the restarts it makes, a new one for a new job."""
    ppid = os.getppid()
    try:
        stat = Path(f"/proc/{ppid}/stat").read_text()
        start = stat.rsplit(")", 1)[1].split()[19]  # field 22, starttime (clock ticks after boot)
    except (OSError, IndexError):
        start = "?"
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    return {"agent_pid": ppid, "agent": f"{boot}:{ppid}:{start}"}


def describe(m: dict) -> str:
    ranks = m["ranks"]
    return (f"node {m['node_rank']} ({m['host']}, {m['addr']}; rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))}; launcher pid {m['agent_pid']})")


def _nodes(ranks: list[dict]) -> list[dict]:
    """One entry per agent (node), from every rank's self-description."""
    nodes: dict[str, dict] = {}
    for r in sorted(ranks, key=lambda r: r["rank"]):
        n = nodes.setdefault(r["agent"], {k: r[k] for k in ("node_rank", "host", "addr", "agent", "agent_pid")}
                             | {"ranks": []})
        n["ranks"].append(r["rank"])
    return sorted(nodes.values(), key=lambda n: n["node_rank"])


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_json(path: Path, data: dict):
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


@dataclass
class ElasticRun:
    """This attempt of an elastic job, the same on every rank (rank 0 decided, then broadcast)."""

    run_dir: Path
    run_id: str
    is_main: bool
    world: int
    nodes: list[dict]                      # this attempt's nodes (describe())
    restart: bool = False                  # a restart of the same job: resume from its newest checkpoint
    number: int = 0                        # restarts of the job so far, this one included
    left: list[dict] = field(default_factory=list)
    joined: list[dict] = field(default_factory=list)
    previous_world: int = 0
    previous_step: Optional[int] = None    # the last step the previous attempt completed
    global_batch: Optional[int] = None     # pinned at the job's first start
    wandb_run_id: Optional[str] = None
    record: dict = field(default_factory=dict)  # rank 0: elastic.json as this attempt writes it
    event: Optional[dict] = None           # rank 0: the membership-change row, logged by the trainer
    line: Optional[str] = None             # rank 0: the line printed for it
    _progress_fd: Optional[int] = None

    # ------------------------------------------------------------------ decide (collective)
    @classmethod
    def join(cls, run_dir: Path, rank: int, world: int, node_rank: int, addr: str) -> "ElasticRun":
        """Every rank: says who it is; rank 0 reads elastic.json, decides whether this is a
        restart of the same job, and tells everyone. Needs the default process group."""
        import torch.distributed as dist
        me = {"rank": rank, "node_rank": node_rank, "host": socket.gethostname(), "addr": addr, **_agent()}
        ranks: list = [None] * world
        dist.all_gather_object(ranks, me)
        nodes = _nodes(ranks)
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        decision = [None]
        if rank == 0:
            decision[0] = cls._decide(Path(run_dir), run_id, nodes)
        dist.broadcast_object_list(decision, src=0)
        return cls(run_dir=Path(run_dir), run_id=run_id, is_main=rank == 0, world=world, nodes=nodes, **decision[0])

    @staticmethod
    def _decide(run_dir: Path, run_id: str, nodes: list[dict]) -> dict:
        rec = _read_json(run_dir / RECORD)
        agents = {n["agent"] for n in nodes}
        if not rec or rec.get("run_id") != run_id or not agents & set(rec.get("agents", [])):
            return {}
        before = rec.get("nodes", [])
        known = {n["agent"] for n in before}
        try:
            previous_step = int((run_dir / PROGRESS).read_text().strip() or 0)
        except (OSError, ValueError):
            previous_step = None
        return {"restart": True, "number": int(rec.get("restarts", 0)) + 1,
                "left": [n for n in before if n["agent"] not in agents],
                "joined": [n for n in nodes if n["agent"] not in known],
                "previous_world": int(rec.get("world_size", 0)), "previous_step": previous_step,
                "global_batch": rec.get("global_batch"), "wandb_run_id": rec.get("wandb_run_id"),
                "record": rec}

    def layout(self, cfg) -> tuple[str, object]:
        """What this start changes of the run, derived (the loaded config stays as it was):
        (checkpoint.resume, the train section the batch is computed from). A restart resumes
        (unless the run names a checkpoint itself) and keeps the job's global batch: the
        accumulation per rank follows the new world size."""
        resume, train = cfg.checkpoint.resume, cfg.train
        if not self.restart:
            return resume, train
        if resume == "none":
            resume = "auto"
        if self.global_batch and train.batch(self.world).global_size != self.global_batch:
            from zerotrain.train.errors import ConfigError
            per_step = train.micro_batch_size * self.world
            if self.global_batch % per_step:
                raise ConfigError(
                    f"elastic restart on {self.world} process(es): the job's global batch of {self.global_batch} "
                    f"samples is not divisible by train.micro_batch_size x world size = {per_step}; set "
                    f"train.global_batch_size to a multiple of micro_batch_size x every world size MIN..MAX "
                    f"nodes can give")
            train = dataclasses.replace(train, global_batch_size=self.global_batch, grad_accum_steps=None)
        return resume, train

    # ------------------------------------------------------------------ after the resume
    def run_id_for(self, saved: Optional[str]) -> Optional[str]:
        """The W&B run id this attempt continues: the checkpoint's, else (a restart that had no
        checkpoint yet) the one the job's record kept."""
        return self.wandb_run_id if self.restart and saved is None else saved

    def started(self, state, batch, resumed_from: Optional[Path]) -> None:
        """Rank 0, once the checkpoint (if any) is loaded and `state` carries run_id_for's id:
        records this attempt and composes the line."""
        if not self.is_main:
            return
        rec = dict(self.record) if self.restart else {}
        lost = max(0, self.previous_step - state.step) if (self.restart and self.previous_step is not None) else 0
        agents = sorted(set(rec.get("agents", [])) | {n["agent"] for n in self.nodes})
        self.record = {"run_id": self.run_id, "agents": agents, "nodes": self.nodes, "world_size": self.world,
                       "global_batch": batch.global_size, "restarts": self.number,
                       "steps_recomputed": int(rec.get("steps_recomputed", 0)) + lost,
                       "wandb_run_id": state.wandb_run_id, "events": rec.get("events", [])}
        if self.restart:
            change = [f"{describe(n)} left" for n in self.left] + [f"{describe(n)} joined" for n in self.joined]
            where = (f"resumed from {resumed_from} (step {state.step})" if resumed_from is not None
                     else "no checkpoint yet: started from step 0")
            self.line = (f"zerotrain: elastic restart {self.number}: {'; '.join(change) or 'same nodes'}; world size "
                         f"{self.previous_world} -> {self.world} (global batch {batch.global_size} = micro "
                         f"{batch.micro} x accum {batch.accum} x {batch.world}); {where}; {lost} step"
                         f"{'' if lost == 1 else 's'} lost"
                         + (f" (the previous attempt had completed step {self.previous_step})"
                            if self.previous_step is not None else ""))
            self.event = {"event": "membership", "elastic/restart": self.number,
                          "elastic/left": " and ".join(describe(n) for n in self.left),
                          "elastic/joined": " and ".join(describe(n) for n in self.joined),
                          "elastic/world_size": self.world, "elastic/previous_world_size": self.previous_world,
                          "elastic/resumed_from": str(resumed_from) if resumed_from is not None else None,
                          "elastic/resumed_step": state.step, "elastic/steps_lost": lost}
            self.record["events"] = [*self.record["events"], {**self.event, "step": state.step}]
        _write_json(self.run_dir / RECORD, self.record)
        self.progress(state.step)

    def note_wandb(self, run_id: Optional[str]) -> None:
        """Rank 0, once W&B started: restarts before the first checkpoint continue this W&B run."""
        if self.is_main and run_id and self.record.get("wandb_run_id") != run_id:
            self.record["wandb_run_id"] = run_id
            _write_json(self.run_dir / RECORD, self.record)

    @property
    def restarts(self) -> int:
        return int(self.record.get("restarts", self.number))

    @property
    def steps_recomputed(self) -> int:
        return int(self.record.get("steps_recomputed", 0))

    def progress(self, step: int) -> None:
        """Rank 0, after every step: the last completed step, overwritten in place (fixed width)."""
        if not self.is_main:
            return
        if self._progress_fd is None:
            self._progress_fd = os.open(self.run_dir / PROGRESS, os.O_WRONLY | os.O_CREAT, 0o644)
        os.pwrite(self._progress_fd, f"{step:>20d}\n".encode(), 0)

    def close(self) -> None:
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None
