"""Library warnings a zerotrain user can do nothing about, hidden by their exact text (no torch
import here: installed before the libraries load, in every rank, by train/main.py).

torch 2.14 deprecates `torch.distributed.all_gather_into_tensor` and `reduce_scatter_tensor` (in
favour of `all_gather_single` / `reduce_scatter_single`) with a FutureWarning on every call, and
DeepSpeed 0.19.8 calls exactly those two for its ZeRO collectives (deepspeed/comm/torch.py,
TorchBackend.get_all_gather_function / get_reduce_scatter_function). A 6-step ZeRO-3 run of the
suite's GPT printed 388 such lines (52 + 336) on stderr, burying the banner, progress and errors.

Which module a filter must name: torch's `@deprecated` wrapper warns with stacklevel 2, and that
wrapper is itself wrapped by `c10d_logger._exception_logger`, so the warning is attributed to
torch/distributed/c10d_logger.py whoever called (DeepSpeed's frames never appear; measured). Each
filter matches that module, FutureWarning and the start of the one message; every other warning,
other deprecations of the same module included, stays visible. The cost: a deliberate call of
one of these two functions from the user's own code in a zerotrain run is not warned about either.
"""

from __future__ import annotations

import re
import warnings

# The module torch's deprecation warnings of torch.distributed are attributed to (see above).
C10D_WRAPPER_MODULE = "torch.distributed.c10d_logger"
DEPRECATED_BY_TORCH_CALLED_BY_DEEPSPEED = (
    "`torch.distributed.all_gather_into_tensor` is deprecated.",
    "`torch.distributed.reduce_scatter_tensor` is deprecated.",
)


def quiet() -> None:
    """Install the filters (idempotent: the warnings module drops a duplicate filter)."""
    for message in DEPRECATED_BY_TORCH_CALLED_BY_DEEPSPEED:
        warnings.filterwarnings("ignore", message=re.escape(message), category=FutureWarning,
                                module=re.escape(C10D_WRAPPER_MODULE) + r"\Z")
