"""The only place zerotrain unpickles anything: `zerotrain import --trust-pickle` reading the
torch pickles of DeepSpeed / HF Trainer checkpoints. Training and resuming never come here
(their checkpoints are safetensors + JSON; tests/test_checkpoint.py runs a resume with the
pickle functions replaced by ones that fail).

A pickle can name any importable callable and call it (`__reduce__`: `os.system`, ...). The
`RestrictedUnpickler` resolves only an allowlist:

- tensors and storages: torch's rebuild functions and storage types (the storage *bytes* come
  from the zip archive, not from the pickle), `torch.Size`, `torch.Tensor` (as a rebuild type);
- plain containers: `collections.OrderedDict` (and Python's built-in dict / list / tuple /
  str / numbers, which need no lookup);
- DeepSpeed's plain-data records, replaced by inert stand-ins so that none of DeepSpeed's code
  runs while loading: `ZeroStageEnum` -> its int value, `LossScaler` / `DynamicLossScaler` /
  `fragment_address` / `argparse.Namespace` -> a `Record` (a dict of its attributes).

Everything else (`os.system`, `builtins.eval`, any class with its own `__setstate__` ...) is
refused with `UnsafePickle` before anything is called. Checked against what DeepSpeed 0.19
writes for ZeRO-0..3 fp32 (tests/test_import.py lists the globals of every file it writes).
"""

from __future__ import annotations

import collections
import contextlib
import pickle
import types

import torch

from train.errors import CheckpointError


class UnsafePickle(CheckpointError):
    """A pickle names something outside the allowlist (code would run): nothing was called."""


class Record(dict):
    """Stand-in for a pickled plain-data object (LossScaler, fragment_address, Namespace):
    its attributes as a dict, also readable as attributes. Runs no code of the original class."""

    def __init__(self, *args, **kwargs):
        super().__init__()
        if args or kwargs:
            self["args"] = list(args)
            self.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.update(state)
        else:
            self["state"] = state

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _enum_value(value, *_):
    return value


def _tensor_rebuilders() -> dict[tuple[str, str], object]:
    import torch._utils as tu
    import torch._tensor as tt
    out = {("torch._utils", n): getattr(tu, n) for n in
           ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
            "_rebuild_parameter_with_state") if hasattr(tu, n)}
    out[("torch._tensor", "_rebuild_from_type_v2")] = tt._rebuild_from_type_v2
    out[("torch", "Tensor")] = torch.Tensor
    out[("torch.nn.parameter", "Parameter")] = torch.nn.Parameter
    out[("torch", "Size")] = torch.Size
    for dt in ("float32", "float16", "bfloat16", "float64", "int64", "int32", "int8", "uint8", "bool"):
        out[("torch", dt)] = getattr(torch, dt)
    out[("torch", "device")] = torch.device
    return out


ALLOWED_CONTAINERS = {("collections", "OrderedDict"): collections.OrderedDict}
PLAIN_RECORDS = {
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
    ("argparse", "Namespace"),
}
ENUMS = {("deepspeed.runtime.zero.config", "ZeroStageEnum")}


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler whose find_class resolves only the allowlist above (torch.load routes
    storage types around find_class itself: they only wrap bytes from the archive)."""

    source = "a pickle"

    def find_class(self, module, name):
        key = (module, name)
        allowed = _tensor_rebuilders()
        if key in allowed:
            return allowed[key]
        if key in ALLOWED_CONTAINERS:
            return ALLOWED_CONTAINERS[key]
        if key in PLAIN_RECORDS:
            return Record
        if key in ENUMS:
            return _enum_value
        if module == "torch" and name.endswith("Storage"):
            return getattr(torch, name)
        raise UnsafePickle(f"refused to unpickle {module}.{name} in {self.source}: only tensors and plain "
                           f"containers are allowed (this file would run code when loaded; do not trust it)")


def _pickle_module(source: str):
    mod = types.ModuleType("zerotrain_restricted_pickle")
    mod.Unpickler = cls = type("Unpickler", (RestrictedUnpickler,), {"source": source})

    def load(f, **kwargs):  # torch's legacy (non-zip) format reads its header with pickle_module.load
        return cls(f, **kwargs).load()

    mod.load = load
    mod.loads = None  # nothing may fall back to the unrestricted pickle functions
    mod.__name__ = "pickle"
    return mod


_real_torch_load = torch.load


def restricted_load(path, map_location="cpu", **_ignored):
    """torch.load of `path` through RestrictedUnpickler (any weights_only / pickle_module a caller
    passes is ignored). Raises UnsafePickle for anything outside the allowlist."""
    try:
        return _real_torch_load(path, map_location="cpu", weights_only=False, pickle_module=_pickle_module(str(path)))
    except UnsafePickle:
        raise
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, AttributeError, TypeError) as e:
        raise CheckpointError(f"{path} is not a readable torch checkpoint file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None


@contextlib.contextmanager
def torch_load_restricted():
    """Within the block every torch.load (DeepSpeed's zero_to_fp32 readers call it with
    weights_only=False) goes through restricted_load instead."""
    torch.load = restricted_load
    try:
        yield
    finally:
        torch.load = _real_torch_load
