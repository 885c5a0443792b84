"""Launcher detection and the Accelerator, built from the DeepSpeed JSON.

Every launcher (deepspeed, accelerate launch, torchrun, mpirun, plain python) ends here
with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in the environment, and
with an Accelerator whose idea of rank and world size is the real one. On CPU-only
machines Accelerate needs help (see DEVELOPERS.md):
- DeepSpeed: backend="gloo" passed explicitly (Accelerate picks none on CPU, and then
  each rank believes it is rank 0 of 1 while DeepSpeed sees N ranks); `cpu=True` would
  silently switch DeepSpeed off.
- DDP: `cpu=True` (MULTI_CPU); gloo alone leaves the model unwrapped and all-reduces no-ops.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from train.config import Batch
from train.dsconfig import DSSetup, read_ds_json
from train.errors import ConfigError

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launcher() -> str:
    env = os.environ
    if "OMPI_COMM_WORLD_RANK" in env and "RANK" not in env:
        return "openmpi"
    if "ACCELERATE_MIXED_PRECISION" in env:  # exported by every `accelerate launch` mode
        return "accelerate"
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "CROSS_RANK" in env or any(a.startswith("--local_rank") for a in sys.argv):
        return "deepspeed"
    if all(k in env for k in LAUNCHER_ENV):
        return "env"
    return "python"


def normalize_env() -> str:
    """Make the process-group variables present for every launcher; returns the launcher name."""
    env = os.environ
    launcher = detect_launcher()
    if launcher == "openmpi":
        # deepspeed --launcher openmpi starts ranks with OMPI_* only; without RANK & co.
        # DeepSpeed falls back to mpi4py discovery, which is usually not installed.
        env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env["OMPI_COMM_WORLD_LOCAL_RANK"]
        env.setdefault("LOCAL_WORLD_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
    elif launcher == "python":
        # One process, no launcher: still a (world size 1) process group, so the same
        # code paths (DeepSpeed engine, collectives) run as under any launcher.
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(_free_port()))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        raise ConfigError(f"launcher {launcher} did not set {', '.join(missing)}; "
                          f"pass --master_addr/--master_port to the launcher")
    # DeepSpeed JIT-builds a comm op on CPU; every rank (and node) must look in one place.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parent.parent / ".cache" / "torch_extensions"))
    return launcher


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    launcher: str
    device: str          # "cuda" | "cpu"
    backend: str         # "nccl" | "gloo"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def topology(launcher: str, backend: str) -> Topology:
    env = os.environ
    world = int(env["WORLD_SIZE"])
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", 0)) or 0)
    node_rank = int(env.get("GROUP_RANK", env.get("CROSS_RANK", env.get("NODE_RANK", -1))))
    rank = int(env["RANK"])
    if not local_world:
        local_world = world if node_rank <= 0 and "CROSS_SIZE" not in env else world // int(env.get("CROSS_SIZE", 1))
    if node_rank < 0:
        node_rank = rank // max(1, local_world)
    return Topology(rank=rank, world_size=world, local_rank=int(env["LOCAL_RANK"]), local_world_size=local_world,
                    node_rank=node_rank, num_nodes=max(1, world // max(1, local_world)), launcher=launcher,
                    device="cuda" if torch.cuda.is_available() else "cpu",
                    backend="nccl" if torch.cuda.is_available() else "gloo")


def resolve_ds_config_path(cli_or_file: str | None, launcher: str) -> str:
    """Which DeepSpeed JSON: explicit (--ds-config / run file) > accelerate YAML > default."""
    acc_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    acc_uses_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    root = Path(__file__).resolve().parent.parent
    if launcher == "accelerate" and acc_uses_ds and acc_file and acc_file != "none":
        if cli_or_file and Path(cli_or_file).resolve() != Path(acc_file).resolve():
            raise ConfigError(f"the accelerate config names deepspeed_config_file {acc_file} but the run asks for "
                              f"{cli_or_file} (--ds-config / distributed.ds_config); use one of them")
        return acc_file
    if launcher == "accelerate" and not acc_uses_ds:
        if cli_or_file and "ddp" not in read_ds_json(cli_or_file):
            raise ConfigError(f"the accelerate config launches plain DDP (no deepspeed_config) but the run asks for "
                              f"DeepSpeed config {cli_or_file}; use ds_configs/accelerate/zero*.yaml or drop --ds-config")
        return cli_or_file or str(root / "ds_configs" / "ddp.json")
    return cli_or_file or str(root / "ds_configs" / "zero2.json")


def check_accelerate_precision(ds: DSSetup):
    """`accelerate launch` exports the YAML's mixed_precision; it must agree with the JSON."""
    mp = os.environ.get("ACCELERATE_MIXED_PRECISION")
    if mp and mp != "no" and mp != ds.accelerate_mixed_precision:
        raise ConfigError(f"the accelerate config sets mixed_precision: {mp} but {ds.path} selects "
                          f"{ds.precision}; precision comes from the DeepSpeed JSON: remove mixed_precision "
                          f"from the accelerate YAML or make them agree")


def build_accelerator(ds: DSSetup, batch: Batch, timeout_s: int):
    from accelerate import Accelerator
    from accelerate.utils import (DataLoaderConfiguration, DeepSpeedPlugin, DistributedDataParallelKwargs,
                                  GradientAccumulationPlugin, InitProcessGroupKwargs)

    cuda = torch.cuda.is_available()
    pg = InitProcessGroupKwargs(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    common = dict(
        mixed_precision=ds.accelerate_mixed_precision,
        # Our batch sampler yields *global* micro-batches (world x micro samples, the same
        # order for any world size); Accelerate hands each rank its own slice.
        dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=True),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=batch.accum, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,
    )
    if ds.is_deepspeed:
        plugin = DeepSpeedPlugin(hf_ds_config=ds.resolved, zero3_init_flag=ds.stage == 3)
        return Accelerator(deepspeed_plugin=plugin, kwargs_handlers=[pg], **common)
    ddp = DistributedDataParallelKwargs(**ds.ddp_kwargs)
    return Accelerator(cpu=not cuda, kwargs_handlers=[pg, ddp], **common)


def check_world(acc, topo: Topology):
    """Refuse to train if Accelerate's view of the world disagrees with the launcher's."""
    if acc.num_processes != topo.world_size or acc.process_index != topo.rank:
        raise RuntimeError(f"Accelerate sees rank {acc.process_index}/{acc.num_processes} but the launcher set "
                           f"rank {topo.rank}/{topo.world_size}; this would train on duplicated data")
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() != topo.world_size:
        raise RuntimeError("process group size disagrees with WORLD_SIZE")
