"""The environment and topology of a run: launcher detection, who runs where, the process group
and the Accelerator (built from the DeepSpeed JSON the run chose: train/launch/ds_config_choice.py).

Every launcher (deepspeed, accelerate launch, torchrun, mpirun, plain python) ends here
with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in the environment, and
with an Accelerator whose idea of rank and world size is the real one. On CPU-only
machines Accelerate needs help (docs/machine_notes.md):
- DeepSpeed: backend="gloo" passed explicitly (Accelerate picks none on CPU, and then
  each rank believes it is rank 0 of 1 while DeepSpeed sees N ranks); `cpu=True` would
  silently switch DeepSpeed off.
- DDP: `cpu=True` (MULTI_CPU); gloo alone leaves the model unwrapped and all-reduces no-ops.

Once the ranks have met, each gathers who runs where (`gather_roster`), so that a failure
between nodes can name the missing one (train/launch/peers.py).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from zerotrain.train import paths, process_group
from zerotrain.train.config import Batch
from zerotrain.train.errors import ConfigError
from zerotrain.train.launch import peers

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
    if "RANK" in env and "WORLD_SIZE" in env:
        # This node's ranks for every reader, as torchrun says it: the deepspeed launcher sets only
        # LOCAL_SIZE, and Accelerate's multi-CPU DDP would otherwise take 1 (and write it back).
        env.setdefault("LOCAL_WORLD_SIZE", str(node_layout(env, int(env["RANK"]), int(env["WORLD_SIZE"]))[2]))
    # DeepSpeed JIT-builds a comm op on CPU; every rank (and node) must look in one place.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(paths.EXTENSIONS_CACHE))
    venv_tools_first(env)
    return launcher


def venv_tools_first(env):
    """Put this interpreter's bin dir first on PATH when it has its own `ninja`.

    JIT ops are built by whichever ninja is first on PATH, and ninja 1.11 (Debian's) and
    1.13 (pip's) write incompatible .ninja_log versions: each rebuilds the other's build
    (the whole op, minutes on CPU). Ranks started with and without the venv on PATH (a remote node's
    login shell, `make`, an activated shell) would keep rebuilding the shared op."""
    bin_dir = str(Path(sys.executable).parent)
    if (Path(bin_dir) / "ninja").exists():
        rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bin_dir]
        env["PATH"] = os.pathsep.join([bin_dir, *rest])


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


def node_layout(env, rank: int, world: int) -> tuple[int, int, int]:
    """(node_rank, num_nodes, ranks per node) as the launcher that started us defines them."""
    if "GROUP_RANK" in env:  # torchrun, also under `accelerate launch` (static or c10d rendezvous)
        local = int(env.get("LOCAL_WORLD_SIZE", world))
        return int(env["GROUP_RANK"]), int(env.get("GROUP_WORLD_SIZE", max(1, world // local))), local
    if "CROSS_RANK" in env:  # deepspeed's launch.py: one per node, via pdsh, --no_ssh or locally
        nodes = int(env.get("CROSS_SIZE", 1))
        return int(env["CROSS_RANK"]), nodes, int(env.get("LOCAL_SIZE", max(1, world // nodes)))
    local = int(env.get("LOCAL_WORLD_SIZE", env.get("OMPI_COMM_WORLD_LOCAL_SIZE", world)) or world)
    if "NODE_RANK" in env:
        return int(env["NODE_RANK"]), max(1, world // local), local
    return rank // max(1, local), max(1, world // max(1, local)), local  # mpirun fills nodes in rank order


def topology(launcher: str, backend: str) -> Topology:
    env = os.environ
    world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
    node_rank, num_nodes, local_world = node_layout(env, rank, world)
    return Topology(rank=rank, world_size=world, local_rank=int(env["LOCAL_RANK"]), local_world_size=local_world,
                    node_rank=node_rank, num_nodes=num_nodes, launcher=launcher,
                    device="cuda" if torch.cuda.is_available() else "cpu",
                    backend="nccl" if torch.cuda.is_available() else "gloo")


def build_accelerator(mixed_precision: str, batch: Batch, timeout_s: int, handlers: tuple = (), **backend):
    """The Accelerator for one backend: `handlers` and `backend` (a DeepSpeedPlugin, or cpu=)
    come from the strategy (train/strategy/); the rest is the same for every backend."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration, GradientAccumulationPlugin, InitProcessGroupKwargs

    cuda = torch.cuda.is_available()
    pg = InitProcessGroupKwargs(backend="nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    common = dict(
        mixed_precision=mixed_precision,  # Accelerate's name of the JSON's precision (DSSetup)
        # Our batch sampler yields *global* micro-batches (world x micro samples, the same
        # order for any world size); Accelerate hands each rank its own slice.
        # non_blocking: batches are copied from pinned memory (build.py) while the GPU works.
        dataloader_config=DataLoaderConfiguration(split_batches=True, even_batches=True, non_blocking=cuda),
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=batch.accum, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,
    )
    peers.PEERS["timeout_s"] = timeout_s
    with rendezvous_errors(timeout_s):  # the process group (and its TCP store) is created here
        return Accelerator(kwargs_handlers=[pg, *handlers], **common, **backend)


def init_process_group(timeout_s: int):
    """The process group Accelerate would create, made earlier (ranks must agree on something
    before the Accelerator exists, e.g. --ds-config auto). Accelerate and DeepSpeed adopt an
    existing group."""
    if process_group.exists():  # made earlier (an elastic start, train/training/assembly.py)
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    peers.PEERS["timeout_s"] = timeout_s
    with rendezvous_errors(timeout_s):
        torch.distributed.init_process_group("nccl" if cuda else "gloo",
                                             timeout=datetime.timedelta(seconds=timeout_s))


def check_world(acc, topo: Topology):
    """Refuse to train if Accelerate's view of the world disagrees with the launcher's."""
    if acc.num_processes != topo.world_size or acc.process_index != topo.rank:
        raise RuntimeError(f"Accelerate sees rank {acc.process_index}/{acc.num_processes} but the launcher set "
                           f"rank {topo.rank}/{topo.world_size}; this would train on duplicated data")
    if process_group.exists() and process_group.size() != topo.world_size:
        raise RuntimeError("process group size disagrees with WORLD_SIZE")
    if process_group.exists():
        gather_roster(topo)


def node_addr() -> str:
    """This node's address as its peers see it: the interface gloo/NCCL were told to use,
    else the source address of the route to the master (no packet is sent)."""
    import fcntl
    import struct
    iface = (os.environ.get("GLOO_SOCKET_IFNAME") or os.environ.get("NCCL_SOCKET_IFNAME") or "").split(",")[0]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        if iface and not iface.startswith(("^", "=")):
            try:
                req = struct.pack("256s", iface[:15].encode())
                return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
            except OSError:
                pass
        try:
            s.connect((os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
            return s.getsockname()[0]
        except (OSError, KeyError, ValueError):
            return "?"


def gather_roster(topo: Topology) -> list[dict]:
    """Who runs where, gathered once at start-up (a collective) for the diagnosis of a peer that
    vanishes (train/launch/peers.py); a multi-node run also starts this node's PeerWatchdog."""
    # start: a token of this start of the job (rank 0's), so that store keys of an earlier start
    # under the same elastic agent's store are never read as this one's.
    me = {"rank": topo.rank, "node_rank": topo.node_rank, "host": socket.gethostname(), "addr": node_addr(),
          "start": os.urandom(8).hex()}
    roster: list = [None] * topo.world_size
    torch.distributed.all_gather_object(roster, me)
    peers.PEERS.update(roster=roster, me=me)
    if topo.is_main and topo.num_nodes > 1:
        print(f"zerotrain: {topo.num_nodes} nodes joined: "
              + "; ".join(peers.describe_node(n, roster) for n in sorted({r["node_rank"] for r in roster})), flush=True)
    if topo.num_nodes > 1 and topo.local_rank == 0 and peers.PEERS["timeout_s"]:
        peers.PeerWatchdog.start_for(topo.node_rank, topo.num_nodes, peers.PEERS["timeout_s"])
    return roster


@contextlib.contextmanager
def rendezvous_errors(timeout_s: int):
    """Port already taken on the master, master unreachable, ranks missing at start-up:
    one message naming the address and what to check, instead of a c10d stack trace."""
    try:
        yield
    except Exception as e:  # torch raises DistNetworkError / DistStoreError / RuntimeError here
        addr, port = os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?")
        rank, world = os.environ.get("RANK", "?"), os.environ.get("WORLD_SIZE", "?")
        text = str(e)
        if "EADDRINUSE" in text or "address already in use" in text.lower():
            raise ConfigError(f"the master port {port} is already in use on {addr} (another job, or ranks left over "
                              f"from an earlier run: `ss -ltnp 'sport = :{port}'`); pass a free port to the launcher "
                              f"(deepspeed/torchrun --master_port, accelerate --main_process_port)") from None
        if "trying to connect to" in text or "failed to connect" in text.lower():
            raise ConfigError(f"rank {rank} could not reach the master {addr}:{port} within distributed.timeout_s="
                              f"{timeout_s} s. Check that node 0 was started with the same port, that {addr} is node "
                              f"0's address as seen from this node, and that the port is open (`nc -zv {addr} "
                              f"{port}` from here); if node 0 starts later, raise --distributed.timeout_s") from None
        m = re.search(r"waiting for clients\. (\d+)/(\d+) clients joined", text)
        if m:
            raise ConfigError(f"only {m.group(1)} of {m.group(2)} ranks reached the master {addr}:{port} within "
                              f"distributed.timeout_s={timeout_s} s: the other nodes did not start, or cannot reach "
                              f"{addr}:{port} (wrong master address, firewall, or GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME "
                              f"naming the wrong interface); world size {world}") from None
        raise
