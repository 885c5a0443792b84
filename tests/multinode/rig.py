"""Two "nodes" on one machine, for real multi-node launches in tests.

Each node is a network namespace (its own interfaces, routing table and port space)
joined to the other by a veth pair, with its own hostname (a UTS namespace per command)
and a private sshd:

    node0  netns zt<pid>n0  iface ztnet 10.77.0.1/24  sshd :22   <- launchers start here
    node1  netns zt<pid>n1  iface ztnet 10.77.0.2/24  sshd :22

Why namespaces rather than 127.0.0.1/127.0.0.2 on the host's loopback:
- the ranks' traffic really crosses an interface, and each node's hostname resolves to
  127.0.1.1 on itself (Debian's default /etc/hosts), so gloo binds loopback unless
  GLOO_SOCKET_IFNAME reaches the remote side: the env forwarding is tested, not assumed;
  a peer's address identifies its node in error messages;
- sshd listens on port 22 and the training ports are private to the rig: nothing
  collides with other jobs on a shared machine and nothing listens on the host;
- node names live in /etc/netns/<ns>/hosts (bind-mounted by `ip netns exec`), so the
  host's /etc/hosts is never edited.

Touched outside the rig's temp dir, all removed by `down()`: the two namespaces (the veth
goes with them), /etc/netns/<ns>/, one marked block at the top of ~/.ssh/config, and
/run/sshd if it had to be created. Killing every process in a namespace is how orphans
(ranks a launcher left behind) are found and reaped. Needs root; packages come from apt.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = {"sshd": "openssh-server", "ssh": "openssh-client", "pdsh": "pdsh", "ip": "iproute2"}
IFACE = "ztnet"
SUBNET = "10.77.0"          # private to the two namespaces: no route from the host
SSH_CONFIG = Path.home() / ".ssh" / "config"
NS_RE = re.compile(r"^zt(\d+)n[01]$")


class RigUnavailable(Exception):
    """The rig cannot be built on this machine for a reason the test suite should skip on."""


@dataclass(frozen=True)
class Node:
    index: int
    name: str      # node0 / node1, resolvable inside the rig
    ns: str        # network namespace
    addr: str      # address on IFACE


def _run(cmd: list[str], timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise RuntimeError(f"multinode rig: `{' '.join(cmd)}` failed ({proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc


def ensure_packages(timeout_s: float = 300) -> None:
    """apt-get install what is missing; RigUnavailable only when apt cannot reach a mirror."""
    missing = sorted({pkg for tool, pkg in PACKAGES.items() if not _which(tool)})
    if not missing:
        return
    if not shutil.which("apt-get"):
        raise RigUnavailable(f"missing {', '.join(missing)} and no apt-get to install them")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=120", *missing]
    deadline = time.monotonic() + timeout_s
    proc = _run(install, timeout=timeout_s, check=False, env=env)
    if proc.returncode != 0:
        # A fresh machine may have no package lists yet.
        upd = _run(["apt-get", "update", "-o", "DPkg::Lock::Timeout=120"], check=False, env=env,
                   timeout=max(30, deadline - time.monotonic()))
        unreachable = re.search(r"Failed to fetch|Could not resolve|Temporary failure", upd.stdout + upd.stderr)
        if upd.returncode != 0 or unreachable:
            raise RigUnavailable(f"apt cannot reach its mirrors to install {', '.join(missing)}: "
                                 f"{(upd.stderr or upd.stdout).strip()[-300:]}")
        _run(install, timeout=max(30, deadline - time.monotonic()), env=env)
    still = [t for t in PACKAGES if not _which(t)]
    if still:
        raise RuntimeError(f"multinode rig: installed {missing} but {still} still not found")


def _which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/bin")


def _pid_alive(pid: int) -> bool:
    """True while `pid` runs. A zombie is dead: it answers signal 0 until its parent reaps it, and
    an orphan's new parent (this container's PID 1) may never do so."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:   # the state follows the ")" that closes the command name
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _ns_pids(ns: str) -> list[int]:
    out = _run(["ip", "netns", "pids", ns], check=False).stdout
    return [int(p) for p in out.split()]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _kill_all(pids: list[int], grace_s: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.1)
        pids = [p for p in pids if _pid_alive(p)]
        if not pids:
            return


def _remove_ssh_block(owner: int | None) -> None:
    """Drop our marked block(s) from ~/.ssh/config (owner None: blocks of dead rigs)."""
    if not SSH_CONFIG.exists():
        return
    text = SSH_CONFIG.read_text()
    pattern = re.compile(r"# >>> zerotrain multinode rig (\d+) >>>\n.*?# <<< zerotrain multinode rig \1 <<<\n",
                         re.S)

    def keep(m):
        pid = int(m.group(1))
        return "" if (pid == owner if owner is not None else not _pid_alive(pid)) else m.group(0)

    new = pattern.sub(keep, text)
    if new != text:
        if new.strip():
            SSH_CONFIG.write_text(new)
        else:
            SSH_CONFIG.unlink()


def cleanup_stale() -> None:
    """Namespaces and ssh-config blocks left by a rig whose pytest was killed."""
    for line in _run(["ip", "netns", "list"], check=False).stdout.splitlines():
        ns = line.split()[0] if line.split() else ""
        m = NS_RE.match(ns)
        if m and not _pid_alive(int(m.group(1))):
            _kill_all(_ns_pids(ns))
            _run(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
    _remove_ssh_block(None)


class Rig:
    def __init__(self):
        self.owner = os.getpid()
        self.dir = Path(tempfile.mkdtemp(prefix="zt-multinode-"))
        self.nodes = [Node(i, f"node{i}", f"zt{self.owner}n{i}", f"{SUBNET}.{i + 1}") for i in range(2)]
        self.sshd_pids: dict[str, int] = {}
        self._made_run_sshd = False
        self._up = False
        self._ports = iter(range(29600, 30000))  # 29500, the launchers' default, stays free

    def port(self) -> int:
        """A port no earlier test of this rig used: the namespaces are fresh, so it is free, and
        it tells this launch's processes apart from leftovers (`find(f"--master_port={p}")`)."""
        return next(self._ports)

    # ------------------------------------------------------------------ bring-up
    def up(self) -> "Rig":
        if os.geteuid() != 0:
            raise RigUnavailable("needs root (network namespaces, sshd, apt-get)")
        ensure_packages()
        cleanup_stale()
        self._up = True
        try:
            self._keys()
            self._network()
            for node in self.nodes:
                self._start_sshd(node)
            self._ssh_config()
            self._check_ssh()
        except BaseException:
            self.down()
            raise
        return self

    def _keys(self):
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "zerotrain-rig", "-f", str(self.dir / "id_ed25519")])
        _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "host_ed25519")])
        shutil.copy(self.dir / "id_ed25519.pub", self.dir / "authorized_keys")
        (self.dir / "authorized_keys").chmod(0o600)

    def _network(self):
        n0, n1 = self.nodes
        for node in self.nodes:
            _run(["ip", "netns", "add", node.ns])
        a, b = f"zt{self.owner}a"[:15], f"zt{self.owner}b"[:15]
        _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        for node, dev in ((n0, a), (n1, b)):
            _run(["ip", "link", "set", dev, "netns", node.ns])
            ns = ["ip", "netns", "exec", node.ns]
            _run([*ns, "ip", "link", "set", dev, "name", IFACE])
            _run([*ns, "ip", "addr", "add", f"{node.addr}/24", "dev", IFACE])
            _run([*ns, "ip", "link", "set", IFACE, "up"])
            _run([*ns, "ip", "link", "set", "lo", "up"])
            # Names resolve only inside the rig: `ip netns exec` bind-mounts this over /etc/hosts.
            etc = Path("/etc/netns") / node.ns
            etc.mkdir(parents=True, exist_ok=True)
            hosts = "127.0.0.1 localhost\n" + f"127.0.1.1 {node.name}\n" + "".join(
                f"{n.addr} {n.name}\n" for n in self.nodes if n is not node)
            (etc / "hosts").write_text(hosts)

    def _start_sshd(self, node: Node):
        if not Path("/run/sshd").is_dir():   # sshd's privilege-separation directory
            Path("/run/sshd").mkdir(mode=0o755, parents=True)
            self._made_run_sshd = True
        pidfile = self.dir / f"sshd-{node.name}.pid"
        cfg = self.dir / f"sshd-{node.name}.conf"
        cfg.write_text("\n".join([
            # Every address of the namespace (its own loopback included: `deepspeed --hostfile`
            # ssh-checks even localhost); nothing outside the rig can reach them.
            "Port 22", "ListenAddress 0.0.0.0", f"HostKey {self.dir / 'host_ed25519'}",
            f"PidFile {pidfile}", f"AuthorizedKeysFile {self.dir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "UsePAM no", "StrictModes no",   # the key files live under /tmp
            "MaxStartups 100:30:200", "PrintMotd no", "AcceptEnv none", "Subsystem sftp internal-sftp", ""]))
        sshd = _which("sshd")
        _run([sshd, "-t", "-f", str(cfg)])
        _run(self.cmd(node, [sshd, "-f", str(cfg), "-E", str(self.dir / f"sshd-{node.name}.log")]))
        deadline = time.monotonic() + 10
        while not pidfile.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not pidfile.exists():
            raise RuntimeError(f"multinode rig: sshd for {node.name} did not start: "
                               f"{(self.dir / f'sshd-{node.name}.log').read_text()[-1000:]}")
        self.sshd_pids[node.name] = int(pidfile.read_text().split()[0])

    def _ssh_config(self):
        hosts = " ".join([n.name for n in self.nodes] + [n.addr for n in self.nodes] + ["localhost"])
        block = (f"# >>> zerotrain multinode rig {self.owner} >>>\n"
                 f"# Added by tests/multinode/rig.py; removed when the test session ends.\n"
                 f"Host {hosts}\n"
                 f"    User root\n    IdentityFile {self.dir / 'id_ed25519'}\n    IdentitiesOnly yes\n"
                 f"    StrictHostKeyChecking no\n    UserKnownHostsFile /dev/null\n    BatchMode yes\n"
                 f"    LogLevel ERROR\n    ConnectTimeout 10\n"
                 # pdsh waits for every ssh session: without keep-alives a vanished node holds it for ~15 min.
                 f"    ServerAliveInterval 5\n    ServerAliveCountMax 3\n"
                 f"# <<< zerotrain multinode rig {self.owner} <<<\n")
        SSH_CONFIG.parent.mkdir(mode=0o700, exist_ok=True)
        old = SSH_CONFIG.read_text() if SSH_CONFIG.exists() else ""
        SSH_CONFIG.write_text(block + old)   # first match wins in ssh_config: go first
        SSH_CONFIG.chmod(0o600)

    def _check_ssh(self):
        for node in self.nodes:
            proc = self.run(self.nodes[0], ["ssh", node.name, "hostname"], timeout=20, check=False)
            if proc.returncode != 0:
                log = (self.dir / f"sshd-{node.name}.log").read_text()[-1500:]
                raise RuntimeError(f"multinode rig: ssh node0 -> {node.name} failed: {proc.stderr.strip()}\n"
                                   f"sshd log:\n{log}")

    # ------------------------------------------------------------------ use
    def cmd(self, node: Node, argv: list[str]) -> list[str]:
        """`argv` on `node`: in its network namespace, under its own hostname."""
        return ["ip", "netns", "exec", node.ns, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                node.name, *argv]

    def run(self, node: Node, argv: list[str], timeout: float = 60, check: bool = True, **kw):
        return _run(self.cmd(node, argv), timeout=timeout, check=check, **kw)

    def popen(self, node: Node, argv: list[str], *, log: Path, env: dict, cwd: Path) -> subprocess.Popen:
        """Start `argv` on `node`, stdout+stderr to `log`, in its own session (killable as a group)."""
        fh = open(log, "w")
        try:
            return subprocess.Popen(self.cmd(node, argv), stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                    start_new_session=True)
        finally:
            fh.close()

    def processes(self, node: Node) -> list[tuple[int, str]]:
        """Processes running on `node` other than its sshd daemon (e.g. ranks, launchers)."""
        daemon = self.sshd_pids.get(node.name)
        return [(p, _cmdline(p)) for p in _ns_pids(node.ns) if p != daemon and _pid_alive(p)]

    def find(self, marker: str) -> list[tuple[int, str]]:
        """Processes on any node whose command line contains `marker` (e.g. `--master_port=P`)."""
        return [(p, c) for node in self.nodes for p, c in self.processes(node) if marker in c]

    def reap(self) -> list[tuple[int, str]]:
        """Kill everything a test left on the nodes (orphan ranks, stuck launchers); returns it."""
        left = [pc for node in self.nodes for pc in self.processes(node)]
        _kill_all([p for p, _ in left])
        return left

    # ------------------------------------------------------------------ teardown
    def down(self) -> None:
        if not self._up:
            return
        self._up = False
        for node in self.nodes:
            pid = self.sshd_pids.get(node.name)
            if pid:
                _kill_all([pid])
            _kill_all(_ns_pids(node.ns))
            _run(["ip", "netns", "del", node.ns], check=False)
            shutil.rmtree(Path("/etc/netns") / node.ns, ignore_errors=True)
        try:
            Path("/etc/netns").rmdir()   # only if now empty
        except OSError:
            pass
        _remove_ssh_block(self.owner)
        if self._made_run_sshd:
            shutil.rmtree("/run/sshd", ignore_errors=True)
        shutil.rmtree(self.dir, ignore_errors=True)


__all__ = ["Rig", "Node", "RigUnavailable", "IFACE"]
