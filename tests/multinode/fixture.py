"""The session-wide two-node rig as a pytest fixture, and helpers to launch on its nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from multinode.rig import IFACE, Node, Rig, RigUnavailable

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="session")
def two_nodes():
    """node0/node1 with sshd, shared by every multinode test; torn down at session end."""
    rig = Rig()
    try:
        rig.up()
    except RigUnavailable as e:
        pytest.skip(f"two-node rig unavailable: {e}")
    try:
        rig.ext_dir = private_jit_ops(rig.dir / "torch_extensions")
        yield rig
    finally:
        rig.down()


def private_jit_ops(dest: Path) -> Path:
    """A private, up-to-date copy of DeepSpeed's CPU comm op for the rig's ranks.

    Ranks load (and if needed JIT-build) the op before the process group exists; a rank
    stuck behind another process's rebuild of the shared .cache/torch_extensions would trip
    the short distributed.timeout_s these tests use. Copying the shared build (it is
    rebuilt here only if stale) keeps other test runs on the machine out of the rig's way."""
    import shutil
    import torch
    from helpers import subprocess_env
    if torch.cuda.is_available():
        return dest
    shared = Path(subprocess_env()["TORCH_EXTENSIONS_DIR"])
    if (shared / "deepspeed_shm_comm").is_dir():  # not its lock files: a build may be running
        shutil.copytree(shared / "deepspeed_shm_comm", dest / "deepspeed_shm_comm",
                        ignore=shutil.ignore_patterns("lock", ".ninja_lock"))
    code = ("import os, sys; sys.path.insert(0, sys.argv[1]); from zerotrain.train.launch.distributed import venv_tools_first; "
            "venv_tools_first(os.environ); from deepspeed.accelerator import get_accelerator as g; "
            "g().create_op_builder('ShareMemCommBuilder').load()")
    proc = subprocess.run([sys.executable, "-c", code, str(REPO)], env=subprocess_env({"TORCH_EXTENSIONS_DIR": str(dest)}),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"building DeepSpeed's shm comm op failed:\n{proc.stderr[-3000:]}"
    return dest


@dataclass
class Launch:
    """One command on one node, its output in a log file."""

    node: Node
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def node_env(rig: Rig, extra: dict | None = None, ifname: bool = True) -> dict:
    """The environment of a launch on the rig. Each node resolves its own hostname to
    127.0.1.1, so gloo binds loopback unless GLOO_SOCKET_IFNAME names the interface."""
    from helpers import subprocess_env
    return subprocess_env({"TORCH_EXTENSIONS_DIR": str(rig.ext_dir), **({"GLOO_SOCKET_IFNAME": IFACE} if ifname else {}),
                     **(extra or {})})


def start(rig: Rig, node: Node, argv: list[str], workdir: Path, tag: str, env: dict | None = None) -> Launch:
    log = workdir / f"{tag}.{node.name}.log"
    return Launch(node, rig.popen(node, argv, log=log, env=env or node_env(rig), cwd=workdir), log)


def finish(rig: Rig, launches: list[Launch], timeout_s: float) -> list[int]:
    """Wait for every launch (all must end within `timeout_s`), then reap leftovers on the
    nodes. On a hang, kill everything and fail with the logs."""
    deadline = time.monotonic() + timeout_s
    codes = []
    try:
        for la in launches:
            try:
                codes.append(la.proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{la.node.name}: `{' '.join(la.proc.args[4:9])} ...` still running after "
                            f"{timeout_s:.0f} s\n{logs(launches)}")
    finally:
        for la in launches:
            if la.proc.poll() is None:
                la.proc.kill()
                la.proc.wait()
        rig.reap()
    return codes


def logs(launches: list[Launch], tail: int = 6000) -> str:
    return "\n".join(f"--- {la.node.name} ({la.log.name}) exit {la.proc.returncode}\n{la.output()[-tail:]}"
                     for la in launches)


def zerotrain(args: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    """`zerotrain <args>` as users run it (the console script, or its entry point)."""
    script = BIN / "zerotrain"
    cmd = [str(script)] if script.exists() else [
        sys.executable, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); from zerotrain.train.cli import main; "
                              f"sys.exit(main())"]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
