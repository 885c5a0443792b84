"""train.early_stop: stop the run when an evaluated metric has not improved for `patience`
evaluations in a row. The metric is read from the evaluation's row (every rank has the same
gathered values), so every rank decides alike at the same step: the run stops there, saves,
exports and exits 0. The best value and the count of evaluations without improvement are saved
in checkpoints and come back on resume."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

from zerotrain.train.errors import ConfigError
from zerotrain.train.training.tick import StopReason

if TYPE_CHECKING:
    from zerotrain.train.checkpoint.state import TrainState
    from zerotrain.train.config.schema import EarlyStopConfig
    from zerotrain.train.training.tick import Tick


class EarlyStop:
    name = "early_stop"

    def __init__(self, cfg: EarlyStopConfig):
        self.cfg = cfg
        self.best: Optional[float] = None
        self.best_step: Optional[int] = None
        self.bad = 0          # evaluations in a row without an improvement

    def _better(self, value: float) -> bool:
        if self.best is None:
            return math.isfinite(value)
        d = self.cfg.min_delta
        return value < self.best - d if self.cfg.mode == "min" else value > self.best + d

    def on_step(self, tick: Tick) -> None:
        group = self.cfg.metric.split("/", 1)[0] + "/"
        evaluated = {k: v for k, v in tick.metrics.items() if k.startswith(group)}
        if not evaluated:
            return  # no evaluation at this step
        if self.cfg.metric not in evaluated:
            raise ConfigError(f'train.early_stop.metric "{self.cfg.metric}" is not logged by this run\'s evaluation; '
                              f"it logs {', '.join(sorted(evaluated))}")
        value = float(evaluated[self.cfg.metric])
        if self._better(value):
            self.best, self.best_step, self.bad = value, tick.step, 0
        else:
            self.bad += 1
        tick.add_metrics({"early_stop/best": self.best if self.best is not None else float("nan"),
                          "early_stop/bad_evals": self.bad})
        if self.bad >= self.cfg.patience and not tick.done:  # (at max_steps the run ends anyway)
            tick.stop(StopReason(self.name, self._why(tick.step), final=True))

    def _why(self, step: int) -> str:
        c = self.cfg
        return (f"early stop at step {step}: {c.metric} did not improve by more than {c.min_delta:g} for "
                f"{self.bad} evaluations (best {self.best:.4f} at step {self.best_step})")

    def banner(self) -> list[str]:
        c = self.cfg
        where = f"; best so far {self.best:.4f} at step {self.best_step}, {self.bad} evaluation(s) without improvement" \
            if self.best is not None else ""
        return [f"early stop   on {c.metric} ({c.mode}), patience {c.patience}, min_delta {c.min_delta:g}{where}"]

    def state_dict(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load_state_dict(self, state: dict, at: TrainState) -> None:
        self.best, self.best_step, self.bad = state.get("best"), state.get("best_step"), state.get("bad", 0)


def build(services) -> Optional[EarlyStop]:
    cfg = services.cfg.train.early_stop
    return EarlyStop(cfg) if cfg is not None else None
