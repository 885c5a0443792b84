"""Failures between nodes: who runs where (the roster every rank gathers once at start-up,
train/launch/distributed.py gather_roster), so that a rank whose peer vanished can say which node
is missing instead of printing a gloo/NCCL stack trace (or hanging).

- `explain_peer_failure`: a collective that failed because a peer is gone, in one paragraph
  naming the node;
- `PeerWatchdog`: a node that stops answering without closing its connections (one per node);
- `report_user_error` / `peer_user_error`: a rank that exits on a user error says so in the
  rendezvous store, so the ranks that then lose it exit with the same code and no second message.
user_errors (train/errors.py) reaches these through `PEERS_API`, registered at import.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import threading
import time
from types import SimpleNamespace

import torch

from zerotrain.train import errors

# The roster (every rank's {rank, node_rank, host, addr, start}), this rank's entry, and
# distributed.timeout_s: set at start-up (train/launch/distributed.py).
PEERS: dict = {"roster": [], "me": None, "timeout_s": None}
_IP = re.compile(r"\[?((?:\d{1,3}\.){3}\d{1,3})\]?:\d+")
_PEER_LOST = re.compile(r"connection (closed|reset|refused)|broken pipe|timed out|timeout|socket closed|"
                        r"ECONNRESET|EPIPE|peer|recv|NCCL (error|communicator was aborted)|unhandled system error",
                        re.I)


class PeerWatchdog(threading.Thread):
    """Notices a node that stops answering *without* closing its connections (network
    partition, frozen or powered-off machine): gloo collectives then wait forever (measured:
    docs/multinode.md "When a node dies, or the network is wrong"). One per node (local rank
    0): a poller bumps this node's heartbeat counter in the rendezvous TCP store and reads the
    other nodes'; this thread, which never touches the network (a store call to a partitioned
    host blocks forever too), ends the process with a message naming the node when a node has
    been silent, or the store unreachable, for timeout_s. The node's launcher then stops its
    other ranks."""

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
    def start_for(cls, node_rank: int, num_nodes: int, timeout_s: float):
        client_timeout = datetime.timedelta(seconds=max(2.0, min(30.0, timeout_s / 6)))
        store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=client_timeout)
        dog = cls(store, node_rank, num_nodes, timeout_s, _abort_peer_lost)
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
    roster, me = PEERS["roster"], PEERS["me"] or {}
    if nodes is None:
        what = (f"cannot reach the rendezvous store on the master {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} for {silent_s:.0f} s")
    else:
        what = f"lost contact with {' and '.join(describe_node(n, roster) for n in nodes)}: silent for {silent_s:.0f} s"
    errors.say(f"[rank {me.get('rank', '?')}] zerotrain: error: {what} (distributed.timeout_s={PEERS['timeout_s']}). "
               f"That node is down or frozen, or the network between the nodes failed; collectives would wait "
               f"forever, so this node stops. {_what_next()}")
    os._exit(1)  # the main thread is blocked inside a collective: no clean way out


def _user_error_key() -> str:
    return f"zerotrain/user_error/{PEERS['roster'][0]['start']}"


def store_client(timeout_s: float = 2.0):
    """A client of the launch's rendezvous store (the one the process group was built on), or None
    before the ranks have met (gather_roster)."""
    if not PEERS["roster"] or len(PEERS["roster"]) < 2 or "MASTER_ADDR" not in os.environ:
        return None
    try:
        return torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                          timeout=datetime.timedelta(seconds=timeout_s))
    except Exception:  # the store's host is the one that failed: nobody to tell, nothing to read
        return None


def report_user_error(message: str) -> None:
    """Before a rank exits on a user error, say so in the store: the ranks that then lose it in a
    collective exit with the same code and no second message (the first line is the cause)."""
    store = store_client()
    if store is not None:
        with contextlib.suppress(Exception):
            store.set(_user_error_key(), f"rank {os.environ.get('RANK', '?')}: {message}")


def peer_user_error() -> str | None:
    """The user error another rank reported before it exited, if any."""
    store = store_client()
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
    roster, me = PEERS["roster"], PEERS["me"]
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
            f"(distributed.timeout_s={PEERS['timeout_s']}). {_what_next()}")


def _what_next() -> str:
    from zerotrain.train.launch import elastic
    if elastic.restarts_left():
        return ("torchrun's elastic agent restarts the workers on the nodes that are left; they resume from the "
                "newest checkpoint by themselves.")
    return "Restart with --resume auto to continue from the last checkpoint."


# user_errors (train/errors.py) tells the other ranks of a user error, and names a peer that died;
# train/launch/collectives.py puts its report_collective_failure here when imported (debug.collectives).
PEERS_API = SimpleNamespace(report_user_error=report_user_error, peer_user_error=peer_user_error,
                            explain_peer_failure=explain_peer_failure,
                            report_collective_failure=lambda exc: False)
errors.report_peers_with(PEERS_API)
