"""Launcher detection and the Accelerator, built from the DeepSpeed JSON.

Every launcher (deepspeed, accelerate launch, torchrun, mpirun, plain python) ends here
with RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in the environment, and
with an Accelerator whose idea of rank and world size is the real one. On CPU-only
machines Accelerate needs help (docs/machine_notes.md):
- DeepSpeed: backend="gloo" passed explicitly (Accelerate picks none on CPU, and then
  each rank believes it is rank 0 of 1 while DeepSpeed sees N ranks); `cpu=True` would
  silently switch DeepSpeed off.
- DDP: `cpu=True` (MULTI_CPU); gloo alone leaves the model unwrapped and all-reduces no-ops.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from zerotrain.train import errors, paths, process_group
from zerotrain.train.config import Batch
from zerotrain.train.errors import ConfigError
from zerotrain.train.strategy.ds_config import machine_precision, read_ds_json

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
    (~3 min on CPU). Ranks started with and without the venv on PATH (a remote node's
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


def resolve_ds_config_path(cli_or_file: str | None, launcher: str) -> str:
    """Which DeepSpeed JSON: explicit (--ds-config / run file) > accelerate YAML > default."""
    acc_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    acc_uses_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if launcher == "accelerate" and cli_or_file and cli_or_file.split(":")[0] == "auto":
        raise ConfigError(f"--ds-config {cli_or_file} chooses the strategy at start-up, but an accelerate config "
                          f"fixes it already; launch with deepspeed, torchrun or python instead")
    if launcher == "accelerate" and acc_uses_ds and acc_file and acc_file != "none":
        if cli_or_file and Path(cli_or_file).resolve() != Path(acc_file).resolve():
            raise ConfigError(f"the accelerate config names deepspeed_config_file {acc_file} but the run asks for "
                              f"{cli_or_file} (--ds-config / distributed.ds_config); use one of them")
        return acc_file
    if launcher == "accelerate" and not acc_uses_ds:
        if cli_or_file and "ddp" not in read_ds_json(cli_or_file):
            raise ConfigError(f"the accelerate config launches plain DDP (no deepspeed_config) but the run asks for "
                              f"DeepSpeed config {cli_or_file}; use ds_configs/accelerate/zero*.yaml or drop --ds-config")
        return cli_or_file or str(paths.DS_CONFIGS / "ddp.json")
    return cli_or_file or str(paths.DS_CONFIGS / default_ds_config()[0])


def default_ds_config() -> tuple[str, str]:
    """(file in ds_configs/, why) when the run names none: ZeRO-2 in the fastest precision this
    hardware has (train/strategy/ds_config.py machine_precision, also what "enabled": "auto" means)."""
    precision, why = machine_precision(torch.cuda.is_available())
    name, label = {"bf16": ("zero2.json", "bf16"), "fp16": ("zero2_fp16.json", "fp16 with loss scaling"),
                   "fp32": ("zero2_fp32.json", "fp32")}[precision]
    return name, f"ZeRO-2, {label}: {why}"


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
    _PEERS["timeout_s"] = timeout_s
    with rendezvous_errors(timeout_s):  # the process group (and its TCP store) is created here
        return Accelerator(kwargs_handlers=[pg, *handlers], **common, **backend)


def init_process_group(timeout_s: int):
    """The process group Accelerate would create, made earlier (ranks must agree on something
    before the Accelerator exists, e.g. --ds-config auto). Accelerate and DeepSpeed adopt an
    existing group."""
    if process_group.exists():  # made earlier (an elastic start, train/training/build.py)
        return
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    _PEERS["timeout_s"] = timeout_s
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


# ---------------------------------------------------------------------- failures between nodes
# Who runs where, gathered once at start-up, so that a rank whose peer vanished can say
# which node is missing instead of printing a gloo/NCCL stack trace (or hanging).
_PEERS: dict = {"roster": [], "me": None, "timeout_s": None}
_IP = re.compile(r"\[?((?:\d{1,3}\.){3}\d{1,3})\]?:\d+")
_PEER_LOST = re.compile(r"connection (closed|reset|refused)|broken pipe|timed out|timeout|socket closed|"
                        r"ECONNRESET|EPIPE|peer|recv|NCCL (error|communicator was aborted)|unhandled system error",
                        re.I)


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
    # start: a token of this start of the job (rank 0's), so that store keys of an earlier start
    # under the same elastic agent's store are never read as this one's.
    me = {"rank": topo.rank, "node_rank": topo.node_rank, "host": socket.gethostname(), "addr": node_addr(),
          "start": os.urandom(8).hex()}
    roster: list = [None] * topo.world_size
    torch.distributed.all_gather_object(roster, me)
    _PEERS.update(roster=roster, me=me)
    if topo.is_main and topo.num_nodes > 1:
        print(f"zerotrain: {topo.num_nodes} nodes joined: "
              + "; ".join(describe_node(n, roster) for n in sorted({r["node_rank"] for r in roster})), flush=True)
    if topo.num_nodes > 1 and topo.local_rank == 0 and _PEERS["timeout_s"]:
        PeerWatchdog.start_for(topo, _PEERS["timeout_s"])
    return roster


class PeerWatchdog(threading.Thread):
    """Notices a node that stops answering *without* closing its connections (network
    partition, frozen or powered-off machine): gloo collectives then wait forever - measured
    here: still blocked after 10 min with distributed.timeout_s=20. One per node (local
    rank 0): a poller bumps this node's heartbeat counter in the rendezvous TCP store and
    reads the other nodes'; this thread, which never touches the network (a store call to
    a partitioned host blocks forever too), ends the process with a message naming the node
    when a node has been silent, or the store unreachable, for timeout_s. The node's
    launcher then stops its other ranks."""

    def __init__(self, store, node_rank: int, num_nodes: int, timeout_s: float, on_lost):
        super().__init__(name="zerotrain-peer-watchdog", daemon=True)
        self.store, self.node_rank, self.timeout_s, self.on_lost = store, node_rank, timeout_s, on_lost
        self.interval_s = min(30.0, max(0.2, timeout_s / 6))
        self.stopped = threading.Event()
        self.lock = threading.Lock()
        now = time.monotonic()
        self.store_ok = now                       # last successful round trip to the store
        self.heard = {n: (None, now) for n in range(num_nodes) if n != node_rank}  # node -> (counter, when it moved)

    @classmethod
    def start_for(cls, topo: Topology, timeout_s: float):
        client_timeout = datetime.timedelta(seconds=max(2.0, min(30.0, timeout_s / 6)))
        store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=client_timeout)
        dog = cls(store, topo.node_rank, topo.num_nodes, timeout_s, _abort_peer_lost)
        dog.start()
        return dog

    def _poll(self):
        key = "zerotrain/heartbeat/node{}".format
        while not self.stopped.wait(self.interval_s):
            try:
                self.store.add(key(self.node_rank), 1)
                counts = {n: self.store.add(key(n), 0) for n in self.heard}  # add(0) reads without waiting
            except Exception:  # store host gone or unreachable: the monitor judges how long
                continue
            now = time.monotonic()
            with self.lock:
                self.store_ok = now
                self.heard = {n: (c, now) if c != self.heard[n][0] else self.heard[n] for n, c in counts.items()}

    def run(self):
        threading.Thread(target=self._poll, name="zerotrain-heartbeat", daemon=True).start()
        while not self.stopped.wait(self.interval_s):
            now = time.monotonic()
            with self.lock:
                store_ok, heard = self.store_ok, dict(self.heard)
            if now - store_ok > self.timeout_s:
                return self.on_lost(None, now - store_ok)
            silent = sorted(n for n, (_, t) in heard.items() if now - t > self.timeout_s)
            if silent:
                return self.on_lost(silent, max(now - heard[n][1] for n in silent))


def _abort_peer_lost(nodes: list[int] | None, silent_s: float):
    roster, me = _PEERS["roster"], _PEERS["me"] or {}
    if nodes is None:
        what = (f"cannot reach the rendezvous store on the master {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} for {silent_s:.0f} s")
    else:
        what = f"lost contact with {' and '.join(describe_node(n, roster) for n in nodes)}: silent for {silent_s:.0f} s"
    errors.say(f"[rank {me.get('rank', '?')}] zerotrain: error: {what} (distributed.timeout_s={_PEERS['timeout_s']}). "
               f"That node is down or frozen, or the network between the nodes failed; collectives would wait "
               f"forever, so this node stops. {_what_next()}")
    os._exit(1)  # the main thread is blocked inside a collective: no clean way out


def _user_error_key() -> str:
    return f"zerotrain/user_error/{_PEERS['roster'][0]['start']}"


def _store_client(timeout_s: float = 2.0):
    """A client of the launch's rendezvous store (the one the process group was built on), or None
    before the ranks have met (gather_roster)."""
    if not _PEERS["roster"] or len(_PEERS["roster"]) < 2 or "MASTER_ADDR" not in os.environ:
        return None
    try:
        return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                          timeout=datetime.timedelta(seconds=timeout_s))
    except Exception:  # the store's host is the one that failed: nobody to tell, nothing to read
        return None


def report_user_error(message: str) -> None:
    """Before a rank exits on a user error, say so in the store: the ranks that then lose it in a
    collective exit with the same code and no second message (the first line is the cause)."""
    store = _store_client()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_user_error_key(), f"rank {os.environ.get('RANK', '?')}: {message}")


def peer_user_error() -> str | None:
    """The user error another rank reported before it exited, if any."""
    store = _store_client()
    if store is None:
        return None
    with contextlib.suppress(Exception):
        if store.check([_user_error_key()]):
            return store.get(_user_error_key()).decode()
    return None


def describe_node(node_rank: int, roster: list[dict]) -> str:
    ranks = [r for r in roster if r["node_rank"] == node_rank]
    addrs = sorted({r["addr"] for r in ranks})
    return (f"node {node_rank} ({ranks[0]['host']}, {', '.join(addrs)}; "
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r['rank']) for r in ranks)})")


def explain_peer_failure(exc: BaseException) -> str | None:
    """A one-paragraph explanation if `exc` is a collective failing because a peer is gone."""
    roster, me = _PEERS["roster"], _PEERS["me"]
    if not roster or me is None:
        return None
    texts, e = [], exc
    while e is not None and len(texts) < 8:  # the error may be chained under a later one (close())
        texts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    text = "\n".join(texts)
    dist_error = any(n in text for n in ("DistBackendError", "DistNetworkError", "DistError", "gloo", "Gloo",
                                          "NCCL", "c10d"))
    if not (dist_error and _PEER_LOST.search(text)):
        return None
    others = sorted({r["node_rank"] for r in roster} - {me["node_rank"]})
    named = sorted({r["node_rank"] for r in roster if r["addr"] in set(_IP.findall(text))} - {me["node_rank"]})
    if named:
        who = " and ".join(describe_node(n, roster) for n in named)
        what = f"lost contact with {who}"
    elif others:
        who = " or ".join(describe_node(n, roster) for n in others)
        what = f"a collective failed or timed out; the missing peer is on {who}"
    else:
        who = "another rank on this node"
        what = "a collective failed or timed out; a local rank is gone"
    return (f"{what}. Its process died or its network failed: look in that node's log for the first error. "
            f"This rank (rank {me['rank']}, node {me['node_rank']}) stops instead of waiting "
            f"(distributed.timeout_s={_PEERS['timeout_s']}). {_what_next()}")


def _what_next() -> str:
    from zerotrain.train.launch import elastic
    if elastic.restarts_left():
        return ("torchrun's elastic agent restarts the workers on the nodes that are left; they resume from the "
                "newest checkpoint by themselves.")
    return "Restart with --resume auto to continue from the last checkpoint."


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


# user_errors (train/errors.py) tells the other ranks of a user error, and names a peer that died;
# train/launch/collectives.py puts its report_collective_failure here when imported (debug.collectives).
PEERS_API = SimpleNamespace(report_user_error=report_user_error, peer_user_error=peer_user_error,
                            explain_peer_failure=explain_peer_failure,
                            report_collective_failure=lambda exc: False)
errors.report_peers_with(PEERS_API)
