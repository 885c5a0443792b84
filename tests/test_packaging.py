"""An installed (non-editable) zerotrain finds its own shipped configs: ds_configs/ travels in
the wheel next to train/ (pyproject package-data), where train/paths.py looks."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, subprocess_env


def test_the_wheel_carries_ds_configs_and_finds_them(tmp_path):
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("zerotrain-*.whl")
    subprocess.run([*pip, "install", "-q", "--no-deps", "--target", str(site), str(wheel)], check=True,
                   capture_output=True, timeout=300)
    code = ("import train.paths as p, train.strategy.ds_config as d\n"
            "from train.launch.distributed import resolve_ds_config_path\n"
            "assert p.__file__.startswith(%r), p.__file__\n"
            "default = resolve_ds_config_path(None, 'python')\n"
            "d.read_ds_json(default)\n"
            "print(default, sorted(x.name for x in p.DS_CONFIGS.glob('*.json')))\n") % str(site)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=subprocess_env({"PYTHONPATH": str(site)}))
    assert out.returncode == 0, out.stderr[-2000:]
    default, names = out.stdout.split(" ", 1)
    assert default.startswith(str(site / "ds_configs")) and "zero3.json" in names and "ddp.json" in names
