"""The training precision of a strategy file, shared by every backend: which of bf16, fp16 and
fp32 a JSON's "bf16"/"fp16" blocks select (their "enabled" may be "auto": accelerate's
mixed_precision, else the machine's fastest precision), filled back into the JSON as booleans.
train/strategy/ds_config.py reads a file with it; the planner's options (option.py) and the
default file's choice (train/launch/ds_config_choice.py) too. It imports nothing of zerotrain but
the errors."""

from __future__ import annotations

import os

from zerotrain.train.errors import ConfigError


def is_auto(v) -> bool:
    return isinstance(v, str) and v.lower() == "auto"


HALF = ("bf16", "fp16")


def machine_precision(cuda: bool) -> tuple[str, str]:
    """(precision, why): the fastest this machine trains in; what a run without --ds-config
    takes (train/launch/ds_config_choice.py default_ds_config) and what "enabled": "auto" becomes.
    bf16 on GPUs that compute it (Ampere and newer), fp16 with loss scaling on older GPUs, fp32
    on CPUs: without bf16 matmul units they emulate it, several times slower (measured:
    BENCHMARKS.md "CPU: every stage, 2 processes")."""
    if not cuda:
        return "fp32", "no GPU here, and CPUs emulate bf16 ~7x slower"
    import torch
    if not torch.cuda.is_available():  # `zerotrain check --cuda` from a CPU machine
        return "bf16", "a CUDA GPU (assumed to compute bf16, as Ampere and newer do)"
    if torch.cuda.is_bf16_supported():
        return "bf16", "this GPU computes bf16 natively"
    return "fp16", "this GPU has no native bf16"


def _enabled_states(path, ds: dict) -> dict:
    """{"bf16": True | False | "auto", "fp16": ...} as the JSON says; an absent block is False."""
    states = {}
    for name in HALF:
        block = ds.get(name, {})
        if not isinstance(block, dict):
            raise ConfigError(f'{path}: "{name}" must be an object like {{"enabled": true}}')
        value = block.get("enabled", False)
        if is_auto(value):
            value = "auto"
        elif not isinstance(value, bool):
            raise ConfigError(f'{path}: "{name}.enabled" must be true, false or "auto" (got {value!r})')
        states[name] = value
    if "amp" in ds and ds["amp"].get("enabled"):
        raise ConfigError(f'{path}: "amp" (apex) is not supported; use "bf16" or "fp16"')
    if states["bf16"] is True and states["fp16"] is True:
        raise ConfigError(f'{path}: both "bf16.enabled" and "fp16.enabled" are true; enable one (bf16 recommended)')
    return states


def resolve_precision(path, ds: dict, cuda: bool | None = None,
                      launcher_precision: str | None = None) -> tuple[str, str | None]:
    """(precision, why) of a DeepSpeed JSON: "bf16", "fp16" or "fp32", and None when the JSON
    fixes it, else how its "enabled": "auto" was resolved (the banner's clause).

    "auto" (Hugging Face's Trainer fills it from --bf16/--fp16; zerotrain has no such flags):
    1. a block that is true wins, and an "auto" beside it is false;
    2. else accelerate's mixed_precision (`accelerate launch --mixed_precision` or the YAML's,
       `launcher_precision`), when it is bf16 or fp16 and the JSON allows it;
    3. else the machine's fastest precision (machine_precision) among those the JSON allows
       ("auto" or true): bf16, then fp16 on GPUs; fp32 on CPUs, and when neither is allowed.
    `cuda` and `launcher_precision` default to this machine and process (ACCELERATE_MIXED_PRECISION)."""
    states = _enabled_states(path, ds)
    autos = [n for n in HALF if states[n] == "auto"]
    fixed = next((n for n in HALF if states[n] is True), None)
    if fixed or not autos:
        return fixed or "fp32", None
    if cuda is None:
        import torch
        cuda = torch.cuda.is_available()
    if launcher_precision is None:
        launcher_precision = os.environ.get("ACCELERATE_MIXED_PRECISION")
    what = " and ".join(f"{n}.enabled" for n in autos) + ' "auto"'
    if launcher_precision in HALF:
        if launcher_precision not in autos:
            raise ConfigError(f"{path}: accelerate's mixed_precision is {launcher_precision} but "
                              f'"{launcher_precision}.enabled" is false in the JSON; set it to "auto" or true, or '
                              f"change mixed_precision (accelerate launch --mixed_precision / the YAML)")
        return launcher_precision, f"{what}: accelerate's mixed_precision {launcher_precision}"
    best, why = machine_precision(cuda)
    order = {"bf16": ["bf16", "fp16"], "fp16": ["fp16"], "fp32": []}[best]
    choice = next((n for n in order if n in autos), "fp32")
    if choice != best:
        why += f"; {best} is disabled in the JSON"
    return choice, f"{what}: {why}"


def precision_of(path, ds: dict, cuda: bool | None = None, launcher_precision: str | None = None) -> str:
    """"bf16", "fp16" or "fp32": what a DeepSpeed JSON (`ds`, read from `path`) trains in
    (its "auto" resolved as resolve_precision does)."""
    return resolve_precision(path, ds, cuda, launcher_precision)[0]


def fill_precision(ds: dict, precision: str):
    """The JSON's "enabled": "auto" replaced by what `precision` means (DeepSpeed takes booleans)."""
    for name in HALF:
        block = ds.get(name)
        if isinstance(block, dict) and is_auto(block.get("enabled")):
            block["enabled"] = name == precision


def check_fp16_device(path, precision: str, cuda: bool):
    """fp16 needs a CUDA GPU (every backend: DeepSpeed refuses it on CPU, Accelerate gives DDP no
    GradScaler there)."""
    if precision == "fp16" and not cuda:
        raise ConfigError(
            f'{path}: fp16 needs a CUDA GPU (DeepSpeed refuses it on CPU: "Type fp16 is not supported on your '
            f'device"); on this machine use bf16: set "bf16": {{"enabled": true}} and "fp16": {{"enabled": false}} '
            f"(as in ds_configs/zero2.json)")
