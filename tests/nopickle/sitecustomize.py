"""Put on PYTHONPATH by tests/test_checkpoint.py for a resumed training run: any attempt to
unpickle (pickle.load / pickle.loads / torch.load) is recorded in $ZEROTRAIN_NOPICKLE_LOG
and fails, so the test proves the whole run, resume included, never unpickles."""

import os
import pickle
import traceback

_LOG = os.environ.get("ZEROTRAIN_NOPICKLE_LOG")


def _refuse(name):
    def refuse(*args, **kwargs):
        if _LOG:
            with open(_LOG, "a") as f:
                f.write(f"{name} called in pid {os.getpid()}:\n{''.join(traceback.format_stack(limit=12))}\n")
        raise RuntimeError(f"{name} is forbidden in this test run (checkpoints must load without unpickling)")
    return refuse


if _LOG:
    pickle.load = _refuse("pickle.load")
    pickle.loads = _refuse("pickle.loads")
    import torch  # imported here so that every later `torch.load` resolves to the guard
    import torch.serialization

    torch.load = torch.serialization.load = _refuse("torch.load")
