"""What the planner tells the running trainer about its own rank: the start-up banner's
"model states" line and the plan the measured mem/* metrics are logged next to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from train.plan.estimate import CUDA, Device, Estimate, estimate
from train.plan.shapes import BatchShape, module_shape
from train.strategy.option import Option

if TYPE_CHECKING:
    from train.launch.device_memory import Budget


def banner_estimate(model, cfg, ds, batch, world: int, gpt=None, seq_len: Optional[int] = None,
                    rank: Optional[int] = None, device: Device = CUDA,
                    width: Optional[int] = None) -> tuple[str, Estimate]:
    """One line for the start-up banner (and the numbers) for the strategy in use."""
    from train.observe.report import human_bytes
    shape = module_shape(model, cfg.model.name, gpt, width)
    e = estimate(shape, Option.from_setup(ds), world,
                 BatchShape(batch.micro, seq_len, batch.accum, cfg.model.activation_checkpointing,
                            sequence_parallel=cfg.distributed.sequence_parallel,
                            document_mask=cfg.data.packing or cfg.data.document_mask), rank, device)
    # report.banner prints "model states <text> per rank (estimated)".
    text = (f"{human_bytes(e.model_states)} (params {human_bytes(e.params)}, grads {human_bytes(e.grads)}, "
            f"optimizer {human_bytes(e.optimizer)})"
            + (f" + activations {human_bytes(e.activations)}" if e.activations is not None else "")
            + f" + buffers {human_bytes(e.buffers)}" + (f", host {human_bytes(e.host)}" if e.host else "")
            + f"; peak {human_bytes(e.device_total)}" + (" incl. the runtime" if e.runtime else ""))
    return text, e


@dataclass(frozen=True)
class RankPlan:
    """What the planner tells the running trainer about this rank (train/training/build.py makes
    it once): the banner's "model states" and "memory" lines, and the plan the measured mem/*
    metrics are logged next to (train/observe/memory.py)."""

    budget: Optional[Budget]      # the memory check's agreed budget (memory_check.py); None: the check was off
    estimate: Optional[Estimate]  # this rank's plan; None when the planner cannot size the model
    text: str                     # the banner's text for the estimate, or why there is none


def rank_plan(model, cfg, ds, batch, topo, workload, seq_len: Optional[int],
              budget: Optional[Budget]) -> RankPlan:
    """This rank's plan for the running model (`model` unwrapped from its engine). A planner that
    cannot size this model says so in the banner rather than stopping the run."""
    from models.gpt import GPTConfig
    wc = workload.model_config
    gpt = GPTConfig.from_dict({k: v for k, v in wc.items() if k != "family"}) if wc.get("family") == "gpt" else None
    device = Device(budget.device, budget.runtime) if budget is not None else \
        Device("cuda" if topo.device == "cuda" else "cpu", 0)
    try:
        text, est = banner_estimate(model, cfg, ds, batch, topo.world_size, gpt, seq_len, rank=topo.rank,
                                    device=device, width=workload.hidden_size)
    except Exception as e:  # noqa: BLE001 - the estimate is advisory; the run goes on
        return RankPlan(budget, None, f"estimate unavailable ({type(e).__name__}: {e})")
    return RankPlan(budget, est, text)
