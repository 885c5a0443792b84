"""Environment that must be settled before torch is imported (no torch import here).

ZEROTRAIN_DEVICE=cpu hides every GPU from this process: CUDA_VISIBLE_DEVICES is emptied and
DeepSpeed's accelerator is CPU. For debugging on a GPU machine, and for the test suite, which
launches 2 ranks per test and must not put rank 1 on a second GPU a machine may not have. It is
re-applied inside each rank because the deepspeed launcher rewrites CUDA_VISIBLE_DEVICES for
its workers.

OMP_NUM_THREADS, where the user set none, becomes this rank's share of the node's cores (cpu_threads).
"""

from __future__ import annotations

import os
import sys

from zerotrain.train.launch.device_memory import local_ranks

#: Where this process's torch threads came from (config.json's hardware.cpu_threads_from):
#: "OMP_NUM_THREADS" (the user's or the launcher's), or the share apply() set in os.environ.
THREADS_FROM = "OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS", "").strip() else "torch's default"


def apply(environ=os.environ) -> None:
    # Nothing that trades speed for memory (huge pages, allocator settings) is set here:
    # train/launch/host_settings.py decides those, off by default.
    device = environ.get("ZEROTRAIN_DEVICE", "").strip().lower()
    if device not in ("", "auto", "cpu"):
        raise SystemExit(f'zerotrain: error: ZEROTRAIN_DEVICE="{device}" is not understood; use "cpu" (hide the '
                         f'GPUs) or leave it unset')
    if device == "cpu":
        environ["CUDA_VISIBLE_DEVICES"] = ""
        environ["DS_ACCELERATOR"] = "cpu"
    threads = cpu_threads(environ, cores())
    if threads is None:
        return
    if environ is os.environ:
        global THREADS_FROM
        if "torch" in sys.modules:  # too late: OpenMP read the environment when torch loaded
            THREADS_FROM = "torch's default (torch was imported before zerotrain started)"
            return
        THREADS_FROM = threads[1]
    environ["OMP_NUM_THREADS"] = str(threads[0])


def cpu_threads(environ, cores: int) -> tuple[int, str] | None:
    """torch's intra-op threads for this rank where OMP_NUM_THREADS is unset: the node's cores
    divided by its ranks (device_memory.local_ranks), so that ranks computing at the same time do
    not oversubscribe them. torchrun sets 1 per rank when it starts several, Accelerate's launcher
    cores / processes; the deepspeed launcher sets nothing, and torch's default (every core in
    every rank) oversubscribes them (measured: BENCHMARKS.md "Trainer against the best plain
    loop"). On a GPU node
    the same share keeps the ranks' host threads (data, ZeRO-Offload's CPU Adam) from oversubscribing.

    It goes into the environment before torch is imported: one setting that every library and
    process reading OMP_NUM_THREADS sees (torch's OpenMP pool, Accelerate's multi-CPU start-up,
    which otherwise sets a count of its own, DeepSpeed's CPU Adam, data workers), and nothing sets
    it again later. None: the environment already says."""
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None
    ranks = local_ranks(environ)
    return max(1, cores // ranks), f"{cores} core(s) / {ranks} rank(s) on this node"


def cores() -> int:
    """The cores this process may run on (a cgroup cpuset or taskset narrows os.cpu_count())."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
