"""What `deepspeed --hostfile FILE` needs before it starts, checked the way it will be used.

`zerotrain check --hostfile FILE` (train/commands/check.py) calls this: it reads the hostfile with
DeepSpeed's own rules (deepspeed/launcher/runner.py `_parse_hostfile`) but names the file and
line of a bad entry, then ssh-probes every host in parallel, non-interactively and with
timeouts, and checks that pdsh is installed when there is more than one host.

What the DeepSpeed launcher (0.19) does with a hostfile, and so what is checked here:
- any hostfile, even `localhost slots=2`: `ssh -o PasswordAuthentication=no <first host> hostname`
  first (`--ssh_port N` adds `-p N`); if that fails it stops with
  "host=<first host> was not reachable via ssh";
- more than one host: the ranks are started through `pdsh -w host0,host1,...` over ssh
  (`--ssh_port` reaches pdsh as `PDSH_SSH_ARGS_APPEND=-p N`), on every host as
  `cd <launch dir>; <this python> -u -m deepspeed.launcher.launch ...`;
- a single host: after the ssh check the ranks are started locally, without pdsh.
`--no_ssh` (with `--node_rank` and `--master_addr`, one launcher per node) needs none of this.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from zerotrain.train.errors import ConfigError

# DeepSpeed's pattern (runner._parse_hostfile uses re.search(r'^(\S+)\s+slots=(\d+)', line));
# the tail it silently ignores is captured here so that it can be reported.
DS_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)(?P<rest>.*)$")
CONNECT_TIMEOUT_S = 5
PROBE_TIMEOUT_S = 3 * CONNECT_TIMEOUT_S   # connect + key exchange + auth + the remote command


@dataclass
class Host:
    name: str
    slots: int
    line: int = 0


def parse_hostfile(path: str | Path) -> list[Host]:
    """DeepSpeed hostfile: `<host> slots=<n>` per line; blank lines and lines starting with `#`
    are skipped. Accepts what DeepSpeed accepts except what would go wrong later (0 slots, a
    host name ssh would read as an option, text after `slots=N` that DeepSpeed would silently
    drop); rejects everything DeepSpeed rejects, naming `file:line`."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"hostfile {path} not found (given a missing hostfile, deepspeed quietly runs on "
                          f"this machine only)")
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(path.read_text(errors="replace").splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{n}"
        m = DS_LINE.match(line)
        if not m:
            hint = ""
            if re.match(r"^\S+\s+slots\s*=\s*-?\d+", line):
                hint = " (DeepSpeed accepts no spaces around '=' and only a number >= 1: \"slots=8\")"
            raise ConfigError(f'{where}: cannot parse "{line}"{hint}; each line must be '
                              f'"<hostname> slots=<processes>", e.g. "node0 slots=8"')
        host, slots, rest = m["host"], int(m["slots"]), m["rest"].strip()
        if rest and not rest.startswith("#"):
            raise ConfigError(f'{where}: "{rest}" after slots={m["slots"]}: DeepSpeed would silently ignore it; '
                              f"one host per line, comments after '#'")
        if host.startswith("-"):
            raise ConfigError(f"{where}: host {host} starts with '-': ssh and pdsh would read it as an option")
        if slots <= 0:
            raise ConfigError(f"{where}: host {host} has slots={slots}; every host needs at least 1 slot "
                              f"(remove the line to leave the host out)")
        if host in seen:
            raise ConfigError(f"{where}: host {host} is listed twice (first on line {seen[host]})")
        seen[host] = n
        hosts.append(Host(host, slots, n))
    if not hosts:
        raise ConfigError(f"{path}: no hosts (expected lines like \"localhost slots=2\")")
    return hosts


# ------------------------------------------------------------------------------------ probing
@dataclass
class Probe:
    host: Host
    ok: bool
    what: str         # "ok" or the failure in a few words
    detail: str = ""  # ssh's own message
    fix: str = ""


def ssh_command(host: str, port: int | None, remote: str) -> list[str]:
    """The probe: like DeepSpeed's ssh check, but never prompting (BatchMode), bounded
    (ConnectTimeout), accepting a host key seen for the first time (as the launcher's own
    first connection would ask to) and with ssh's error messages kept (LogLevel)."""
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}", "-o", "ConnectionAttempts=1",
            "-o", "StrictHostKeyChecking=accept-new", "-o", "LogLevel=ERROR", "-T", "-x",
            *(["-p", str(port)] if port else []), "--", host, remote]


def is_this_machine(name: str) -> bool:
    bare = name.rsplit("@", 1)[-1]
    return bare in ("localhost", "::1", socket.gethostname()) or bare.startswith("127.")


def _classify(host: Host, port: int | None, code: int, err: str, launch_dir: str, python: str) -> Probe:
    lines = [ln.strip() for ln in err.splitlines() if ln.strip() and not ln.startswith("Warning: Permanently added")]
    detail = lines[-1] if lines else f"ssh exited {code}"
    name, p = host.name, port or 22
    low = err.lower()
    if code == 0:
        return Probe(host, True, "ok")
    if code == 3:
        return Probe(host, False, f"reachable, but {launch_dir} is missing there", "",
                     f"the launcher runs `cd {launch_dir}` on every host: put this checkout at the same path on "
                     f"every host (and run zerotrain check from the directory you launch from)")
    if code == 4:
        return Probe(host, False, f"reachable, but {python} is missing there", "",
                     f"the launcher starts every host's ranks with {python}: create the same .venv at the "
                     f"same path on every host (or share the directory)")
    if "could not resolve hostname" in low or "name or service not known" in low \
            or "temporary failure in name resolution" in low or "nodename nor servname" in low:
        return Probe(host, False, "name does not resolve", detail,
                     f"correct the name on line {host.line} of the hostfile, add it to /etc/hosts or DNS, "
                     f"or write the host's IP address")
    if "connection refused" in low:
        return Probe(host, False, f"connection refused: no ssh server listens on port {p}", detail,
                     f"start sshd on {name} (apt-get install openssh-server; service ssh start), or give the port "
                     f"it listens on (deepspeed --ssh_port N / zerotrain check --ssh-port N, or a Port line in "
                     f"~/.ssh/config); then set up passwordless ssh: ssh-keygen -t ed25519, ssh-copy-id {name}")
    if "permission denied" in low:
        return Probe(host, False, "permission denied: no passwordless login", detail,
                     f"set up passwordless ssh: ssh-keygen -t ed25519 (once; no passphrase, or load it into "
                     f"ssh-agent), then ssh-copy-id {name}" +
                     (" (on this machine: cat ~/.ssh/id_ed25519.pub >> ~/.ssh/authorized_keys)"
                      if is_this_machine(name) else ""))
    if "host key verification failed" in low or "remote host identification has changed" in low:
        return Probe(host, False, "host key does not match ~/.ssh/known_hosts", detail,
                     f"if {name} was reinstalled (and is the machine you mean): ssh-keygen -R {name}")
    if "banner exchange" in low:
        return Probe(host, False, f"port {p} sent no ssh greeting within {CONNECT_TIMEOUT_S} s", detail,
                     f"something accepts connections on {name} port {p} but it is not a working sshd (wrong port? "
                     f"deepspeed --ssh_port N / zerotrain check --ssh-port N; or sshd is overloaded)")
    if "timed out" in low or "no route to host" in low or "network is unreachable" in low:
        return Probe(host, False, f"no answer on port {p}", detail,
                     f"{name} is down, the address is wrong, or a firewall drops port {p}")
    if "connection closed" in low or "connection reset" in low or "kex_exchange_identification" in low:
        return Probe(host, False, f"port {p} closed the connection", detail,
                     f"is sshd what listens on {name} port {p}? (its log says why it hung up; wrong port: "
                     f"deepspeed --ssh_port N / zerotrain check --ssh-port N)")
    return Probe(host, False, f"ssh failed (exit {code})", detail,
                 f"run `ssh -v {name} true` to see why; the launcher needs it to succeed without a prompt")


def probe(host: Host, port: int | None = None, launch_dir: str | None = None,
          python: str | None = None) -> Probe:
    """ssh to `host` without any prompt; succeed only if the launch directory and this
    interpreter exist there (what the launcher will `cd` to and run on every host)."""
    launch_dir, python = launch_dir or os.getcwd(), python or sys.executable
    remote = f"test -d {shlex.quote(launch_dir)} || exit 3; test -x {shlex.quote(python)} || exit 4"
    try:
        proc = subprocess.run(ssh_command(host.name, port, remote), stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, env={**os.environ, "LC_ALL": "C"})
    except FileNotFoundError:
        return Probe(host, False, "no ssh client on this machine", "", "apt-get install openssh-client")
    except subprocess.TimeoutExpired:
        return Probe(host, False, f"no answer within {PROBE_TIMEOUT_S} s", "",
                     f"`ssh {host.name} true` hangs: check it by hand (a prompt, a slow login script, GSSAPI)")
    return _classify(host, port, proc.returncode, proc.stderr, launch_dir, python)


def pdsh_problem() -> str | None:
    """None if pdsh with its ssh module is installed (deepspeed runs it with PDSH_RCMD_TYPE=ssh)."""
    exe = shutil.which("pdsh")
    if exe is None:
        return "pdsh is not installed on this machine (deepspeed's default --launcher pdsh starts the ranks of " \
               "every host through it): apt-get install pdsh"
    try:
        out = subprocess.run([exe, "-V"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"pdsh -V failed: {e}"
    modules = re.search(r"rcmd modules:\s*([^\n(]*)", out.stdout + out.stderr)
    if modules and "ssh" not in modules[1]:
        return f"pdsh has no ssh module (rcmd modules: {modules[1].strip()}): install it (Debian/Ubuntu: the " \
               f"pdsh package has it; RHEL: pdsh-rcmd-ssh)"
    return None


def check_hosts(hosts: list[Host], hostfile: str, port: int | None = None) -> list[str]:
    """Probe every host in parallel; one 'ok' line per host (and for pdsh) or a ConfigError
    with one line per host and the fix for each failing one."""
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        probes = list(pool.map(lambda h: probe(h, port), hosts))
    pdsh = pdsh_problem() if len(hosts) > 1 else None
    width = max(len(h.name) for h in hosts)
    if all(p.ok for p in probes) and pdsh is None:
        ok = [f"ssh {p.host.name:<{width}}  ok (no prompt; {os.getcwd()} and {sys.executable} exist there)"
              for p in probes]
        if len(hosts) > 1:
            ok.append("pdsh: installed, with its ssh module")
        return ok
    failed = [p for p in probes if not p.ok]
    lines = [f"hostfile {hostfile}: `deepspeed --hostfile {hostfile}` needs passwordless ssh to every host; "
             + (f"{len(failed)} of {len(hosts)} failed:" if failed else "that works, but:")]
    for p in probes:
        lines.append(f"  {p.host.name:<{width}}  {p.what}" + (f" ({p.detail})" if p.detail else ""))
        if p.fix:
            lines.append(f"  {'':<{width}}  fix: {p.fix}")
    if pdsh:
        lines.append(f"  {'pdsh':<{width}}  {pdsh}")
    lines.append(no_ssh_alternatives(hosts, hostfile))
    raise ConfigError("\n".join(lines))


def no_ssh_alternatives(hosts: list[Host], hostfile: str) -> str:
    single = len(hosts) == 1 and is_this_machine(hosts[0].name)
    local = f"deepspeed --num_gpus {hosts[0].slots} train/main.py ..." if single else \
        "deepspeed --num_gpus N train/main.py ..."
    nodes = (f"deepspeed --no_ssh --node_rank I --hostfile {hostfile} --master_addr "
             f"{hosts[0].name.rsplit('@', 1)[-1]} --master_port 29500 train/main.py ...")
    if single:
        return (f"One machine needs no hostfile and no ssh: {local}\n"
                f"(or, once ssh works, check again: zerotrain check --hostfile {hostfile})")
    return (f"Or launch without ssh: on one machine without a hostfile ({local}); on several, run "
            f"`{nodes}` on every node, node I of the hostfile (docs/multinode.md)")
