"""ranks/rank<R>.json: who this rank is and what its engine decided, what launchers and tests
check sharding and topology against. The facts are gathered during the build (`rank_facts` in
choose_strategy; prepare() adds what the engine decided) and written once (`write_rank_file`)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from zerotrain.train import process_group

if TYPE_CHECKING:
    from zerotrain.train.launch.distributed import Topology
    from zerotrain.train.strategy import Strategy


def rank_facts(acc, topo: Topology, strategy: Strategy) -> dict:
    """Who this rank is: what launchers and tests check sharding and topology against
    (ranks/rank<R>.json; prepare() adds what the engine decided and writes it once)."""
    return {**topo.__dict__, "hostname": socket.gethostname(), "pid": os.getpid(),
            "accelerate_process_index": acc.process_index, "accelerate_num_processes": acc.num_processes,
            "distributed_type": str(acc.distributed_type), "strategy": strategy.describe(),
            "process_group_size": process_group.size()}


def write_rank_file(run_dir: Path, topo: Topology, facts: dict) -> None:
    d = run_dir / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"rank{topo.rank}.json").write_text(json.dumps(facts, indent=1) + "\n")
