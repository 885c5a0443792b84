"""Run train/main.py with DeepSpeed's fp16 allowed on this CPU (test harness, never shipped use).

fp16 is a GPU feature: DeepSpeed refuses it on its CPU accelerator and zerotrain refuses it
without CUDA. The code that reads and checkpoints the loss scale is the same on both, and
torch computes fp16 on CPU (slowly), so lifting the two refusals lets CPU CI run DeepSpeed's
real fp16 optimizers (FP16_UnfusedOptimizer at ZeRO-0, DeepSpeedZeroOptimizer at ZeRO-1/2)
through the real trainer:

    python tests/fp16_on_cpu.py --ds-config X.json ...      (the same arguments as train/main.py)
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import deepspeed.accelerator.cpu_accelerator as cpu_accelerator  # noqa: E402

import zerotrain.train.strategy.ds_config as ds_config  # noqa: E402

cpu_accelerator.CPU_Accelerator.is_fp16_supported = lambda self: True
_load_ds_setup = train.strategy.ds_config.load_ds_setup


def _load_ds_setup_as_on_cuda(*args, **kwargs):
    kwargs["cuda"] = True  # only the fp16-needs-CUDA refusal reads it
    return _load_ds_setup(*args, **kwargs)


train.strategy.ds_config.load_ds_setup = _load_ds_setup_as_on_cuda

if __name__ == "__main__":
    sys.argv[0] = str(REPO / "train" / "main.py")
    from zerotrain.train.main import run_as_script
    run_as_script()
