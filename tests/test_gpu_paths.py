"""The GPU-only decisions, checked where CI runs (no GPU): every shipped JSON setting reaches
what uses it, and each hardware option resolves as documented.

The fp16 optimizers themselves run in tests/test_fp16.py, the sync-free step in
tests/test_sync_free.py; bench/gpu_check.sh is what runs on a real GPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from helpers import REPO
from zerotrain.train.launch import device_env
from zerotrain.train.training import hardware
from zerotrain.train.config import load_config
from zerotrain.train.strategy.ds_config import load_ds_setup
from zerotrain.train.errors import ConfigError

SHIPPED = sorted(p.stem for p in (REPO / "ds_configs").glob("*.json"))


def _write(tmp_path, ds: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return str(path)


# ------------------------------------------------------------------ shipped JSONs
@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_every_shipped_json_takes_every_schedule(schedule):
    """The LR schedule is optim.schedule; no shipped file pins one (they used to pin WarmupCosineLR,
    so --optim.schedule linear failed with every one of them)."""
    cfg = load_config(None, [("optim.schedule", schedule)])
    for name in SHIPPED:
        ds = load_ds_setup(str(REPO / "ds_configs" / f"{name}.json"), cfg, cfg.train.batch(2), 100, cuda=True,
                             hidden_size=64)
        assert "scheduler" not in ds.resolved, name


def test_no_shipped_key_is_left_unused():
    """stage3_gather_16bit_weights_on_model_save (DeepSpeed's save_16bit_model, never called)
    is gone from the shipped files; a "false" in a user's file is refused, "true" is what
    zerotrain's export does anyway."""
    for name in SHIPPED:
        zero = json.loads((REPO / "ds_configs" / f"{name}.json").read_text()).get("zero_optimization", {})
        assert "stage3_gather_16bit_weights_on_model_save" not in zero, name


def test_gather_16bit_on_save_false_is_refused(tmp_path):
    cfg = load_config(None)
    zero = {"stage": 3, "stage3_gather_16bit_weights_on_model_save": False}
    with pytest.raises(ConfigError, match="never calls DeepSpeed's save_16bit_model.*checkpoint.export false"):
        load_ds_setup(_write(tmp_path, {"zero_optimization": zero}), cfg, cfg.train.batch(2), 100, cuda=False,
                        hidden_size=64)
    zero["stage3_gather_16bit_weights_on_model_save"] = True
    load_ds_setup(_write(tmp_path, {"zero_optimization": zero}), cfg, cfg.train.batch(2), 100, cuda=False, hidden_size=64)


# ------------------------------------------------------------------ DDP fp16 -> GradScaler
def test_ddp_fp16_settings_reach_the_grad_scaler(tmp_path):
    cfg = load_config(None)
    ddp = json.loads((REPO / "ds_configs" / "ddp.json").read_text())
    ddp["bf16"], ddp["fp16"]["enabled"] = {"enabled": False}, True
    ddp["fp16"].update(initial_scale_power=12, loss_scale_window=50)
    ds = load_ds_setup(_write(tmp_path, ddp), cfg, cfg.train.batch(2), 100, cuda=True)
    assert ds.precision == "fp16" and ds.settings.grad_scaler == {"init_scale": 4096.0, "growth_interval": 50}
    # ... and Accelerate builds its GradScaler from them (the handler build_accelerator passes).
    from accelerate.utils import GradScalerKwargs
    assert GradScalerKwargs(**ds.settings.grad_scaler).to_kwargs() == {"init_scale": 4096.0, "growth_interval": 50}
    ddp["bf16"] = {"enabled": True}
    ddp["fp16"]["enabled"] = False
    assert load_ds_setup(_write(tmp_path, ddp), cfg, cfg.train.batch(2), 100, cuda=True).settings.grad_scaler is None


@pytest.mark.parametrize("fp16,needle", [
    ({"loss_scale": 128}, "no static loss scale"),
    ({"hysteresis": 2}, "lowers the scale at every overflow"),
    ({"min_loss_scale": 1}, '"fp16.min_loss_scale" has no equivalent in DDP\'s GradScaler'),
])
def test_ddp_fp16_settings_without_a_grad_scaler_meaning_are_refused(tmp_path, fp16, needle):
    cfg = load_config(None)
    ds = {"ddp": {}, "fp16": {"enabled": True, **fp16}}
    with pytest.raises(ConfigError, match=needle):
        load_ds_setup(_write(tmp_path, ds), cfg, cfg.train.batch(2), 100, cuda=True)


# ------------------------------------------------------------------ hardware options
def test_default_ds_config_suits_the_hardware(monkeypatch):
    from zerotrain.train.launch.ds_config_choice import default_ds_config
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_ds_config()[0] == "zero2_fp32.json"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert default_ds_config()[0] == "zero2.json"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert default_ds_config()[0] == "zero2_fp16.json"
    for name in ("zero2.json", "zero2_fp16.json", "zero2_fp32.json"):
        assert (REPO / "ds_configs" / name).is_file()


def test_tf32_is_on_for_cuda_fp32_matmuls_unless_disabled():
    assert hardware.float32_matmul_precision(load_config(None), cuda=True) == "high"
    assert hardware.float32_matmul_precision(load_config(None, [("hardware.tf32", "false")]), cuda=True) == "highest"
    assert hardware.float32_matmul_precision(load_config(None), cuda=False) is None


def test_cpu_ranks_of_a_node_share_its_cores_unless_omp_num_threads_says_otherwise():
    """2 ranks on 2 cores with torch's default (2 threads each) oversubscribe the cores (issue 24,
    issue 41). Where OMP_NUM_THREADS is unset, each rank gets the node's cores / its ranks, as the
    launcher that started it counts them; the user's (or torchrun's) OMP_NUM_THREADS stands."""
    assert device_env.cpu_threads({"LOCAL_WORLD_SIZE": "2"}, 16) == (8, "16 core(s) / 2 rank(s) on this node")
    assert device_env.cpu_threads({"LOCAL_SIZE": "2"}, 16)[0] == 8          # the deepspeed launcher
    assert device_env.cpu_threads({"OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 16)[0] == 4
    assert device_env.cpu_threads({"LOCAL_WORLD_SIZE": "32"}, 16)[0] == 1
    assert device_env.cpu_threads({}, 16)[0] == 16                          # 1 process: every core
    assert device_env.cpu_threads({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "4"}, 16) is None
    assert device_env.cpu_threads({"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": " "}, 16)[0] == 8
    env = {"LOCAL_SIZE": "2"}
    device_env.apply(env)
    assert env["OMP_NUM_THREADS"] == str(max(1, device_env.cores() // 2))
    mine = {"LOCAL_SIZE": "2", "OMP_NUM_THREADS": "3"}
    device_env.apply(mine)
    assert mine["OMP_NUM_THREADS"] == "3"


def test_the_deepspeed_launchers_node_ranks_reach_accelerate(monkeypatch):
    """The deepspeed launcher sets LOCAL_SIZE, not LOCAL_WORLD_SIZE. Accelerate's multi-CPU DDP then
    counted 1 rank on the node, gave each rank every core (over the trainer's share) and wrote
    LOCAL_WORLD_SIZE=1 back: 2 DDP ranks x 2 threads on 2 cores ran at about 0.6 of the 1-thread
    speed (BENCHMARKS.md). normalize_env says how many ranks share the node, for every reader."""
    from accelerate.utils.environment import get_cpu_distributed_information
    from zerotrain.train.launch import distributed
    for k in ("LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "ACCELERATE_MIXED_PRECISION", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(k, raising=False)
    node1_of_2 = {"CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "4", "RANK": "5", "WORLD_SIZE": "8",
                  "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    for k, v in node1_of_2.items():
        monkeypatch.setenv(k, v)
    assert distributed.normalize_env() == "deepspeed"
    assert os.environ["LOCAL_WORLD_SIZE"] == "4"
    assert get_cpu_distributed_information().local_world_size == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a launcher's own value is kept
    distributed.normalize_env()
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"


def _ds(tmp_path, name):
    """The Strategy of a shipped JSON (train/strategy/), resolved as a GPU run would."""
    from zerotrain.train.strategy import for_setup
    cfg = load_config(None)
    return for_setup(load_ds_setup(str(REPO / "ds_configs" / f"{name}.json"), cfg, cfg.train.batch(2), 100, cuda=True,
                                   hidden_size=64))


def test_channels_last_is_for_vision_under_ddp_on_cuda(tmp_path):
    ddp, zero2 = _ds(tmp_path, "ddp"), _ds(tmp_path, "zero2")
    auto = load_config(None, [("model.name", "resnet18")])
    assert hardware.use_channels_last(auto, ddp, "vision", cuda=True)
    assert not hardware.use_channels_last(auto, ddp, "vision", cuda=False)
    assert not hardware.use_channels_last(auto, zero2, "vision", cuda=True)  # DeepSpeed flattens parameters
    assert not hardware.use_channels_last(load_config(None), ddp, "gpt", cuda=True)
    on = load_config(None, [("model.name", "resnet18"), ("model.channels_last", "true")])
    with pytest.raises(ConfigError, match="flat contiguous buffers"):
        hardware.use_channels_last(on, zero2, "vision", cuda=True)
    with pytest.raises(ConfigError, match="--model.channels_last is not a key of model family gpt"):
        load_config(None, [("model.channels_last", "true")])


def test_compile_is_refused_under_zero3(tmp_path):
    cfg = load_config(None, [("hardware.compile", "true")])
    _ds(tmp_path, "zero2").check_run(cfg)
    with pytest.raises(ConfigError, match="hardware.compile with ZeRO-3"):
        _ds(tmp_path, "zero3").check_run(cfg)


def test_image_decoding_gets_worker_processes_by_default(monkeypatch):
    monkeypatch.setattr(hardware, "cores_per_rank", lambda local_world: 16 // local_world)
    images = load_config(None, [("data.kind", "imagefolder"), ("data.path", "x")]).data
    assert hardware.data_workers(images, local_world=1) == 8 and hardware.data_workers(images, local_world=8) == 1
    assert hardware.data_workers(load_config(None).data, local_world=1) == 0        # bytes in memory
    assert hardware.data_workers(load_config(None, [("data.num_workers", "3")]).data, local_world=1) == 3


def test_zerotrain_device_cpu_hides_the_gpus():
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "ZEROTRAIN_DEVICE": "cpu"}
    device_env.apply(env)
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["DS_ACCELERATOR"] == "cpu"
    untouched = {"CUDA_VISIBLE_DEVICES": "0,1"}
    device_env.apply(untouched)
    assert untouched["CUDA_VISIBLE_DEVICES"] == "0,1" and "DS_ACCELERATOR" not in untouched
    with pytest.raises(SystemExit, match='ZEROTRAIN_DEVICE="gpu" is not understood'):
        device_env.apply({"ZEROTRAIN_DEVICE": "gpu"})


# ------------------------------------------------------------------ metrics
def test_peak_memory_restarts_at_each_log_line():
    """peak_mem_bytes is the peak of the interval it is logged for (it used to be the process's
    lifetime peak); the run's peak stays available to wrappers (bench/rank_peak.py). In a fresh
    process: this one's heap already holds freed memory that a new tensor would reuse."""
    import subprocess
    import sys
    script = """
import torch
from zerotrain.train.observe import metrics
metrics.reset_peak_memory()
big = torch.ones(256 * 2**20 // 4)  # 256 MiB, touched; above glibc's mmap threshold: freed to the OS
with_big = metrics.peak_memory()[0]
del big
metrics.reset_peak_memory()
after = metrics.peak_memory()[0]
print(with_big, after, metrics.lifetime_peaks()[0])
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with_big, after, lifetime = map(int, out.stdout.split())
    assert with_big - after > 200 * 2**20, (with_big, after)
    assert lifetime >= with_big
