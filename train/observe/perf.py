"""Hardware-utilisation arithmetic: throughput, peak FLOP/s of known accelerators, and
model FLOPs utilisation (MFU).

MFU = achieved *model* FLOP/s / (peak FLOP/s per device x devices). Model FLOPs are the
useful training FLOPs per token the model reports (GPT: 6N + 12·L·D·T, models/gpt.py);
activation-checkpointing recompute is not counted, so MFU does not reward it. The peak is
dense bf16/fp16 tensor-core throughput (no sparsity), the usual reference even for fp32 runs.
"""

from __future__ import annotations

from typing import Optional

import torch

# Dense bf16/fp16 tensor-core peak per device (no 2:4 sparsity), from the vendors' datasheets.
# Matched as substrings of torch.cuda.get_device_name(), longest key first. A device with
# no trustworthy published figure (e.g. AWS's A10G, a clock variant of the A10) maps to None:
# no MFU unless --peak-flops gives one.
PEAK_FLOPS = {
    "H200": 989e12, "H100": 989e12, "H100 PCIe": 756e12, "H100 NVL": 835e12, "GH200": 989e12, "H800": 989e12,
    "H20": 148e12, "A10G": None, "B200": 2250e12, "B100": 1750e12, "GB200": 2500e12,
    "A100": 312e12, "A800": 312e12, "A10": 125e12, "A30": 165e12,
    "L40S": 362e12, "L40": 181e12, "L4": 121e12, "V100": 125e12, "RTX 4090": 165e12,
    "MI300X": 1307e12, "MI250X": 383e12, "MI250": 362e12,
}


def lookup_peak_flops(device_name: str) -> Optional[float]:
    for key in sorted(PEAK_FLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100", "L40S" before "L4"
        if key in device_name:
            return PEAK_FLOPS[key]
    return None


def device_peak_flops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    return lookup_peak_flops(torch.cuda.get_device_name())


def mfu(model_flops_per_s: float, num_devices: int, peak_per_device: Optional[float]) -> Optional[float]:
    """Achieved model FLOP/s over the devices' combined peak; None when the peak is unknown."""
    if not peak_per_device:
        return None
    return model_flops_per_s / (peak_per_device * num_devices)


def throughput(*, samples: int, seconds: float, items_per_sample: int, flops_per_item: Optional[float],
               world_size: int, peak_per_device: Optional[float], real_items: Optional[int] = None,
               built_items: Optional[int] = None) -> dict:
    """Global rates over a window: `samples` trained by all ranks together in `seconds` of
    training wall time. tokens_per_s only for LMs (items_per_sample = tokens per sample > 1):
    the tokens that ran through the model, padding excluded, so that two runs of the same data
    in another layout (padded to seq_len, per batch, packed) compare by it.
    `real_items`: the window's non-pad tokens, where the data counts them (instruction and
    preference data); `built_items`: the token positions the forwards ran on, summed over the
    ranks (the batches as built: padded to seq_len or to each batch's longest record, pairs
    packed or not). With both, data/pad_fraction = 1 - real / built. Without `real_items` every
    position is a real token (built_items, else samples x items_per_sample). real_tokens_per_s
    is tokens_per_s under its earlier name. mfu only when the model reports its FLOPs and the
    peak is known (GPU table or --peak-flops), counting real tokens only (padding is not useful
    work)."""
    out = {"samples_per_s": samples / seconds}
    built = built_items if built_items else samples * items_per_sample
    real = real_items if real_items is not None else built
    items_per_s = real / seconds if items_per_sample > 1 else samples / seconds
    if items_per_sample > 1:
        out["tokens_per_s"] = items_per_s
    if real_items is not None:
        out["real_tokens_per_s"] = real_items / seconds
        out["data/pad_fraction"] = 1.0 - real_items / max(1, built)
    if flops_per_item:
        util = mfu(flops_per_item * items_per_s, world_size, peak_per_device)
        if util is not None:
            out["mfu"] = util
    return out
