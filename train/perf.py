"""Hardware-utilisation arithmetic: peak FLOP/s of known GPUs and model FLOPs utilisation."""

from __future__ import annotations

from typing import Optional

import torch

# Dense bf16/fp16 tensor-core peak per device (no sparsity), from the vendors' datasheets.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "GH200": 989e12, "H800": 989e12,
    "A100": 312e12, "A800": 312e12, "A10G": 125e12, "A10": 125e12, "L40S": 362e12, "L4": 121e12,
    "V100": 125e12, "RTX 4090": 165e12, "RTX 3090": 71e12, "B200": 2250e12,
}


def device_peak_flops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # "H100" before "H10"-like prefixes
        if key in name:
            return PEAK_FLOPS[key]
    return None


def mfu(model_flops_per_s: float, num_devices: int, peak_override: Optional[float] = None) -> Optional[float]:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    peak = peak_override or device_peak_flops()
    if not peak:
        return None
    return model_flops_per_s / (peak * num_devices)
