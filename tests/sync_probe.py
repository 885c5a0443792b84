"""Run train/main.py and record every host read of a tensor that zerotrain's own code makes
(test harness for tests/test_sync_free.py).

On a GPU each of these is a host-device synchronisation (or a device-to-host copy): the CPU
waits for the whole queue of kernels, and the next step cannot be queued ahead. The probe is a
TorchFunctionMode, so it sees them on CPU as well: `.item()`, `.tolist()`, `float(t)`, `bool(t)`,
`int(t)`, `.numpy()`, `.cpu()`, formatting. A read counts when the first frame outside torch
that asked for it is in train/ or models/ (not train/data/, whose tensors are host tensors by
construction); DeepSpeed's own reads are DeepSpeed's business.

Writes $ZT_SYNC_PROBE_DIR/rank<R>.json: {"reads": [[step, "file:line", op], ...], "log_steps": [...],
"vote_devices": [...]} where `step` is the optimizer step being computed (completed + 1).
"""

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from zerotrain.train.launch import device_env  # noqa: E402

device_env.apply()

import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

import zerotrain.train.training.tick as stop_mod  # noqa: E402
import zerotrain.train.training.trainer as trainer_mod  # noqa: E402
import zerotrain.train.training.components as components_mod  # noqa: E402

READS = {"item", "tolist", "__float__", "__bool__", "__int__", "__index__", "numpy", "cpu", "__format__"}
OURS = (str(REPO / "train") + os.sep, str(REPO / "models") + os.sep)
# The data pipeline's tensors (sampler permutations, decoded samples) are host tensors by
# construction; batches reach the device through Accelerate afterwards.
HOST_SIDE = (str(REPO / "train" / "data") + os.sep,)
TORCH = str(Path(torch.__file__).parent) + os.sep


class HostReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.active = False
        self.step = 0
        self.reads: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if self.active and name in READS:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH):
                frame = frame.f_back
            file = frame.f_code.co_filename if frame is not None else ""
            if file.startswith(OURS) and not file.startswith(HOST_SIDE):
                where = f"{Path(frame.f_code.co_filename).relative_to(REPO)}:{frame.f_lineno}"
                self.reads.append([self.step, where, name])
        return func(*args, **(kwargs or {}))


PROBE = HostReads()
LOG_STEPS: list = []
VOTES: list = []


def _during_step(fn):
    def wrapped(self, *a, **k):
        PROBE.step = self.state.step + 1 if fn.__name__ == "train_step" else self.state.step
        PROBE.active = True
        try:
            return fn(self, *a, **k)
        finally:
            PROBE.active = False
    return wrapped


def _vote(fn):
    """The stop vote reads its flag every step by design, from a CPU tensor on a gloo group
    (train/training/tick.py StopVote): not a device read, so it is checked by where its buffers live."""
    def wrapped(self, values, *a, **k):
        VOTES.extend(str(b.device) for b in self.buffers)
        VOTES.append("group:" + ("default" if self.group is None else "side"))
        return fn(self, values, *a, **k)
    return wrapped


def _log(fn):
    def wrapped(self, tick, *a, **k):
        LOG_STEPS.append(tick.step)
        return fn(self, tick, *a, **k)
    return wrapped


trainer_mod.Trainer.train_step = _during_step(trainer_mod.Trainer.train_step)
stop_mod.StopVote.__call__ = _vote(stop_mod.StopVote.__call__)
components_mod.LogLine.write = _log(components_mod.LogLine.write)


def _dump():
    out = Path(os.environ["ZT_SYNC_PROBE_DIR"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(
        json.dumps({"reads": PROBE.reads, "log_steps": LOG_STEPS, "vote_devices": sorted(set(VOTES))}))


if __name__ == "__main__":
    import atexit
    atexit.register(_dump)
    sys.argv[0] = str(REPO / "train" / "main.py")
    from zerotrain.train.main import run_as_script
    with PROBE:
        run_as_script()
