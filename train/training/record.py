"""The run record: <run_dir>/config.json, the run config with everything the build resolved
(also the W&B run's config and every checkpoint's copy), and classes.json for a classifier."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib.metadata import version
from typing import TYPE_CHECKING

import torch

from zerotrain.train import paths

if TYPE_CHECKING:
    from zerotrain.train.config import RunConfig
    from zerotrain.train.training.loaders import Loaders
    from zerotrain.train.training.assembly import Distributed, Model, Runtime, RunData


def record_run(cfg: RunConfig, rt: Runtime, data: RunData, dist: Distributed, model: Model,
               loaders: Loaders) -> dict:
    """config.json's content: the run config with what the build derived filled in, and a
    "resolved" section (strategy, world, versions, memory, host and hardware settings). Rank 0
    writes it, and classes.json for a classifier's data. Also the W&B run's config."""
    record = cfg.to_dict()
    batch, bundle, workload = rt.batch, data.bundle, model.workload
    record["train"]["grad_accum_steps"] = batch.accum
    record["train"]["global_batch_size"] = batch.global_size
    record["checkpoint"]["resume"] = rt.resume  # an elastic restart's "auto" (train/launch/elastic.py layout)
    record["train"]["max_steps"] = data.max_steps
    record["data"]["seq_len"] = bundle.seq_len
    if bundle.mixture is not None:
        record["data"]["mixture"] = bundle.mixture.record()  # each source's sequences and samples per epoch
    record["model"]["resolved"] = workload.model_config
    if workload.moe is not None:
        record["model"]["resolved"] = {**workload.model_config, "moe": workload.moe.info.record()}
    if workload.lora is not None:
        record["model"]["lora"]["resolved"] = workload.lora  # the target modules chosen, where the base comes from
    record["distributed"]["ds_config"] = dist.strategy.path
    record["resolved"] = _resolved(cfg, rt, data, dist, model, loaders)
    if data.hub:  # Hub ids: the commit each revision resolved to (train/launch/hub_fetch.py)
        record["resolved"]["hub"] = data.hub
    if dist.acc.is_main_process:
        (rt.run_dir / "config.json").write_text(json.dumps(record, indent=2, default=str) + "\n")
        if bundle.class_names:  # index -> class name, to read predictions of the trained classifier
            (rt.run_dir / "classes.json").write_text(json.dumps(bundle.class_names, indent=1) + "\n")
    return record


def _resolved(cfg: RunConfig, rt: Runtime, data: RunData, dist: Distributed, model: Model,
              loaders: Loaders) -> dict:
    strategy, topo, budget = dist.strategy, dist.topo, dist.budget
    out = {
        "deepspeed_config": strategy.ds.resolved, **strategy.record(),
        "world_size": topo.world_size, "num_nodes": topo.num_nodes, "launcher": topo.launcher,
        "device": topo.device, "comm_backend": topo.backend,
        "tokens_per_step": rt.batch.global_size * data.bundle.items_per_sample,
        # Versions from the package metadata, not by importing: a DDP run of the GPT imports
        # neither DeepSpeed nor transformers (start-up time).
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     **{name: version(name) for name in ("deepspeed", "accelerate", "transformers")}},
        "git_commit": _git_commit(),
    }
    if budget is not None:
        out["memory_budget"] = {"bytes": budget.bytes, "source": budget.source, "device": budget.device,
                                "runtime_bytes": budget.runtime}
    if dist.planned.checked is not None:
        out["memory_plan"] = dist.planned.checked.to_dict()  # the peak the check compared with the budget
    if dist.planned.async_off:  # checkpoint.async asked for, saves synchronous: why
        out["checkpoint_async_off"] = dist.planned.async_off
    if strategy.ds.precision_why:  # the JSON's "enabled": "auto", resolved (train/strategy/ds_config.py)
        out["precision_auto"] = strategy.ds.precision_why
    if dist.choice is not None:
        out["auto_ds_config"] = dist.choice.record()
    out["host_settings"] = dist.host.record()
    if loaders.pad_to is not None:  # instruction data: what the batches are padded to (SftData.pad_to)
        out["pad_to"] = loaders.pad_to
    stream = data.bundle.stream
    out["hardware"] = {"float32_matmul_precision": rt.matmul_precision, "cpu_threads": rt.threads,
                       "cpu_threads_from": rt.threads_from,
                       "channels_last": model.channels_last, "compile": cfg.hardware.compile,
                       "data_workers": loaders.workers, **({"stream_workers": stream.workers} if stream else {})}
    return out


def _git_commit():
    try:
        out = subprocess.run(["git", "-C", str(paths.REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
