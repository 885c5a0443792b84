"""Build DeepSpeed's JIT ops once, before any multi-process launch: `python -m zerotrain.train.commands.prebuild`.

Ranks that find an op missing all try to compile it at once (minutes on a small CPU box).
Built here, into TORCH_EXTENSIONS_DIR (the project's .cache/torch_extensions by default),
every rank, launcher and node sharing the checkout just loads the .so. (torch >= 2.14
locks builds with flock, so a killed build no longer leaves a lock that blocks later ones.)
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from zerotrain.train import paths



def main() -> int:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(paths.EXTENSIONS_CACHE))
    ext_dir = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    ext_dir.mkdir(parents=True, exist_ok=True)
    from zerotrain.train.launch.distributed import venv_tools_first
    venv_tools_first(os.environ)  # the same ninja as the ranks use, or each rebuilds the other's op
    import torch
    from deepspeed.ops.op_builder import CPUAdamBuilder
    ops = [("cpu_adam", CPUAdamBuilder)]  # optimizer offload, on CPU and GPU machines alike
    if not torch.cuda.is_available():
        from deepspeed.accelerator import get_accelerator
        ops.insert(0, ("deepspeed_shm_comm", lambda: get_accelerator().create_op_builder("ShareMemCommBuilder")))
    for name, builder in ops:
        if any((ext_dir / name).glob("*.so")):
            continue
        print(f"building DeepSpeed op {name} into {ext_dir} (once; ~1-3 min on 2 cores)...", flush=True)
        t0 = time.time()
        builder().load()
        print(f"  built {name} in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
