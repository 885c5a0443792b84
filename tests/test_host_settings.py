"""Host memory settings (issue 24): nothing that trades step time for memory is on by default;
compact malloc comes on only where the memory check's plan would not fit without it, and the
banner and config.json say so. In-process: decide() on real configs and plan numbers."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

from helpers import REPO, subprocess_env

from zerotrain.train.config import load_config
from zerotrain.train.launch import device_env, host_settings
from zerotrain.train.launch.device_memory import Budget

GiB = 2 ** 30


def _ds(stage):
    """The Strategy host_settings reads (its malloc_figures): plain DDP (None) or a ZeRO stage."""
    from zerotrain.train.strategy import DDPStrategy, ZeroStrategy
    from zerotrain.train.strategy.zero import ZeroSettings
    return DDPStrategy(None) if stage is None else ZeroStrategy(SimpleNamespace(settings=ZeroSettings(stage)))


def _budget(n):
    return Budget(bytes=n, source="a test budget", device="cpu", runtime=0)


def test_device_env_sets_no_huge_pages():
    env = {}
    device_env.apply(env)
    assert "THP_MEM_ALLOC_ENABLE" not in env


def test_trainer_process_leaves_huge_pages_off():
    """train/main.py's import of device_env leaves torch's THP switch unset (it is read when torch loads)."""
    env = subprocess_env()
    env.pop("THP_MEM_ALLOC_ENABLE", None)
    code = "import os, train.main; print(os.environ.get('THP_MEM_ALLOC_ENABLE'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None"


def test_auto_keeps_glibc_where_the_run_fits_without_compact():
    cfg = load_config(None, [])
    planned = SimpleNamespace(device_total=1 * GiB)
    s = host_settings.decide(cfg, _ds(3), cuda=False, planned=planned, budget=_budget(4 * GiB))
    assert s.malloc == "glibc" and s.banner_line() is None
    assert s.record()["malloc"] == "glibc"


def test_auto_turns_compact_on_where_glibc_growth_would_not_fit():
    cfg = load_config(None, [])
    margin = cfg.distributed.memory_margin
    budget = _budget(4 * GiB)
    room = (1 - margin) * budget.bytes
    planned = SimpleNamespace(device_total=int(room / 1.2))  # fits as planned; ZeRO-3's x1.5 does not
    s = host_settings.decide(cfg, _ds(3), cuda=False, planned=planned, budget=budget)
    assert s.malloc == "compact"
    line = s.banner_line()
    assert line.startswith("host: compact malloc on (the memory check") and "+62% step time" in line
    # DDP grows far less under glibc: the same plan keeps glibc's default
    assert host_settings.decide(cfg, _ds(None), cuda=False, planned=planned, budget=budget).malloc == "glibc"


def test_auto_without_a_memory_check_or_on_a_gpu_keeps_glibc():
    cfg = load_config(None, [])
    planned = SimpleNamespace(device_total=10 * GiB)
    assert host_settings.decide(cfg, _ds(3), cuda=False).malloc == "glibc"
    assert host_settings.decide(cfg, _ds(3), cuda=True, planned=planned, budget=_budget(GiB)).malloc == "glibc"


def test_explicit_choice_wins():
    cfg = load_config(None, [("hardware.host_malloc", "compact")])
    s = host_settings.decide(cfg, _ds(2), cuda=False)
    assert s.malloc == "compact" and "hardware.host_malloc compact" in s.banner_line()
    cfg = load_config(None, [("hardware.host_malloc", "glibc")])
    planned = SimpleNamespace(device_total=int(3.5 * GiB))
    assert host_settings.decide(cfg, _ds(3), cuda=False, planned=planned, budget=_budget(4 * GiB)).malloc == "glibc"


def test_huge_pages_from_the_environment_are_recorded(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "1")
    s = host_settings.decide(load_config(None, []), _ds(2), cuda=False)
    assert s.record()["huge_pages_env"] == "1"
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
