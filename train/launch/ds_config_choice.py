"""Which DeepSpeed JSON a run uses: the one it names (--ds-config / distributed.ds_config), the one
an accelerate config fixes, or the default for this hardware."""

from __future__ import annotations

import os
from pathlib import Path

import torch

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
    if launcher == "accelerate" and acc_uses_ds and acc_file and acc_file != "none":
        if cli_or_file and Path(cli_or_file).resolve() != Path(acc_file).resolve():
            raise ConfigError(f"the accelerate config names deepspeed_config_file {acc_file} but the run asks for "
                              f"{cli_or_file} (--ds-config / distributed.ds_config); use one of them")
        return acc_file
    if launcher == "accelerate" and not acc_uses_ds:
        if cli_or_file and "ddp" not in read_ds_json(cli_or_file):
            raise ConfigError(f"the accelerate config launches plain DDP (no deepspeed_config) but the run asks for "
                              f"DeepSpeed config {cli_or_file}; use ds_configs/accelerate/zero*.yaml or drop --ds-config")
        return cli_or_file or str(paths.DS_CONFIGS / "ddp.json")
    return cli_or_file or str(paths.DS_CONFIGS / default_ds_config()[0])


def default_ds_config() -> tuple[str, str]:
    """(file in ds_configs/, why) when the run names none: ZeRO-2 in the fastest precision this
    hardware has (train/strategy/precision.py machine_precision, also what "enabled": "auto" means)."""
    precision, why = machine_precision(torch.cuda.is_available())
    name, label = {"bf16": ("zero2.json", "bf16"), "fp16": ("zero2_fp16.json", "fp16 with loss scaling"),
                   "fp32": ("zero2_fp32.json", "fp32")}[precision]
    return name, f"ZeRO-2, {label}: {why}"
