"""Shared test helpers: launch train/main.py through the real launchers, read results.

Multi-process tests start real processes (2 ranks, gloo on CPU). They use gpt-tiny, a
small slice of the default corpus and fp32 JSON variants where bf16 would only cost time
(bf16 matmuls are ~80x slower than fp32 on AVX2-only CPUs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MAIN = str(REPO / "train" / "main.py")
sys.path.insert(0, str(REPO))

# Small and fast: a 115k-parameter GPT on 300 kB of text, 64-token sequences.
TINY = ["--model.name", "gpt-tiny", "--data.seq_len", "64", "--data.max_bytes", "300000",
        "--train.micro_batch_size", "4", "--train.progress", "false", "--train.sample_tokens", "0",
        "--train.eval_batches", "4", "--logging.every_steps", "1", "--optim.warmup_steps", "2",
        "--optim.lr", "3e-3", "--checkpoint.export", "false", "--checkpoint.save_at_end", "false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE=env.get("WANDB_MODE", "disabled"),
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def launch_cmd(launcher: str, nproc: int, args: list[str], accelerate_config: str | None = None) -> list[str]:
    port = str(free_port())
    if launcher == "python":
        assert nproc == 1
        return [sys.executable, MAIN, *args]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port, MAIN, *args]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, MAIN, *args]
    if launcher == "accelerate":
        cfg = accelerate_config or str(REPO / "ds_configs" / "accelerate" / "zero2.yaml")
        return [str(BIN / "accelerate"), "launch", "--config_file", cfg, "--num_processes", str(nproc),
                "--main_process_port", port, MAIN, *args]
    raise ValueError(launcher)


def run_train(launcher: str, nproc: int, args: list[str], *, timeout: int = 600, env: dict | None = None,
              check: bool = True, accelerate_config: str | None = None, cwd: str | Path | None = None):
    cmd = launch_cmd(launcher, nproc, args, accelerate_config)
    proc = subprocess.run(cmd, cwd=cwd or REPO, env=test_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def ds_variant(tmp_path: Path, base: str, name: str | None = None, **changes) -> str:
    """A copy of ds_configs/<base>.json with top-level keys replaced (e.g. bf16={"enabled": False})."""
    data = json.loads((REPO / "ds_configs" / f"{base}.json").read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    out = tmp_path / f"{name or base}.json"
    out.write_text(json.dumps(data, indent=1))
    return str(out)


def fp32(tmp_path: Path, base: str) -> str:
    return ds_variant(tmp_path, base, f"{base}_fp32", bf16={"enabled": False}, fp16={"enabled": False})


@pytest.fixture
def repo() -> Path:
    return REPO
