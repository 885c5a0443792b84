"""The tokenizer pool of data.kind stream: data.num_workers processes per rank tokenize chunks
while the rank trains (0 = tokenize in the training process, on the step's critical path).

The rank keeps 2 x workers + 2 chunks in flight and uses them in stream order, so the tokens do
not depend on the number of workers. The workers are forked from a rank that has run torch: what
keeps them safe is in _init_worker and start_pool.
"""

from __future__ import annotations

import os
import signal

from zerotrain.train.data.prep_sources import make_tokenizer
from zerotrain.train.launch import device_env
from zerotrain.train.data.stream.readers import StreamFile, tokenize_chunk

_WORKER_TOKENIZER = None


def _init_worker(spec):
    """Set up a forked worker. It never touches torch: torch's OpenMP pool, forked from a rank
    that used it, spins forever. It ignores SIGTERM/SIGINT: a preemption signal sent to every
    process of the job (scancel, Ctrl-C) is the rank's to handle, which finishes its step (that
    may need this worker) and saves; the pool ends by its own shutdown. And it dies with the rank
    (PR_SET_PDEATHSIG): a killed rank's workers would otherwise wait on the queue forever."""
    global _WORKER_TOKENIZER
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the pool is the parallelism (as prepare's)
    _WORKER_TOKENIZER = make_tokenizer(spec)


def _work(f: StreamFile, first: int, payload, val_fraction: float):
    return tokenize_chunk(_WORKER_TOKENIZER, f, first, payload, val_fraction)


def start_pool(owner, workers: int, spec):
    """A pool of `workers` forked tokenizer processes for `owner` (a StreamWindows), and the
    finalizer that ends it at the owner's close, garbage collection or exit."""
    import multiprocessing
    import weakref
    from concurrent.futures import ProcessPoolExecutor
    # The pool is the parallelism: a forked Rust tokenizer would otherwise warn and turn its own off.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # concurrent.futures, not multiprocessing.Pool: a worker that dies fails the run (BrokenProcessPool)
    # instead of leaving its task waited on forever.
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                               initializer=_init_worker, initargs=(spec,))
    return pool, weakref.finalize(owner, _end_pool, pool)


def submit_chunk(pool, f: StreamFile, first: int, payload, val_fraction: float):
    """Tokenize one chunk's training documents in a worker: a Future of its tokens."""
    return pool.submit(_work, f, first, payload, val_fraction)


def _end_pool(pool):
    """Cancel the queued chunks and kill the workers: their tokens are no longer wanted. A plain
    shutdown can hang at exit on Python 3.11: the pool's manager thread and multiprocessing's exit
    hook join a worker that never got its stop sentinel (blocked in its call queue's get). The
    workers ignore SIGTERM (the rank's), so SIGKILL."""
    workers = list((getattr(pool, "_processes", None) or {}).values())  # no public handle on 3.11
    pool.shutdown(wait=False, cancel_futures=True)
    for w in workers:
        w.kill()
    for w in workers:
        w.join(timeout=10)


def default_workers() -> int:
    """data.num_workers unset: one tokenizer process per rank per spare core, 1 to 4 (a rank
    tokenizes the whole stream, so a node with more ranks than cores still gets 1 each)."""
    per_rank = device_env.cores() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(4, per_rank - 1))
