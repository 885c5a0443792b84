"""`zerotrain check --hostfile` (issue 12): the hostfile read by DeepSpeed's rules, and real ssh
probes of hosts that fail the way a new user's do (no processes but ssh; a few seconds each).
The success path needs an sshd: tests/test_multinode.py checks it against the two-node rig."""

from __future__ import annotations

import ast
import collections
import importlib.util
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO, free_port, subprocess_env
from zerotrain.train.errors import ConfigError
from zerotrain.train.launch.hostcheck import parse_hostfile


def check(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """`zerotrain check` as a user runs it. --cuda only skips probing for a GPU (importing torch,
    ~4 s here); the hostfile checks do not depend on it."""
    return subprocess.run([sys.executable, "-m", "zerotrain.train.cli", "check", "--cuda", *args], cwd=REPO, env=subprocess_env(),
                          capture_output=True, text=True, timeout=timeout)


def write(tmp_path: Path, text: str, name: str = "hostfile") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------ parsing
def deepspeed_parse_hostfile():
    """DeepSpeed's own `_parse_hostfile`, compiled from the installed deepspeed/launcher/runner.py
    (importing deepspeed would import torch and probe for accelerators: seconds)."""
    spec = importlib.util.find_spec("deepspeed")
    source = (Path(spec.origin).parent / "launcher" / "runner.py").read_text()
    fn = next(node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef)
              and node.name == "_parse_hostfile")
    quiet = type("Logger", (), {"error": staticmethod(lambda *a, **k: None)})()
    namespace = {"re": re, "collections": collections, "logger": quiet}
    exec(compile(ast.Module([fn], type_ignores=[]), "deepspeed/launcher/runner.py", "exec"), namespace)
    return namespace["_parse_hostfile"]


def test_a_good_hostfile_parses_as_deepspeed_parses_it(tmp_path):
    text = ("# two nodes\n\n   # indented comment\nnode0 slots=8\n"
            "user@node1\tslots=4   # trailing comment\n10.0.0.3 slots=02\r\n")
    hosts = parse_hostfile(write(tmp_path, text))
    assert [(h.name, h.slots, h.line) for h in hosts] == [("node0", 8, 4), ("user@node1", 4, 5), ("10.0.0.3", 2, 6)]
    ds = deepspeed_parse_hostfile()(text.splitlines(keepends=True))
    assert list(ds.items()) == [(h.name, h.slots) for h in hosts]


# A bad line -> (what DeepSpeed does with it, what the message must say). DeepSpeed rejects the
# first group itself (without naming the line); the second it takes, but the launch goes wrong.
BAD_LINES = {
    "node1 slot=2": ("rejects", 'cannot parse "node1 slot=2"'),
    "node1 slots = 2": ("rejects", "no spaces around '='"),
    "node1 slots=-1": ("rejects", "cannot parse"),
    "node1": ("rejects", "cannot parse"),
    "node0 slots=2": ("rejects", "host node0 is listed twice (first on line 2)"),   # the duplicate of line 2
    "node1 slots=0": ("accepts", "host node1 has slots=0"),
    "node1 slots=8 node2 slots=8": ("accepts", '"node2 slots=8" after slots=8: DeepSpeed would silently ignore it'),
    "-oProxyCommand=x slots=1": ("accepts", "starts with '-'"),
}


@pytest.mark.parametrize("bad", sorted(BAD_LINES))
def test_a_bad_line_is_named_by_file_and_line(tmp_path, bad):
    ds_verdict, needle = BAD_LINES[bad]
    text = f"# header\nnode0 slots=2\n\n{bad}\n"
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        parse_hostfile(path)
    assert str(e.value).startswith(f"{path}:4: ") and needle in str(e.value), str(e.value)
    try:
        deepspeed_parse_hostfile()(text.splitlines(keepends=True))
        assert ds_verdict == "accepts", f"DeepSpeed accepts {bad!r}"
    except ValueError:
        assert ds_verdict == "rejects", f"DeepSpeed rejects {bad!r}"


def test_missing_and_empty_hostfiles(tmp_path):
    with pytest.raises(ConfigError, match="not found .*quietly runs on this machine only"):
        parse_hostfile(tmp_path / "nope")
    with pytest.raises(ConfigError, match="no hosts"):
        parse_hostfile(write(tmp_path, "# only a comment\n\n"))


# ------------------------------------------------------------------------------------ probing
def test_a_host_name_that_does_not_resolve_is_named_with_the_fix(tmp_path):
    hostfile = write(tmp_path, "# cluster\nno-such-host.invalid slots=8\n")
    t0 = time.monotonic()
    p = check("--hostfile", str(hostfile))
    assert p.returncode == 2, p.stdout + p.stderr
    assert time.monotonic() - t0 < 10
    err = p.stderr
    assert err.startswith(f"zerotrain: error: hostfile {hostfile}: `deepspeed --hostfile {hostfile}` needs "
                          f"passwordless ssh to every host; 1 of 1 failed:"), err
    assert re.search(r"^  no-such-host\.invalid  name does not resolve \(ssh: Could not resolve hostname "
                     r"no-such-host\.invalid: .+\)$", err, re.M), err
    assert "fix: correct the name on line 2 of the hostfile, add it to /etc/hosts or DNS" in err
    assert "deepspeed --no_ssh --node_rank I" in err     # the no-ssh way, for a real cluster
    assert "Traceback" not in err


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("localhost", port), timeout=2):
            return True
    except OSError:
        return False


def test_the_shipped_hostfile_without_an_ssh_server_says_connection_refused_and_how_to_launch():
    """The shipped `localhost slots=2` on a machine without sshd: the situation where the
    documented `deepspeed --hostfile hostfile` ends in 'host=localhost was not reachable via ssh'.
    If an sshd listens on 22 here, a port nothing listens on plays its part (--ssh-port)."""
    port_args, port = ([], 22) if not _listening(22) else (["--ssh-port", str(free_port())], None)
    if port is None:
        port = int(port_args[1])
        assert not _listening(port)
    t0 = time.monotonic()
    p = check("--hostfile", "hostfile", *port_args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert time.monotonic() - t0 < 10
    err = p.stderr
    assert f"  localhost  connection refused: no ssh server listens on port {port} (ssh: connect to host " \
           f"localhost port {port}: Connection refused)" in err, err
    assert "fix: start sshd on localhost" in err and "ssh-copy-id localhost" in err
    # One machine: the launch that needs no ssh at all, with the hostfile's slot count.
    assert "One machine needs no hostfile and no ssh: deepspeed --num_gpus 2 train/main.py ..." in err
    assert "Traceback" not in err


def test_hosts_are_probed_in_parallel_with_a_timeout_and_pdsh_is_looked_for(tmp_path, monkeypatch):
    """Four hosts whose port accepts the connection and then says nothing (a hung or wrong
    server: ssh waits for the greeting until ConnectTimeout, 5 s): checked together in about
    one timeout, not four, each named. Without pdsh on PATH a multi-host hostfile is reported
    for that too (DeepSpeed's default multi-node launcher)."""
    from zerotrain.train.launch.hostcheck import CONNECT_TIMEOUT_S, check_hosts
    silent = socket.socket()
    silent.bind(("0.0.0.0", 0))
    silent.listen(16)   # the kernel completes the handshakes; nobody ever answers
    port = silent.getsockname()[1]
    names = ["localhost", "127.0.0.2", "127.0.0.3", "127.0.0.4"]
    hosts = parse_hostfile(write(tmp_path, "".join(f"{n} slots=1\n" for n in names)))
    ssh = shutil.which("ssh")
    assert ssh, "no ssh client"
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "ssh").symlink_to(ssh)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # ssh, but no pdsh
    t0 = time.monotonic()
    try:
        with pytest.raises(ConfigError) as e:
            check_hosts(hosts, "hostfile", port)
    finally:
        silent.close()
    took = time.monotonic() - t0
    # In parallel: about one timeout. One after another would take 4; the bound leaves a loaded
    # machine 2 timeouts of slack to start four ssh clients.
    assert CONNECT_TIMEOUT_S <= took < 3 * CONNECT_TIMEOUT_S, took
    msg = str(e.value)
    assert "4 of 4 failed" in msg, msg
    assert all(f"  {n:<9}  port {port} sent no ssh greeting within 5 s" in msg for n in names), msg
    assert "pdsh is not installed on this machine" in msg and "apt-get install pdsh" in msg


def test_no_ssh_check_and_an_accelerate_launch_without_ssh_skip_the_probe(tmp_path):
    """Hosts are probed before the run file is read: a missing run file reported instead of
    the unreachable hosts shows that nothing was probed (and keeps this test to a second, not
    the ~5 s of a complete check)."""
    hostfile = write(tmp_path, "no-such-host.invalid slots=8\nno-such-host-2.invalid slots=8\n")
    missing = ["--config", str(tmp_path / "missing.yaml")]
    p = check("--hostfile", str(hostfile), *missing)
    assert p.returncode == 2 and "2 of 2 failed" in p.stderr, p.stderr              # probed
    p = check("--hostfile", str(hostfile), "--no-ssh-check", *missing)
    assert p.returncode == 2 and p.stderr == f"zerotrain: error: {tmp_path / 'missing.yaml'}: file not found\n"
    # accelerate's `standard` multi-node launcher runs torchrun on each machine: no ssh.
    template = (REPO / "ds_configs" / "accelerate" / "multinode_zero2.yaml").read_text()
    standard = write(tmp_path, template, "standard.yaml")
    p = check("--hostfile", str(hostfile), "--accelerate-config", str(standard), *missing)
    assert p.returncode == 2 and p.stderr == f"zerotrain: error: {tmp_path / 'missing.yaml'}: file not found\n"
    # ... its `pdsh` launcher goes through `deepspeed --hostfile`: probed.
    pdsh = write(tmp_path, template.replace("launcher: standard", "launcher: pdsh"), "pdsh.yaml")
    p = check("--hostfile", str(hostfile), "--accelerate-config", str(pdsh), *missing)
    assert p.returncode == 2 and "2 of 2 failed" in p.stderr, p.stderr


@pytest.mark.parametrize("stderr, what, fix", [
    ("root@node1: Permission denied (publickey).", "permission denied: no passwordless login",
     "ssh-keygen -t ed25519 (once; no passphrase, or load it into ssh-agent), then ssh-copy-id node1"),
    ("@@@@@@@@\n@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n@@@@@@@@\n"
     "Host key verification failed.", "host key does not match ~/.ssh/known_hosts", "ssh-keygen -R node1"),
    ("ssh: connect to host node1 port 22: Connection timed out", "no answer on port 22", "a firewall drops port 22"),
    ("ssh: connect to host node1 port 22: No route to host", "no answer on port 22", "node1 is down"),
])
def test_ssh_failures_are_told_apart(stderr, what, fix):
    """The failures this machine cannot produce for real (no sshd, no second host), from ssh's
    own messages (OpenSSH 9, LC_ALL=C as the probe runs it)."""
    from zerotrain.train.launch.hostcheck import Host, _classify
    p = _classify(Host("node1", 8, 1), None, 255, stderr, "/work", "/work/.venv/bin/python")
    assert (p.ok, p.what) == (False, what) and fix in p.fix and p.detail == stderr.splitlines()[-1]
