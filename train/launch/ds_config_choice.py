"""Which DeepSpeed JSON a run uses: the one it names (--ds-config / distributed.ds_config), the one
an accelerate config fixes, or the default for this hardware."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import zerotrain.train.strategy.registry as registry
from zerotrain.train import paths
from zerotrain.train.errors import ConfigError
from zerotrain.train.strategy.ds_config import read_ds_json
from zerotrain.train.strategy.precision import machine_precision


def resolve_ds_config_path(cli_or_file: str | None, launcher: str) -> str:
    """Which DeepSpeed JSON: explicit (--ds-config / run file) > accelerate YAML > default."""
    acc_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    acc_uses_ds = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if launcher == "accelerate" and cli_or_file and cli_or_file.split(":")[0] == "auto":
        raise ConfigError(f"--ds-config {cli_or_file} chooses the strategy at start-up, but an accelerate config "
                          f"fixes it already; launch with deepspeed, torchrun or python instead")
    if launcher == "accelerate" and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return fsdp_file(cli_or_file)
    if launcher == "accelerate" and acc_uses_ds and acc_file and acc_file != "none":
        if cli_or_file and Path(cli_or_file).resolve() != Path(acc_file).resolve():
            raise ConfigError(f"the accelerate config names deepspeed_config_file {acc_file} but the run asks for "
                              f"{cli_or_file} (--ds-config / distributed.ds_config); use one of them")
        return acc_file
    if launcher == "accelerate" and not acc_uses_ds:
        if cli_or_file and registry.for_json(read_ds_json(cli_or_file), cli_or_file).name == "deepspeed":
            raise ConfigError(f"the accelerate config launches without DeepSpeed (no deepspeed_config) but the run asks "
                              f"for DeepSpeed config {cli_or_file}; use ds_configs/accelerate/zero*.yaml or drop --strategy")
        return cli_or_file or str(paths.DS_CONFIGS / "ddp.json")
    return cli_or_file or str(paths.DS_CONFIGS / default_ds_config()[0])


# What an accelerate YAML's fsdp_config exports (accelerate launch) that zerotrain's FSDP2 cannot
# take from there: each with the way to get it.
FSDP_ENV_REFUSED = {"FSDP_OFFLOAD_PARAMS": "fsdp_offload_params: FSDP2 here keeps parameters on the device; "
                                           "use ds_configs/zero3_offload.json",
                    "FSDP_ACTIVATION_CHECKPOINTING": "fsdp_activation_checkpointing: set model.activation_checkpointing "
                                                     "true in the run file instead"}


def fsdp_file(cli_or_file: str | None) -> str:
    """The FSDP2 strategy file of an accelerate YAML with `distributed_type: FSDP`: the one the run
    names (its reshard_after_forward must be the YAML's), else ds_configs/fsdp2.json
    (fsdp_reshard_after_forward true) or fsdp2_keep.json (false)."""
    version = os.environ.get("FSDP_VERSION", "1")
    if version != "2":
        raise ConfigError(f"the accelerate config sets fsdp_version {version}; zerotrain trains FSDP2 only: set "
                          f"fsdp_version: 2 (ds_configs/accelerate/fsdp2.yaml)")
    for var, why in FSDP_ENV_REFUSED.items():
        if os.environ.get(var, "false").lower() == "true":
            raise ConfigError(f"the accelerate config sets {why}")
    reshard = os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true").lower() == "true"
    if cli_or_file is None:
        return str(paths.DS_CONFIGS / ("fsdp2.json" if reshard else "fsdp2_keep.json"))
    ds = read_ds_json(cli_or_file)
    if registry.for_json(ds, cli_or_file).name != "fsdp2":
        raise ConfigError(f"the accelerate config launches FSDP (distributed_type: FSDP) but the run asks for "
                          f"{cli_or_file}; use an fsdp2*.json strategy file or another accelerate config")
    if bool((ds.get("fsdp") or {}).get("reshard_after_forward", True)) != reshard:
        raise ConfigError(f"the accelerate config sets fsdp_reshard_after_forward {str(reshard).lower()} but "
                          f"{cli_or_file} sets the opposite; make them agree")
    return cli_or_file


def default_ds_config() -> tuple[str, str]:
    """(file in ds_configs/, why) when the run names none: ZeRO-2 in the fastest precision this
    hardware has (train/strategy/precision.py machine_precision, also what "enabled": "auto" means)."""
    precision, why = machine_precision(torch.cuda.is_available())
    name, label = {"bf16": ("zero2.json", "bf16"), "fp16": ("zero2_fp16.json", "fp16 with loss scaling"),
                   "fp32": ("zero2_fp32.json", "fp32")}[precision]
    return name, f"ZeRO-2, {label}: {why}"
