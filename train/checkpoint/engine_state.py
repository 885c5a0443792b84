"""What a checkpoint keeps of the training engine besides tensors: DeepSpeed's step counters and
the fp16 loss scale (DeepSpeed's loss scaler, or the torch GradScaler Accelerate gives DDP). They
are saved in meta.json ("engine", "loss_scaler") and set again on resume."""

from __future__ import annotations

from train.checkpoint.state import TrainState
from train.optim import loss_scale

COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def engine_counters(model, ds) -> dict | None:
    """DeepSpeed's step counters of the engine `model` (None under DDP)."""
    if not ds.is_deepspeed:
        return None
    return {k: int(getattr(model, k)) for k in COUNTERS if hasattr(model, k)}


def scaler_state(model, acc, ds) -> dict | None:
    """The fp16 loss scale's state (None in bf16 / fp32, or when DDP has no GradScaler)."""
    if ds.precision != "fp16":
        return None
    if ds.is_deepspeed:
        return {"kind": "deepspeed", **loss_scale.state(model.optimizer)}
    sc = getattr(acc, "scaler", None)
    return {"kind": "torch", **{k: float(v) for k, v in sc.state_dict().items()}} if sc is not None else None


def restore(meta: dict, st: TrainState, model, acc, ds, accum: int):
    """DeepSpeed's step counters and the loss scale set to match the saved TrainState `st`."""
    if ds.is_deepspeed:
        saved = meta.get("engine") or {}
        model.global_steps = saved.get("global_steps", st.step)
        model.global_samples = saved.get("global_samples", st.samples_seen)
        model.skipped_steps = saved.get("skipped_steps", st.skipped_steps)
        model.micro_steps = st.step * accum
    scaler = meta.get("loss_scaler")
    if scaler and ds.precision == "fp16":
        _restore_scaler(scaler, model, acc, ds)


def _restore_scaler(s: dict, model, acc, ds):
    if s["kind"] == "deepspeed" and ds.is_deepspeed:
        loss_scale.restore(model.optimizer, s)
    elif s["kind"] == "torch" and getattr(acc, "scaler", None) is not None:
        state = {k: v for k, v in s.items() if k != "kind"}
        state["_growth_tracker"] = int(state.get("_growth_tracker", 0))
        state["growth_interval"] = int(state.get("growth_interval", 2000))
        acc.scaler.load_state_dict(state)
