"""Environment that must be settled before torch is imported (no torch import here).

ZEROTRAIN_DEVICE=cpu hides every GPU from this process: CUDA_VISIBLE_DEVICES is emptied and
DeepSpeed's accelerator is CPU. For debugging on a GPU machine, and for the test suite, which
launches 2 ranks per test and must not put rank 1 on a second GPU a machine may not have. It is
re-applied inside each rank because the deepspeed launcher rewrites CUDA_VISIBLE_DEVICES for
its workers.
"""

from __future__ import annotations

import os


def apply(environ=os.environ) -> None:
    # Nothing that trades speed for memory (huge pages, allocator settings) is set here:
    # train/launch/host_settings.py decides those, off by default (issue 24).
    device = environ.get("ZEROTRAIN_DEVICE", "").strip().lower()
    if device not in ("", "auto", "cpu"):
        raise SystemExit(f'zerotrain: error: ZEROTRAIN_DEVICE="{device}" is not understood; use "cpu" (hide the '
                         f'GPUs) or leave it unset')
    if device == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""
        environ["DS_ACCELERATOR"] = "cpu"
