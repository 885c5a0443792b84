"""Resumable checkpoints: the Checkpointer, one per run: save / load (resume) / init_from / prune,
and the live export (train/checkpoint/consolidate.py). Layout and guarantees: docs/checkpoints.md.

Every rank writes the part of the state it owns (no rank gathers the model or the
optimizer), as safetensors pieces keyed by parameter name and element range, so a
checkpoint taken with N processes under ZeRO-k loads on M processes under any stage or
DDP. A save goes to `.tmp-step_X`, every file is fsynced, rank 0 writes the manifest
(sizes + sha256) last, renames the directory into place, then moves `latest` and prunes.

The Checkpointer is handed the run's pieces it reads (never the trainer) and changes nothing
outside itself but what was registered with it: a resume returns the restored TrainState, which
the trainer then starts from. Anything with state to resume (train/checkpoint/state.py
`Stateful`: state_dict() / load_state_dict()) is registered by name (`register`); meta.json keeps
`{"state": {name: its state_dict()}}`, and a resume hands each its record back. A `TensorState`
also keeps per-parameter tensors of its own kinds (`tensor_kinds`: train.ema's "ema"), saved and
read back beside the moments. The strategy is registered as "engine" (its counters and fp16 loss
scale); the run's features (train/training/features.py) under their names.

The Checkpointer owns that shared state and delegates the work, one concept per module:
  train/checkpoint/save.py        Saver: what every save writes (this rank's files: `layout`,
                                  `piece`, `meta`), the synchronous save, the commit, the pruning
  train/checkpoint/async_save.py  AsyncSaver: checkpoint.async (`snapshot`, the background write,
                                  `write_status` / `poll` / `flush`, then the commit)
  train/checkpoint/load.py        Loader: resume / load / init_from (`check_fits`, and the
                                  `restore_tensors` / `restore_counters` functions)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.checkpoint.async_save import AsyncSaver
from zerotrain.train.checkpoint.files import MOMENTS
from zerotrain.train.checkpoint.load import Loader, restore_counters
from zerotrain.train.checkpoint.save import Saver, describe, disk_full, io_error, not_writable
from zerotrain.train.checkpoint.state import Stateful, TrainState
from zerotrain.train.errors import CheckpointError

if TYPE_CHECKING:
    from zerotrain.models.workload import Workload
    from zerotrain.train.config import Batch, CheckpointConfig
    from zerotrain.train.data.sampler import GlobalBatchSampler


class Checkpointer:
    """Save / resume / init_from / export for one run, given exactly what they read:

    cfg              the run config's checkpoint section (keep_last, max_shard_size, export_dtype)
    run_dir          checkpoints go to <run_dir>/checkpoints, the export to <run_dir>/export
    rank, world      this process and the number of processes
    strategy         the backend (train/strategy/), bound to its Accelerator and engine: the device
                     of the collectives, the holder of this rank's tensors; registered as
                     "engine" (its counters and fp16 loss scale)
    workload         family, model_config and tied names: the metadata of saves and exports
    sampler          the data order (global batch, samples, seed): saved, and checked on resume
    batch            micro x accum x world: for messages
    model_name       model.name, for messages
    log              the metrics sink (checkpoint/save_s, checkpoint/bytes)
    resolved_config  config.json's content, kept in every checkpoint's metadata
    """

    def __init__(self, *, cfg: CheckpointConfig, run_dir: Path, rank: int, world: int, strategy, workload: Workload,
                 sampler: GlobalBatchSampler, batch: Batch, model_name: str, log: Callable[[dict, int], None],
                 resolved_config: dict | None):
        self.cfg = cfg
        self.root = Path(run_dir) / "checkpoints"
        self.export_dir = Path(run_dir) / "export"
        self.rank, self.world = rank, world
        self.is_main = self.rank == 0
        self.strategy = strategy
        self.workload, self.sampler, self.batch, self.model_name = workload, sampler, batch, model_name
        self.log, self.resolved_config = log, resolved_config
        self._holder = None
        self._last_saved: Path | None = None
        self.resumed_from: Path | None = None  # the checkpoint load() restored, if any
        self.registered: dict[str, Stateful] = {}  # name -> what register() was given (its state resumes)
        self.tensor_owners: dict = {}  # per-parameter tensor kind (e.g. "ema") -> the component holding it
        self.register("engine", strategy)
        # checkpoint.async (off when its host snapshot would not fit the memory budget: train/plan/memory_plan.py)
        self.background = bool(getattr(cfg, "async_", False))
        self.saver = Saver(self)
        self.async_saver = AsyncSaver(self)
        self.loader = Loader(self)

    def register(self, name: str, component: Stateful) -> None:
        """Keep `component`'s state_dict() in every checkpoint under `name`, and hand it back on
        resume (load_state_dict, in registration order, after the TrainState is restored)."""
        if name in self.registered:
            raise ValueError(f"a checkpoint component named {name!r} is already registered")
        for kind in getattr(component, "tensor_kinds", ()):
            if kind in ("param", "buffer", *MOMENTS) or kind in self.tensor_owners:
                raise ValueError(f"component {name!r}: the tensor kind {kind!r} is taken")
            self.tensor_owners[kind] = component
        self.registered[name] = component

    @property
    def holder(self):
        if self._holder is None:
            self._holder = self.strategy.make_holder(self.raw_model, self.rank, self.world)
        return self._holder

    @property
    def raw_model(self):
        """The module the engine or DDP wraps (accelerate's unwrap_model would import DeepSpeed in a DDP run)."""
        return self.workload.model

    @property
    def lora(self) -> dict | None:
        """The LoRA adapter (models/lora.py) when model.lora is set: then only trained tensors are saved."""
        return self.workload.lora

    def _say(self, msg: str):
        if self.is_main:
            print(f"zerotrain: {msg}", flush=True)

    def _on_every_rank(self, fn, what: str):
        """Run fn on every rank, then reduce whether it failed anywhere (a collective): if it did,
        every rank raises (nobody hangs in a barrier). Returns fn's result."""
        err, out = None, None
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
            err = e
        failed = ckpt_files.reduce_max(torch.tensor([int(err is not None)]), self.strategy.acc.device)
        if err is not None:
            if disk_full(err):
                prev = self.latest_path()
                raise CheckpointError(f"{what} failed: disk full (no space left on {self.root}); "
                                      + (f"the previous checkpoint {prev} is intact; " if prev else "")
                                      + "free space or point train.run_dir at a larger disk, then --resume auto") \
                    from None
            if not_writable(err):
                raise CheckpointError(f"{what} failed: {describe(err, self.root)}") from None
            if io_error(err):
                raise CheckpointError(f"{what} failed: {err}") from None
            raise err  # a bug, not the disk: keep the traceback
        if int(failed[0]):
            raise CheckpointError(f"{what} failed on another rank (see its error)")
        return out

    # ------------------------------------------------------------------ save (save.py, async_save.py)
    def save(self, state) -> Path:
        if self.background:
            return self.async_saver.save(state)
        return self.saver.save(state)

    def prune(self, keep_step: int | None = None):
        """Delete all but the newest `keep_last` complete checkpoints up to `keep_step` (rank 0)."""
        self.saver.prune(keep_step)

    def write_status(self) -> tuple:
        """This rank's part of the loop's vote about the background write in flight (none
        without checkpoint.async: the step then never enters async_save.py)."""
        return self.async_saver.write_status() if self.background else (0.0, 0.0, 0.0, 0.0)

    def poll(self, writes: tuple, step: int, last: bool = False) -> None:
        """The vote's sum over the ranks: commit or report the background write once every rank's
        ended (`last`: no save follows in this run)."""
        if self.background:
            self.async_saver.poll(writes, step, last)

    def flush(self, step: int, last: bool = False) -> float:
        """Wait for the background write in flight and settle it (a collective); the seconds waited."""
        return self.async_saver.flush(step, last)

    def unsaved_at_end(self, step: int) -> str | None:
        """The run's last step, every rank: wait for the background write in flight and settle it,
        then agree whether the newest save this run tried failed with no later one committed (a
        collective under checkpoint.async; a synchronous save that fails raises instead). Returns
        the one line the run ends with (the last good checkpoint, the steps no checkpoint holds),
        or None: the run's saves are complete."""
        if not self.background:
            return None
        self.flush(step, last=True)
        lost = self.async_saver.lost
        anywhere = ckpt_files.reduce_max(torch.tensor([int(lost is not None)]), self.strategy.acc.device)
        if not int(anywhere[0]):
            return None
        return self.lost_line(lost or "the save failed on rank 0 (its line says why)", step)

    def lost_line(self, why: str, step: int) -> str:
        """One line for a run whose last save failed: why, the last good checkpoint and the steps
        after it that no checkpoint holds (a scheduler must not read this run as a success)."""
        prev = self.latest_path()
        good = int(Path(prev).name.removeprefix("step_")) if prev else 0
        kept = (f"the last good checkpoint is {prev} (step {good})" if prev
                else "no checkpoint of this run exists")
        lost = step - good
        return (f"the run's last save failed ({why}); {kept}: {lost} step{'s' if lost != 1 else ''} "
                f"({good + 1}-{step}) are in no checkpoint; fix the cause, then --resume auto")

    def close(self) -> None:
        """Wait for the background write in flight (no collective)."""
        self.async_saver.close()

    @property
    def snapshot_bytes(self) -> int:
        """Host memory the asynchronous saves keep (0 before the first one)."""
        return self.async_saver.snapshot_bytes

    def latest_path(self) -> str | None:
        if self._last_saved is not None:
            return str(self._last_saved)
        found = ckpt_files.newest_checkpoint(self.root)
        return str(found) if found else None

    # ------------------------------------------------------------------ load (load.py)
    def resume(self, spec: str, load_optimizer: bool = True) -> TrainState | None:
        """checkpoint.resume: "none", "auto" or a path; the restored TrainState, or None."""
        return self.loader.resume(spec, load_optimizer)

    def load(self, path, load_optimizer: bool = True) -> TrainState:
        """Restores the tensors, engine counters and loss scale in place; returns the TrainState."""
        return self.loader.load(path, load_optimizer)

    def _restore_counters(self, meta: dict) -> TrainState:
        """The saved TrainState, then every registered component's state (load.restore_counters)."""
        return restore_counters(meta, self.registered)

    def on_fit_start(self):
        """Restore a resumed checkpoint's RNG streams right before the first step."""
        self.loader.on_fit_start()

    def init_from(self, path: str):
        """model.init_from: exported weights (any world size / stage), optimizer untouched."""
        self.loader.init_from(path)

    # ------------------------------------------------------------------ export
    def export(self, out_dir: str | Path | None = None) -> str:
        """Consolidated weights (HF layout; a LoRA run's adapter) from the live state
        (train/checkpoint/consolidate.py): a collective, every rank calls it."""
        from zerotrain.train.checkpoint.consolidate import export_adapter, export_weights
        t0 = time.perf_counter()
        out = Path(out_dir) if out_dir else self.export_dir
        dtype = self.cfg.export_dtype
        if self.lora is not None:
            n = export_adapter(out, self.holder, self.lora, dtype, self.is_main)
            ckpt_files.barrier()
            self._say(f"exported the {dtype} LoRA adapter ({n} tensors) to {out} in "
                      f"{time.perf_counter() - t0:.2f} s (zerotrain export --merge: full merged weights)")
            return str(out)
        export_weights(out, self.holder, self.raw_model, self.workload, self.cfg, self.is_main)
        ckpt_files.barrier()
        self._say(f"exported {dtype} weights to {out} in {time.perf_counter() - t0:.2f} s")
        return str(out)
