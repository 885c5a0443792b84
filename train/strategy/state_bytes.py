"""The model-state bytes this rank holds now, read from the running engine (DDP, ZeRO-0/1/2/3,
offload): where each engine keeps parameters, gradients, master weights, moments and buffers,
every DeepSpeed attribute read through internals.py. The counting rule and the report are
train/observe/memory.py's (Counter, ModelStateBytes, StepProbe); a run reaches this through
Strategy.measure_model_states."""

from __future__ import annotations

import torch

import zerotrain.train.strategy.internals as internals
from zerotrain.train.observe.memory import Counter, ModelStateBytes, grads_of, unwrap


def measure(model, raw_optimizer, accelerator_is_cpu: bool | None = None) -> ModelStateBytes:
    """Bytes this rank holds now. `model` is what accelerate.prepare returned (a DeepSpeed
    engine, a DDP wrapper or a bare module); `raw_optimizer` is the torch optimizer built
    by train/optim/optimizer.py (DeepSpeed's inner "basic" optimizer)."""
    if accelerator_is_cpu is None:
        accelerator_is_cpu = not torch.cuda.is_available()
    c = Counter(accelerator_is_cpu)
    zero = internals.zero_optimizer(model)
    # Which structures DeepSpeed placed on its offload device (CPU/NVMe).
    off_opt, off_param = internals.offloads(zero)
    params = [p for p in unwrap(model).parameters()]
    parted = [p for p in params if internals.has_local_partition(p)]

    # -- parameters: the working copy forward uses (whole, a flat buffer, or a ZeRO-3 partition)
    c.add("params", "zero3.ds_tensor", [internals.local_partition(p) for p in parted], off_param)
    # A partitioned ZeRO-3 parameter whole at this moment is a transient working copy, not a model
    # state: from step 2 on (its trace recorded) DeepSpeed's pre-forward hook on the model prefetches
    # the first modules' parameters (partitioned_param_coordinator.py, _fetch_sub_module_impl), so
    # the embedding is gathered (INFLIGHT) when the probe's own pre-forward hook runs. The planner
    # counts gathered parameters in the backward's working set, not in the parameters.
    c.add("gathered", "zero3.gathered", [p.data for p in parted if not internals.is_persistent(p)])
    c.add("params", "module.parameters", [p.data for p in params])  # whole: DDP, ZeRO-0/1/2, ZeRO-3 persistent
    for name in internals.PARAM_FLATS:
        c.add("params", name, internals.probe(zero, name))
    c.add("params", internals.LP_PARTITIONS, internals.probe(zero, internals.LP_PARTITIONS), off_param)

    # -- gradients: wherever the engine keeps them between backward and step
    c.add("grads", "param.grad", [p.grad for p in params if p.grad is not None])
    c.add("grads", "param.grad_accum", [internals.grad_accumulator(p) for p in params])
    for name in internals.GRAD_STORES:
        c.add("grads", name, internals.probe(zero, name))
    c.add("grads", internals.GRAD_PARTITION_BUFFER, internals.probe(zero, internals.GRAD_PARTITION_BUFFER), off_opt)
    masters = [internals.probe(zero, n) for n in internals.MASTER_FLATS]
    c.add("grads", "fp32_master.grad", grads_of(masters), off_opt)
    c.add("grads", internals.CPU_GRADS, internals.probe(zero, internals.CPU_GRADS), off_opt)

    # -- optimizer states: fp32 master weights (ZeRO paper: part of the 12 bytes/param) + moments
    master_params = [p for g in raw_optimizer.param_groups for p in g["params"]]
    c.add("optimizer", "fp32_master", master_params, off_opt)
    c.add("optimizer", "fp32_master", masters, off_opt)
    c.add("optimizer", "optimizer.state", list(raw_optimizer.state.values()), off_opt)
    inner = getattr(raw_optimizer, "optimizer", None)  # an accelerate wrapper, if one was passed
    if inner is not None and hasattr(inner, "state"):
        c.add("optimizer", "optimizer.state", list(inner.state.values()), off_opt)
    c.out.optimizer_state_ready = any(len(s) for s in raw_optimizer.state.values())

    # -- buffers: everything else the ZeRO optimizer object holds (reduce buckets, staging)
    if zero is not None:
        for name, value in sorted(vars(zero).items()):
            if name in internals.NOT_BUFFERS:
                continue
            c.add("buffers", f"zero.{name}", value, off_opt and "cpu" in name)
    return c.out
