"""Host memory settings that trade step time for memory: which ones a run gets, and why.

zerotrain turns none on by default: on a CPU both cost step time (measured: BENCHMARKS.md "Host
allocator on CPU"):

* transparent huge pages (PyTorch's THP_MEM_ALLOC_ENABLE, read once when torch loads): never
  set by zerotrain; a value in the environment is the user's and is recorded as such.
* compact malloc (hardware.host_malloc, train/launch/device_memory.compact_host_malloc: freed
  blocks of 1 MiB or more go back to the OS at once). "auto" turns it on only where the run would
  not fit without it: the memory check's plan (which predicts memory that follows live tensors)
  times what glibc's default keeps of freed blocks (the strategy's measured glibc growth,
  Strategy.malloc_figures) leaves less than
  distributed.memory_margin of the budget free, while the plan itself fits. "compact" / "glibc"
  force either. Never on a GPU (the device's memory is not malloc's).

The decision is one line in the banner when compact is on (with its measured cost), and
config.json's resolved.host_settings always.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass
class HostSettings:
    malloc: str               # "compact" | "glibc"
    why: str                  # what decided it (a clause for the banner and config.json)
    huge_pages: str | None    # THP_MEM_ALLOC_ENABLE as the environment set it (None: unset = off)
    cost: float | None = None  # compact's measured step-time cost for this strategy, when on

    def record(self) -> dict:
        return {"malloc": self.malloc, "why": self.why, "huge_pages_env": self.huge_pages,
                "compact_step_cost": self.cost, "banner": self.banner_line()}

    def banner_line(self) -> str | None:
        """One line when a setting that costs step time is on; None otherwise."""
        if self.malloc != "compact":
            return None
        cost = f"; measured cost about +{self.cost:.0%} step time on CPU (BENCHMARKS.md)" if self.cost else ""
        return f"host: compact malloc on ({self.why}){cost}"


def decide(cfg, strategy, cuda: bool, planned=None, budget=None) -> HostSettings:
    """The run's host settings. `planned`/`budget`: the memory check's Estimate and Budget
    (None when the check is off: then auto keeps glibc's default)."""
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE")
    choice = cfg.hardware.host_malloc
    if cuda:
        return HostSettings("glibc", "a GPU run: the device memory is not malloc's", thp)
    if choice != "auto":
        return _settings(choice, f"hardware.host_malloc {choice}", strategy, thp)
    if planned is None or budget is None:
        return HostSettings("glibc", "hardware.host_malloc auto without a memory check", thp)
    growth = strategy.malloc_figures[0]
    grown = planned.device_total * growth
    room = (1 - cfg.distributed.memory_margin) * budget.bytes
    if grown <= room:
        return HostSettings("glibc", "hardware.host_malloc auto: the run fits without compact malloc", thp)
    from zerotrain.train.observe.report import human_bytes as hb
    why = (f"the memory check: the plan {hb(planned.device_total)} x glibc's growth {growth:g} = {hb(grown)} "
           f"would leave less than the {cfg.distributed.memory_margin:.0%} margin of {hb(budget.bytes)}")
    return _settings("compact", why, strategy, thp)


def _settings(malloc: str, why: str, strategy, thp) -> HostSettings:
    return HostSettings(malloc, why, thp, strategy.malloc_figures[1] if malloc == "compact" else None)


def apply(settings: HostSettings) -> HostSettings:
    """Make the allocator choice real in this process (compact: mallopt; glibc: nothing)."""
    if settings.malloc == "compact":
        from zerotrain.train.launch.device_memory import compact_host_malloc
        if not compact_host_malloc():
            settings.why += " (not applied: MALLOC_MMAP_THRESHOLD_/GLIBC_TUNABLES set it, or not glibc)"
    return settings
