"""Measured model-state memory: the bytes of parameter, gradient and optimizer-state tensors
this rank really holds under the running engine (DDP, ZeRO-0/1/2/3, offload).

Counting rule: every tensor we can reach is reduced to its storage, and each storage counts
once, under the first category that claims it (params, then grads, then optimizer, then
buffers). Views therefore never double count: ZeRO-1/2 parameters are views into one flat
buffer, DDP gradients are views into its buckets, ZeRO-3 ``ds_tensor``s are views into
the flat partition. A partitioned ZeRO-3 parameter that happens to be gathered whole at the
moment (DeepSpeed prefetches the first modules' parameters at the start of each forward) counts
as "gathered", outside the model states: the planner counts it in the backward's working set.

The snapshot is taken right before the optimizer step of the second step: gradients are
fully reduced into whatever DeepSpeed keeps them in, the lazily created Adam moments exist
(made by step 1), and the step's own transient fp32 gradient copy is not yet made. That is
the moment the ZeRO paper's model-state accounting describes, and what the planner's cost model
(train/strategy/cost.py) estimates.

The counting (Counter, ModelStateBytes) is here; what to count, read from the engine, is the
strategy's (train/strategy/state_bytes.py `measure`, through Strategy.measure_model_states):
nothing here knows a backend.

"Host" bytes are those of offloaded structures (optimizer / parameter offload). On a GPU
machine that is also any tensor found on the CPU; on a CPU-only machine everything is on
the CPU, so the engine's own offload flags decide.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

CATEGORIES = ("params", "grads", "optimizer", "buffers", "gathered")


@dataclass
class ModelStateBytes:
    device: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))  # category -> bytes
    host: dict = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))    # offloaded bytes
    detail: dict = field(default_factory=dict)   # "category/where/source" -> bytes (debugging)
    optimizer_state_ready: bool = True           # False if measured before Adam created its moments

    @property
    def model_states(self) -> int:
        """params + grads + optimizer on the device (the planner's model-state column)."""
        return self.device["params"] + self.device["grads"] + self.device["optimizer"]

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    def metrics(self, prefix: str = "mem/") -> dict:
        m = {f"{prefix}{k}_bytes": v for k, v in self.device.items()}
        m[f"{prefix}model_states_bytes"] = self.model_states
        m[f"{prefix}host_bytes"] = self.host_total
        return m

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_states"] = self.model_states
        return d


class Counter:
    def __init__(self, accelerator_is_cpu: bool):
        self.seen: set = set()
        self.out = ModelStateBytes()
        self.cpu_only = accelerator_is_cpu

    def add(self, category: str, source: str, obj, offloaded: bool = False):
        for t in _tensors(obj):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            nbytes = storage.nbytes()
            key = (t.device.type, t.device.index, storage.data_ptr())
            if nbytes == 0 or key in self.seen:
                continue
            self.seen.add(key)
            where = "host" if offloaded or (t.device.type == "cpu" and not self.cpu_only) else "device"
            getattr(self.out, where)[category] += nbytes
            k = f"{category}/{where}/{source}"
            self.out.detail[k] = self.out.detail.get(k, 0) + nbytes


def _tensors(obj, depth: int = 0):
    """Tensors inside obj (a tensor, or lists/tuples/dicts of them), with their .grad."""
    if obj is None or depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    if isinstance(obj, dict):
        obj = obj.values()
    if isinstance(obj, (list, tuple, type({}.values()))):
        for v in obj:
            yield from _tensors(v, depth + 1)
    elif hasattr(obj, "buffer"):  # DeepSpeed's IPGBucket (a list of buffers) / IPGBucketZ3 (one)
        yield from _tensors(obj.buffer, depth + 1)


def grads_of(tensors):
    return [t.grad for t in _tensors(tensors) if t.grad is not None]


def unwrap(model):
    return getattr(model, "module", model)


class StepProbe:
    """Measures the model states of one optimizer step at its high-water marks and keeps the
    largest: before every micro-batch's forward (gradients of the previous micro-batches are
    held: the full gradients under DDP no_sync and ZeRO-1, a partition under ZeRO-2/3) and
    right before the optimizer step (everything reduced, Adam moments present). Arm it at
    the start of a step after the first, so that the moments exist; it disarms itself."""

    def __init__(self, model, raw_optimizer, step_target, measure: Callable):
        """`step_target`: the optimizer object whose step() ends the step (the strategy's
        Strategy.step_target: DeepSpeed's ZeRO optimizer, or the torch optimizer); `measure`:
        (model, raw_optimizer) -> ModelStateBytes, the strategy's (Strategy.measure_model_states:
        it knows where its engine keeps what)."""
        self.model, self.raw_optimizer, self.step_target = model, raw_optimizer, step_target
        self.measure = measure
        self.result: ModelStateBytes | None = None
        self._handles = []

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    def _take(self):
        snap = self.measure(self.model, self.raw_optimizer)
        if self.result is None or snap.model_states > self.result.model_states:
            self.result = snap

    def arm(self):
        module = unwrap(self.model)
        self._handles.append(module.register_forward_pre_hook(lambda mod, args: self._take()))
        target = self.step_target
        if isinstance(target, torch.optim.Optimizer):
            def pre_hook(opt, args, kwargs):
                self._take()
                self.disarm()
            self._handles.append(target.register_step_pre_hook(pre_hook))
        else:  # a DeepSpeed ZeRO / fp16 optimizer: not a torch Optimizer, no step hooks
            original = target.step

            def step(*args, **kwargs):
                self._take()
                self.disarm()
                return original(*args, **kwargs)

            target.step = step
            self._handles.append(_Restore(target))

    def disarm(self):
        for h in self._handles:
            h.remove()
        self._handles = []


class _Restore:
    """Removes the instance-level `step` wrapper, exposing the class's method again."""

    def __init__(self, target):
        self.target = target

    def remove(self):
        self.target.__dict__.pop("step", None)


class MemoryReport:
    """The trainer's side: measure one step (the first whose Adam moments already exist),
    gather every rank's bytes, log them as mem/* next to the planner's plan/* and print one
    line. One small all-gather, once per run."""

    FIELDS = ("params", "grads", "optimizer", "buffers", "gathered", "model_states", "host", "plan_model_states",
              "plan_host")

    def __init__(self, *, acc, model, raw_optimizer, step_target, measure, start_step: int, max_steps: int,
                 plan, log: Callable[[dict, int], None]):
        """`model`/`raw_optimizer`/`step_target`/`measure` as for StepProbe; `plan`: this rank's estimate in the run's one
        memory plan (train/plan/memory_plan.py MemoryPlan.estimate, made before the model existed),
        logged as plan/* next to the measurement, None when there is none; read by attribute, as the
        planner sits above this module. `log`: the metrics sink."""
        self.acc, self.plan, self.log = acc, plan, log
        # Step `start_step` from scratch creates the moments; measure the one after it if there is one.
        self.at = start_step + 1 if start_step == 0 and max_steps > 1 else start_step
        self.probe = StepProbe(model, raw_optimizer, step_target, measure)

    def before_step(self, step: int):
        if step == self.at:
            self.probe.arm()

    def after_step(self, step: int):
        """`step`: optimizer steps completed. Every rank must call this (it gathers)."""
        if step != self.at + 1:
            return
        self.probe.disarm()
        r = self.probe.result or ModelStateBytes()
        plan = self.plan
        mine = [r.device["params"], r.device["grads"], r.device["optimizer"], r.device["buffers"], r.device["gathered"],
                r.model_states, r.host_total, plan.model_states if plan else -1, plan.host if plan else -1]
        acc = self.acc
        rows = acc.gather(torch.tensor(mine, dtype=torch.int64, device=acc.device)).view(-1, len(mine)).cpu()
        if not acc.is_main_process:
            return
        per_rank = {f: rows[:, i].tolist() for i, f in enumerate(self.FIELDS)}
        m = {f"mem/{f}_bytes": v[0] for f, v in per_rank.items() if not f.startswith("plan_")}
        m["mem/model_states_bytes_per_rank"] = per_rank["model_states"]
        m["mem/host_bytes_per_rank"] = per_rank["host"]
        m["mem/optimizer_state_ready"] = r.optimizer_state_ready
        if plan:
            m["plan/model_states_bytes_per_rank"] = per_rank["plan_model_states"]
            m["plan/host_bytes_per_rank"] = per_rank["plan_host"]
            m.update({f"plan/{k}_bytes": getattr(plan, k) for k in ("params", "grads", "optimizer", "buffers")})
            if plan.activations is not None:
                m["plan/activations_bytes"] = plan.activations
        self.log(m, step)
        print(self.line(per_rank, step), flush=True)

    @staticmethod
    def line(per_rank: dict, step: int) -> str:
        from zerotrain.train.observe.report import human_bytes as hb
        ms, plan = per_rank["model_states"], per_rank["plan_model_states"]
        text = (f"model states measured at step {step}: rank 0 {hb(ms[0])} (params {hb(per_rank['params'][0])}, "
                f"grads {hb(per_rank['grads'][0])}, optimizer {hb(per_rank['optimizer'][0])})"
                + (f", ranks {hb(min(ms))}..{hb(max(ms))}" if len(ms) > 1 else ""))
        if plan[0] > 0:
            text += f"; planner {hb(plan[0])} ({(ms[0] - plan[0]) / plan[0]:+.1%})"
        if max(per_rank["host"]) > 0:
            text += f"; offloaded to host {hb(per_rank['host'][0])}"
        return text
