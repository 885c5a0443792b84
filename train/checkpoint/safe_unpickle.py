"""The only place zerotrain unpickles anything: `zerotrain import --trust-pickle` reading the
torch pickles of DeepSpeed / HF Trainer checkpoints. Training and resuming never come here
(their checkpoints are safetensors + JSON; tests/test_checkpoint.py runs a resume with the
pickle functions replaced by ones that fail).

A pickle can name any importable callable and call it (`__reduce__`: `os.system`, ...), so every
file is read by torch's weights-only loader (`torch.load(weights_only=True)`): tensors, storages,
plain containers and torch's own types, nothing else. DeepSpeed's plain-data records are allowed
under the names DeepSpeed pickles them by, as inert stand-ins (`torch.serialization.safe_globals`),
so that loading a DeepSpeed checkpoint neither imports nor runs DeepSpeed's code: `ZeroStageEnum`
-> its int value, `LossScaler` / `DynamicLossScaler` / `fragment_address` / `argparse.Namespace`
-> a `Record` (a dict of its attributes). Everything else is refused with `UnsafePickle` before
anything is called.
"""

from __future__ import annotations

import contextlib
import pickle
import re

import torch

from zerotrain.train.errors import CheckpointError


class UnsafePickle(CheckpointError):
    """torch's weights-only loader refused the pickle (a global outside the allowlist, or a
    construct it does not allow): nothing was called."""


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


# What DeepSpeed 0.19 pickles besides tensors and containers (ZeRO-0..3, fp16 loss scalers),
# by the name in the pickle: torch's loader then never imports these modules.
STAND_INS = [(Record, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
             (Record, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
             (Record, "deepspeed.utils.tensor_fragment.fragment_address"),
             (Record, "argparse.Namespace"),
             (_enum_value, "deepspeed.runtime.zero.config.ZeroStageEnum")]

_real_torch_load = torch.load


def restricted_load(path, map_location="cpu", **_ignored):
    """torch.load of `path` with weights_only=True and the stand-ins (any weights_only /
    pickle_module a caller passes is ignored). Raises UnsafePickle for anything else."""
    try:
        with torch.serialization.safe_globals(STAND_INS):
            return _real_torch_load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # the weights-only loader's refusal
        raise _refusal(path, str(e)) from None
    except (RuntimeError, EOFError, ValueError, AttributeError, TypeError, KeyError) as e:
        raise CheckpointError(f"{path} is not a readable torch checkpoint file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''})") from None


def _refusal(path, message: str) -> UnsafePickle:
    """One line from torch's refusal: the global it names, or its own reason (an opcode it does
    not allow: torch.save writes pickle protocol 2; a bare pickle of protocol 4 stops at FRAME)."""
    found = re.search(r"GLOBAL (\S+)", message)
    if found:
        name = found.group(1) if "." in found.group(1) else f"builtins.{found.group(1)}"
        return UnsafePickle(f"refused to unpickle {name} in {path}: only tensors and plain containers are "
                            f"allowed (this file would run code when loaded; do not trust it)")
    parts = [p.strip() for p in message.split("\n\n") if p.strip()]
    reason = parts[-2] if len(parts) > 1 else message.strip()  # torch's own words, before its docs link
    return UnsafePickle(f"{path} is not a readable torch checkpoint file (UnpicklingError: {reason})")


@contextlib.contextmanager
def torch_load_restricted():
    """Within the block every torch.load (DeepSpeed's zero_to_fp32 readers call it with
    weights_only=False) goes through restricted_load instead."""
    torch.load = restricted_load
    try:
        yield
    finally:
        torch.load = _real_torch_load
