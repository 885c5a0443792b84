"""zerotrain installs under one namespace and lives beside a user's own code.

The wheel holds zerotrain.train, zerotrain.models and zerotrain.ds_configs (setup.py maps the
top-level folders there): nothing named train, models or ds_configs lands in site-packages, so a
user's own `models` package (most ML repositories have one) is the one `import models` finds,
in their code and in a run, and the installed zerotrain still finds its shipped configs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from helpers import MAIN, REPO, subprocess_env

USER_MODELS = '''"""The user's own models package: it must win over anything zerotrain installs."""
import torch


class GPT(torch.nn.Module):
    """The user's GPT (a bigram model is enough here), named like zerotrain's own."""
    OWNER = "user"

    def __init__(self, vocab: int = 256, width: int = 16):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids):         # (B, T) token ids
        return self.head(self.emb(input_ids))  # (B, T, vocab) logits


def build(vocab: int = 256, width: int = 16) -> GPT:
    return GPT(vocab, width)
'''


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheels")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(REPO)],
                   check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("zerotrain-*.whl")
    return whl


def test_the_wheel_installs_only_the_zerotrain_namespace(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"zerotrain"}, tops
    assert "zerotrain/__init__.py" not in names  # a namespace: `zerotrain.*` may be extended
    for must in ("zerotrain/train/main.py", "zerotrain/train/cli.py", "zerotrain/models/gpt.py",
                 "zerotrain/ds_configs/zero3.json", "zerotrain/ds_configs/accelerate/zero2.yaml",
                 "zerotrain/train/strategy/zero.py"):
        assert must in names, must
    entry = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "zerotrain = zerotrain.train.cli:main" in zipfile.ZipFile(wheel).read(entry).decode()


def test_no_production_code_touches_sys_path():
    hits = [f"{p.relative_to(REPO)}:{i}" for folder in ("train", "models") for p in (REPO / folder).rglob("*.py")
            for i, line in enumerate(p.read_text().splitlines(), 1) if "sys.path" in line]
    assert not hits, hits


@pytest.mark.multiproc
def test_a_fresh_venv_with_the_wheel_runs_beside_the_users_own_models_package(wheel, tmp_path):
    """A fresh venv (its dependencies borrowed from this one through a path line, which does not
    run this venv's editable-install hook), the wheel installed, and a user directory with its
    own models/ package holding a models.GPT of its own."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # --ignore-installed: the borrowed site-packages (or a zerotrain.egg-info on PYTHONPATH) may
    # already list a zerotrain; the wheel must land in the fresh venv regardless.
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", str(py), "install",
                    "-q", "--no-deps", "--ignore-installed", str(wheel)], check=True, capture_output=True, timeout=300,
                   env=subprocess_env({"PYTHONPATH": None}))
    user = tmp_path / "user_project"
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text(USER_MODELS)
    env = subprocess_env({"PYTHONPATH": str(user)})  # the user's code is importable, as in their own repo

    probe = ("import models, zerotrain.train.paths as p, zerotrain.models as zm\n"
             "assert models.GPT.OWNER == 'user', models.__file__\n"
             "assert p.__file__.startswith(%r), p.__file__\n"
             "assert zm.__file__.startswith(%r), zm.__file__\n"
             "assert (p.DS_CONFIGS / 'zero3.json').is_file()\n"
             "print('ok')\n") % (str(purelib), str(purelib))
    out = subprocess.run([str(py), "-c", probe], cwd=user, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]

    out = subprocess.run([str(venv / "bin" / "zerotrain"), "--help"], cwd=user, env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "plan" in out.stdout and "prepare" in out.stdout, out.stderr[-2000:]

    # train/main.py of the source checkout, run by the fresh venv's Python from the user's
    # directory, training the user's own models.GPT (model.name py:<module>:<factory>)
    run_dir = tmp_path / "run"
    out = subprocess.run([str(py), MAIN, "--model.name", "py:models:build", "--model.kwargs", "{width: 8}",
                          "--data.seq_len", "32", "--data.max_bytes", "100000", "--train.max_steps", "2",
                          "--train.micro_batch_size", "2", "--train.eval_every", "0", "--train.sample_tokens", "0",
                          "--checkpoint.save_at_end", "false", "--checkpoint.export", "false",
                          "--train.run_dir", str(run_dir)],  # the default DeepSpeed JSON: the wheel's own
                         cwd=user, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert "py:models:build" in out.stdout and "your factory" in out.stdout, out.stdout[-2000:]  # the banner
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert rows[-1]["step"] == 2 and losses and all(math.isfinite(x) for x in losses), rows[-1:]


def test_main_without_zerotrain_installed_says_how_to_install(tmp_path):
    """A Python without zerotrain (a bare venv): one line naming the fix, no traceback."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    out = subprocess.run([str(venv / "bin" / "python"), MAIN, "--help"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60, env=subprocess_env({"PYTHONPATH": None}))
    assert out.returncode != 0
    assert "zerotrain is not installed" in out.stderr and "pip install -e ." in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
