"""Whether training is still sound: non-finite gradient norms (skipped steps, train.nan_policy,
train.max_bad_steps) and, under fp16, a loss scale that collapsed to its floor.

Per step, record() keeps the step's gradient norm and fp16 loss scale as the engine has them
(device values are not read). read_interval() reads them all in one transfer; the trainer calls it at
logging intervals and before checkpoints, so a stop comes at most logging.every_steps steps
after its cause. A skipped step never touched the weights, so the checkpoint written on stop is
the last good state. The decision uses the global gradient norm, identical on every rank, so
all ranks stop together.

The fp16 bookkeeping that differs between backends is the Strategy's (train/strategy/): where
the loss scale lives, its floor, and whether the engine counts its own skipped steps (DeepSpeed)
or they are counted here (DDP's GradScaler).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from zerotrain.train.config import TrainConfig
    from zerotrain.train.strategy import Strategy


class Health:
    def __init__(self, *, train: TrainConfig, strategy: Strategy, is_main: bool, skipped: int = 0):
        """`train`: the run config's train section; `strategy`: the backend, bound to its engine
        (it holds the fp16 loss scale); `is_main`: rank 0 prints the warnings; `skipped`: the
        run's skipped steps so far (a resumed TrainState's)."""
        self.train, self.strategy, self.is_main = train, strategy, is_main
        self.fp16 = strategy.precision == "fp16"
        # The scale at which an overflowing fp16 step can no longer lower it.
        self.scale_floor = strategy.loss_scale_floor
        self.pending: list = []        # (step, grad norm, fp16 scale) recorded, not yet read
        self.bad_run = 0               # consecutive non-finite steps
        self.last_grad_norm: Optional[float] = None  # read at the last check
        self.diverged_reason = ""      # why read_interval() stopped the run
        self.skipped = skipped         # the run's skipped steps (TrainState.skipped_steps)

    def record(self, step: int, grad_norm) -> None:
        """Once per optimizer step, without a host read."""
        self.pending.append((step, grad_norm, self.loss_scale()))

    def loss_scale(self):
        """The fp16 loss scale now, without a host read (a float, or a device tensor under DDP);
        None without fp16."""
        return self.strategy.loss_scale() if self.fp16 else None

    def read_interval(self) -> bool:
        """Reads the recorded steps (counting the skipped ones); True when the run must stop:
        nan_policy / max_bad_steps / fp16 loss-scale collapse (diverged_reason says why)."""
        entries, self.pending = self.pending, []
        if not entries:
            return False
        norms, scales = read_numbers([e[1] for e in entries]), read_numbers([e[2] for e in entries])
        if norms[-1] is not None:
            self.last_grad_norm = norms[-1]
        for (step, _, _), norm, scale in zip(entries, norms, scales):
            if self._step(step, norm, scale):
                return True
        return False

    def _step(self, step: int, norm, scale) -> bool:
        bad = norm is not None and not math.isfinite(norm)
        t = self.train
        if self.fp16:
            if bad and not self.strategy.counts_skipped_steps():
                self.skipped += 1  # the GradScaler skipped it (DeepSpeed counts its own)
            self.bad_run = self.bad_run + 1 if (bad and scale is not None and scale <= self.scale_floor) else 0
            if self.bad_run >= t.max_bad_steps:
                self.diverged_reason = (f"fp16 loss scale collapsed to {scale:g} with {self.bad_run} consecutive "
                                        f"overflowing steps at step {step}; the model's values exceed "
                                        f"fp16's range: use bf16 (set \"bf16\": {{\"enabled\": true}} in "
                                        f"{self.strategy.path}) or lower optim.lr")
                return True
            return False
        if not bad:
            self.bad_run = 0
            return False
        self.bad_run += 1
        self.skipped += 1
        if self.is_main:
            print(f"zerotrain: warning: step {step}: non-finite gradient norm ({norm}); step skipped, "
                  f"weights unchanged ({self.bad_run} in a row, {self.skipped} in total)", flush=True)
        if t.nan_policy == "stop" or self.bad_run >= t.max_bad_steps:
            why = "train.nan_policy is \"stop\"" if t.nan_policy == "stop" else \
                f"{self.bad_run} consecutive non-finite steps (train.max_bad_steps = {t.max_bad_steps})"
            self.diverged_reason = (f"training diverged at step {step}: {why}; the checkpoint holds "
                                    f"the last good weights; lower optim.lr, check the data, or raise train.grad_clip")
            return True
        return False

    def log_fields(self) -> dict:
        """The log line's grad_norm, loss_scale and skipped_steps (a host read: log intervals only);
        the run's count becomes the engine's own where it keeps one."""
        m = {}
        if self.last_grad_norm is not None:
            m["grad_norm"] = self.last_grad_norm  # pre-clip, at the last step of the interval
        if self.fp16:
            scale = read_numbers([self.loss_scale()])[0]
            if scale is not None:
                m["loss_scale"] = scale
            if self.strategy.counts_skipped_steps():
                self.skipped = self.strategy.engine_skipped_steps()
        m["skipped_steps"] = self.skipped
        return m


def read_numbers(values: list) -> list:
    """Python floats (None kept) for a list of device tensors / numbers, in one device-to-host copy."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if tensors:
        device = tensors[0].device
        host = iter(torch.stack([t.detach().to(device, torch.float64).reshape(()) for t in tensors]).tolist())
    return [None if v is None else next(host) if isinstance(v, torch.Tensor) else float(v) for v in values]
