"""Put on PYTHONPATH of a launch by tests/conftest.py (the fp32 ZeRO-3 stage run, read by
tests/test_stages.py): each rank of train/main.py, at its exit (its filters as the run left
them), emits two FutureWarnings that must still reach stderr: one attributed to the module
torch's torch.distributed deprecations come from (train/launch/library_warnings.py hides two
messages of that module, not the module), and one of the program itself."""

import atexit
import os
import sys
import warnings

PROBE = "zerotrain warnings probe"


def _emit():
    warnings.warn_explicit(f"{PROBE}: another deprecation of torch.distributed", FutureWarning,
                           "c10d_logger.py", 1, module="torch.distributed.c10d_logger")
    warnings.warn(f"{PROBE}: a FutureWarning of the program", FutureWarning)
    sys.stderr.flush()


if "RANK" in os.environ and sys.argv and sys.argv[0].endswith("main.py"):
    atexit.register(_emit)
