"""The run's memory plan (MemoryPlan): made once, before the model exists
(train/training/assembly.py choose_strategy), and shared by everything that speaks of planned
memory: the memory check compares it with the budget (train/plan/memory_check.py), the host
settings size malloc from it (train/launch/host_settings.py), config.json keeps it
(resolved.memory_plan), the start-up banner prints its "model states" and "memory" lines
(train/observe/report.py), and train/observe/memory.py logs it as plan/* next to the measured
mem/*.

It is sized once, from the model built on the meta device (memory_check.model_shape): the tensors,
in the optimizer's groups, of the model the run then builds (a ZeRO-3 parameter counts by its
ds_numel, the whole tensor; LoRA's adapters and frozen base as models/lora.py makes them;
tests/test_plan.py compares the two). One shape, one option (the run's resolved DeepSpeed JSON),
one micro-batch and one device answer two questions, hence two estimates in one object:

* `checked`: the largest over all ranks, what the memory check compares with the budget every
  rank agreed on (the tightest rank's): a plan fits only when every rank fits.
* `estimate`: this rank's, what the banner prints (rank 0's) and what this rank's measured model
  states are logged next to (plan/*). The two differ only under ZeRO-1/2, where a rank also holds
  the whole gradient of each tensor that straddles its partition (train/strategy/cost.py).

checkpoint.async keeps a host snapshot of each rank's share of the checkpoint (estimate.py
`snapshot_bytes`). On a CPU that is device memory: both estimates count it, and when the plan with
it would not leave distributed.memory_margin of the budget free the run saves synchronously
instead (`async_off`: one banner line; the Checkpointer reads it), and is checked without it. On
CUDA the snapshot is pinned host RAM, outside the GPU budget: it is compared with the tightest
rank's free host RAM (Budget.host_free) instead, with the same fallback when it does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from zerotrain.train.errors import UserError
from zerotrain.train.observe.report import human_bytes
from zerotrain.train.plan import memory_check
from zerotrain.train.plan.estimate import Device, Estimate, estimate, snapshot_bytes
from zerotrain.train.strategy.option import Option

if TYPE_CHECKING:
    from zerotrain.train.launch.device_memory import Budget


@dataclass(frozen=True)
class MemoryPlan:
    """The run's one memory plan (this module's docstring says who reads what)."""

    budget: Optional[Budget]       # the budget every rank agreed on; None: distributed.memory_check false
    checked: Optional[Estimate]    # the largest rank's plan the check compared with the budget; None: not checked
    estimate: Optional[Estimate]   # this rank's plan; None when the planner cannot size the model
    text: str                      # the banner's text for `estimate`, or why there is none
    async_off: str = ""            # checkpoint.async asked for, but its snapshot would not fit: why (the banner's line)


def make(cfg, spec, ds, data, batch, seq_len, world: int, rank: int, device_kind: str, is_main: bool,
         view: dict | None = None, choice: memory_check.AutoChoice | None = None) -> MemoryPlan:
    """The run's memory plan for rank `rank` of `world` on a `device_kind` ("cuda" | "cpu") device,
    and the memory check against it (distributed.memory_check). `view`: this rank's
    memory_check.measure(), taken before the Accelerator (the budget --ds-config auto chose
    with, `choice.budget`, when it ran). Raises DoesNotFit; prints the warning of a tight fit. A
    model the planner cannot size trains unchecked, with a note, and the banner says why it has
    no estimate. Collective when the check is on."""
    on = cfg.distributed.memory_check
    budget = (choice.budget if choice is not None else memory_check.agreed_budget(view)) if on else None
    device = Device(budget.device, budget.runtime) if budget is not None else Device(device_kind, 0)
    try:
        shape = choice.shape if choice is not None else memory_check.model_shape(spec, data)
        option, pb = Option.from_setup(ds), memory_check.plan_batch(cfg, batch, seq_len)
        snap = snapshot_bytes(shape, world, frozen_saved=getattr(cfg.model, "lora", None) is None) \
            if cfg.checkpoint.async_ else 0
        async_off = ""
        if snap and on and device.kind == "cpu":
            largest = estimate(shape, option, world, pb, device=device, snapshot=snap)
            if not memory_check.fits(largest, budget, cfg.distributed.memory_margin):
                snap, async_off = 0, (
                    f"checkpoint.async off: its host snapshot ({human_bytes(largest.snapshot)} per rank) would "
                    f"take the predicted peak to {memory_check.with_margin(largest, budget, cfg.distributed.memory_margin)}"
                    f" ({budget.source}); saves are synchronous")
        elif snap and on and budget.host_free is not None:
            snap, async_off = _pinned_snapshot(snap, budget, cfg.distributed.memory_margin)
        mine = estimate(shape, option, world, pb, rank, device, snapshot=snap)
    except Exception as e:  # noqa: BLE001 - the plan is advisory for models the planner does not know
        if on and isinstance(e, UserError):
            raise
        _note(on and is_main, e)
        return MemoryPlan(budget, None, None, f"estimate unavailable ({type(e).__name__}: {e})")
    checked = None
    if on:
        try:
            checked, warning = memory_check.require_fit(cfg, spec, ds, data, batch, seq_len, world, budget, shape,
                                                        snapshot=snap)
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001
            _note(is_main, e)
        else:
            if warning and is_main:
                print(f"zerotrain: {warning}", flush=True)
    return MemoryPlan(budget, checked, mine, banner_text(mine), async_off)


def _pinned_snapshot(snap: int, budget, margin: float) -> tuple[int, str]:
    """A GPU rank's checkpoint.async snapshot is pinned host RAM, outside the GPU budget: it is
    compared with the tightest rank's free host RAM (agreed, so every rank decides alike), less
    the margin. (snapshot bytes, "") when it fits, else (0, the banner's line)."""
    room = int(budget.host_free * (1 - margin))
    if snap <= room:
        return snap, ""
    return 0, (f"checkpoint.async off: its pinned host snapshot ({human_bytes(snap)} per rank) does not fit "
               f"the free host RAM ({human_bytes(budget.host_free)}, {budget.host_source}) less the "
               f"{margin:.0%} margin; saves are synchronous")


def _note(say: bool, e: Exception) -> None:
    if say:
        print(f"zerotrain: note: memory check skipped, the planner cannot size this model ({e})", flush=True)


def banner_text(e: Estimate) -> str:
    """What report.banner prints as "model states <text> per rank (estimated)"."""
    return (f"{human_bytes(e.model_states)} (params {human_bytes(e.params)}, grads {human_bytes(e.grads)}, "
            f"optimizer {human_bytes(e.optimizer)})"
            + (f" + activations {human_bytes(e.activations)}" if e.activations is not None else "")
            + f" + buffers {human_bytes(e.buffers)}" + (f", host {human_bytes(e.host)}" if e.host else "")
            + (f", checkpoint.async snapshot {human_bytes(e.snapshot)}" + (" (host RAM)" if e.device_kind != "cpu" else "")
               if e.snapshot else "")
            + f"; peak {human_bytes(e.device_total)}" + (" incl. the runtime" if e.runtime else ""))
