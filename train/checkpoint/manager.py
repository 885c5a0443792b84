"""Resumable checkpoints: save / load (resume) / init_from / prune, and the live export
(train/checkpoint/consolidate.py). Layout and guarantees: docs/checkpoints.md.

Every rank writes the part of the state it owns (no rank gathers the model or the
optimizer), as safetensors pieces keyed by parameter name and element range, so a
checkpoint taken with N processes under ZeRO-k loads on M processes under any stage or
DDP. A save goes to `.tmp-step_X`, every file is fsynced, rank 0 writes the manifest
(sizes + sha256) last, renames the directory into place, then moves `latest` and prunes.

The Checkpointer is handed the run's pieces it reads (never the trainer) and changes nothing
outside itself but its registered components: a resume returns the restored TrainState, which
the trainer then starts from. A component with state to resume (train/checkpoint/state.py
`Stateful`: state_dict() / load_state_dict()) is registered by name (`register`); meta.json keeps
`{"state": {name: its state_dict()}}`, and a resume hands each its record back. The strategy is
registered as "engine" (its counters and fp16 loss scale).

checkpoint.async: a save copies this rank's state into reused host buffers at the step boundary
and writes the same files in a background thread (train/checkpoint/background.py) while training
goes on. Ranks learn that every write is durable from the loop's per-step vote (`write_status`,
`poll`: no collective of its own), or, when the next save, the last step or a stop comes first,
by waiting for it (`flush`: one collective, at a save); only then does rank 0 commit (manifest,
rename, `latest`). A failed write is one warning line; the previous checkpoint stays `latest`.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from zerotrain.models.lora import base_name, is_adapter
from zerotrain.train import testhooks
from zerotrain.train.checkpoint import adapter
from zerotrain.train.checkpoint.background import BackgroundWrite, Staging
from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.checkpoint.files import MOMENTS, persistent_buffers
from zerotrain.train.checkpoint.state import Stateful, TrainState
from zerotrain.train.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from zerotrain.models.workload import Workload
    from zerotrain.train.config import Batch, CheckpointConfig
    from zerotrain.train.data.sampler import GlobalBatchSampler



# ---------------------------------------------------------------------------- collectives (no-ops alone)

def _barrier():
    d = ckpt_files.process_group()
    if d is not None:
        d.barrier()


def _disk_full(err: BaseException) -> bool:
    # safetensors reports ENOSPC as SafetensorError("... No space left on device (os error 28)").
    return (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "(os error 28)" in str(err)


def _io_error(err: BaseException) -> bool:
    return isinstance(err, (OSError, CheckpointError)) or type(err).__name__ == "SafetensorError"


def _describe(err: BaseException, root: Path) -> str:
    if _disk_full(err):
        return f"disk full (no space left on {root})"
    return str(err) if _io_error(err) else f"{type(err).__name__}: {err}"


def shape_mismatch(expected: dict, found: dict, what_expected: str, what_found: str, limit: int = 8) -> str | None:
    """A readable diff of two {name: shape} maps, or None when they agree."""
    missing = [n for n in expected if n not in found]
    extra = [n for n in found if n not in expected]
    shapes = [f"{n}: {what_expected} {list(expected[n])} vs {what_found} {list(found[n])}"
              for n in expected if n in found and tuple(expected[n]) != tuple(found[n])]
    if not (missing or extra or shapes):
        return None

    def lines(title, items):
        more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
        return f"  {title} ({len(items)}):\n" + "\n".join(f"    {x}" for x in items[:limit]) + more

    parts = []
    if missing:
        parts.append(lines(f"in {what_expected} only", missing))
    if extra:
        parts.append(lines(f"in {what_found} only", extra))
    if shapes:
        parts.append(lines("different shapes", shapes))
    return "\n".join(parts)


class Checkpointer:
    """Save / resume / init_from / export for one run, given exactly what they read:

    cfg              the run config's checkpoint section (keep_last, max_shard_size, export_dtype)
    run_dir          checkpoints go to <run_dir>/checkpoints, the export to <run_dir>/export
    rank, world      this process and the number of processes
    strategy         the backend (train/strategy/), bound to its Accelerator and engine: the device
                     of the collectives, the holder of this rank's tensors; registered as the
                     "engine" component (its counters and fp16 loss scale)
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
        self._pending_rng = None
        self._last_saved: Path | None = None
        self.resumed_from: Path | None = None  # the checkpoint load() restored, if any
        self.components: dict[str, Stateful] = {}
        self.register("engine", strategy)
        # checkpoint.async (off when its host snapshot would not fit the memory budget: train/plan/memory_plan.py)
        self.background = bool(getattr(cfg, "async_", False))
        self._staging: Staging | None = None
        self._pending: BackgroundWrite | None = None
        self._saves = 0  # asynchronous saves started: the same number on every rank

    def register(self, name: str, component: Stateful) -> None:
        """Keep `component`'s state_dict() in every checkpoint under `name`, and hand it back on
        resume (load_state_dict, in registration order, after the TrainState is restored)."""
        if name in self.components:
            raise ValueError(f"a checkpoint component named {name!r} is already registered")
        self.components[name] = component

    @property
    def holder(self):
        if self._holder is None:
            self._holder = self.strategy.make_holder(self.raw_model, self.rank, self.world)
        return self._holder

    @property
    def raw_model(self):
        """The module the engine or DDP wraps (accelerate's unwrap_model would import DeepSpeed in a DDP run)."""
        return self.workload.model

    def _say(self, msg: str):
        if self.is_main:
            print(f"zerotrain: {msg}", flush=True)

    # ------------------------------------------------------------------ save
    def _new_tmp_dir(self, tmp: Path) -> None:
        """Rank 0: the save's .tmp- directory, after removing any a killed save left."""
        if self.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(ckpt_files.TMP_PREFIX + "*"):  # left by a save that was killed
                ckpt_files.remove_tree(stale)
            tmp.mkdir()

    def save(self, state) -> Path:
        if self.background:
            return self._save_async(state)
        t0 = time.perf_counter()
        name = ckpt_files.step_dir_name(state.step)
        final, tmp = self.root / name, self.root / (ckpt_files.TMP_PREFIX + name)

        # Each _agree ends in a collective: the directory exists before anyone writes, every
        # rank's files are durable before rank 0 declares the checkpoint complete, and nobody
        # returns before it is.
        try:
            self._agree(lambda: self._new_tmp_dir(tmp), f"creating {tmp}")
            self._agree(lambda: ckpt_files.write_json(tmp / f".part-rank{self.rank:05d}.json",
                                                      self._write_rank_files(tmp, state)), f"writing checkpoint {final}")
            nbytes = self._agree(lambda: self._commit(tmp, final, state.step) if self.is_main else 0,
                                 f"completing checkpoint {final}")
        except CheckpointError:
            if self.is_main and tmp.exists():  # give the space back; `latest` still names the previous save
                ckpt_files.remove_tree(tmp)
            raise
        self._last_saved = final
        dt = time.perf_counter() - t0
        if self.is_main:
            self._say(f"checkpoint {final} saved ({nbytes / 2**20:.1f} MiB in {dt:.2f} s)")
            self.log({"checkpoint/save_s": dt, "checkpoint/bytes": nbytes}, state.step)
        return final

    def _agree(self, fn, what: str):
        """Run fn on every rank; if it fails anywhere, every rank raises (nobody hangs in a barrier)."""
        err, out = None, None
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
            err = e
        failed = ckpt_files.reduce_max(torch.tensor([int(err is not None)]), self.strategy.acc.device)
        if err is not None:
            if _disk_full(err):
                prev = self.latest_path()
                raise CheckpointError(f"{what} failed: disk full (no space left on {self.root}); "
                                      + (f"the previous checkpoint {prev} is intact; " if prev else "")
                                      + "free space or point train.run_dir at a larger disk, then --resume auto") \
                    from None
            if isinstance(err, (OSError, CheckpointError)) or type(err).__name__ == "SafetensorError":
                raise CheckpointError(f"{what} failed: {err}") from None
            raise err  # a bug, not the disk: keep the traceback
        if int(failed[0]):
            raise CheckpointError(f"{what} failed on another rank (see its error)")
        return out

    def _write_rank_files(self, tmp: Path, state) -> dict:
        split, sources = self._layout()
        records = {}
        for fname, keys in split.filename_to_tensors.items():
            tensors = {k: self._piece(sources[k]) for k in keys}
            records[fname] = ckpt_files.save_tensors(tensors, tmp / fname)
            del tensors
            testhooks.fire("saved_file", step=state.step, rank=self.rank)  # ZEROTRAIN_INJECT_KILL_IN_SAVE (train/testhooks.py)
        rng_name = f"rng/rank{self.rank:05d}.json"
        records[rng_name] = ckpt_files.write_json(tmp / rng_name, ckpt_files.rng_state())
        if self.is_main:
            records[ckpt_files.META] = ckpt_files.write_json(tmp / ckpt_files.META, self._meta(state))
        return records

    def _layout(self):
        """This rank's files (huggingface_hub's split at max_shard_size) and where each piece
        comes from: (slot, kind), or a persistent buffer (rank 0)."""
        from huggingface_hub import split_torch_state_dict_into_shards
        sources, skeleton = {}, {}
        for s in self.holder.slots:
            a, b = s.save
            if b <= a or not self._saved(s):
                continue
            for kind in ("param",) + (MOMENTS if s.trainable else ()):
                key = ckpt_files.piece_key(kind, s.name, a)
                sources[key] = (s, kind)
                skeleton[key] = torch.empty(b - a, dtype=torch.float32, device="meta")
        if self.is_main:
            for name, buf in persistent_buffers(self.raw_model):
                key = ckpt_files.piece_key("buffer", name, 0)
                sources[key] = buf
                skeleton[key] = torch.empty(buf.numel(), dtype=buf.dtype, device="meta")
        # Files of at most max_shard_size: the host copy of one file is the save's extra memory.
        split = split_torch_state_dict_into_shards(skeleton, filename_pattern=f"rank{self.rank:05d}{{suffix}}.safetensors",
                                                   max_shard_size=self.cfg.max_shard_size)
        return split, sources

    # ------------------------------------------------------------------ asynchronous save (checkpoint.async)
    def _save_async(self, state) -> Path:
        """Wait for the previous write if it is still running (logged), agree on the directory
        (as a synchronous save does), copy this rank's state into the host buffers, and start
        writing them in the background. Committing comes later (`poll` / `flush`)."""
        t0 = time.perf_counter()
        waited = self.flush(state.step)
        name = ckpt_files.step_dir_name(state.step)
        final, tmp = self.root / name, self.root / (ckpt_files.TMP_PREFIX + name)

        self._agree(lambda: self._new_tmp_dir(tmp), f"creating {tmp}")
        files, rng, meta = self._snapshot(state)
        self._saves += 1
        self._pending = BackgroundWrite(
            seq=self._saves, step=state.step, tmp=tmp, final=final, blocked_s=time.perf_counter() - t0,
            waited_s=waited, work=lambda w: self._write_snapshot(w, files, rng, meta), disk_full=_disk_full).start()
        return final

    def _snapshot(self, state) -> tuple[dict, dict, dict | None]:
        """This rank's pieces in the reused host buffers ({file: {key: tensor}}), its RNG streams
        and (rank 0) the metadata, all as of this step boundary."""
        if self._staging is None:
            self._staging = Staging(self.strategy.acc.device)
        split, sources = self._layout()
        st = self._staging
        st.begin()
        files = {}
        with torch.no_grad():
            for fname, keys in split.filename_to_tensors.items():
                files[fname] = {}
                for k in keys:
                    src = sources[k]
                    if isinstance(src, tuple):
                        slot, kind = src
                        a, b = slot.save
                        files[fname][k] = st.copy(k, self.holder.source(slot, kind), b - a)
                    else:  # a persistent buffer, in its own dtype
                        files[fname][k] = st.copy(k, src, src.numel(), src.dtype)
        st.end()
        meta = json.loads(json.dumps(self._meta(state), default=str)) if self.is_main else None
        return files, ckpt_files.rng_state(), meta

    @property
    def snapshot_bytes(self) -> int:
        """Host memory the asynchronous saves keep (0 before the first one)."""
        return self._staging.nbytes if self._staging else 0

    def _write_snapshot(self, w: BackgroundWrite, files: dict, rng: dict, meta: dict | None) -> dict:
        """In the writer thread: the files a synchronous save writes, from the snapshot, each
        fsynced, then this rank's part list. On failure this rank's files are removed again
        (a full disk gets its space back at once)."""
        self._staging.ready()
        written = []
        try:
            records = {}
            for fname, tensors in files.items():
                written.append(w.tmp / fname)
                records[fname] = ckpt_files.save_tensors(tensors, w.tmp / fname)
                testhooks.fire("saved_file", step=w.step, rank=self.rank)  # ZEROTRAIN_INJECT_KILL_IN_SAVE
                testhooks.fire("writing", step=w.step, waiting=w.waiting)  # ZEROTRAIN_INJECT_SIGTERM_IN_WRITE
            rng_name = f"rng/rank{self.rank:05d}.json"
            written.append(w.tmp / rng_name)
            records[rng_name] = ckpt_files.write_json(w.tmp / rng_name, rng)
            if meta is not None:
                written.append(w.tmp / ckpt_files.META)
                records[ckpt_files.META] = ckpt_files.write_json(w.tmp / ckpt_files.META, meta)
            written.append(w.tmp / f".part-rank{self.rank:05d}.json")
            ckpt_files.write_json(written[-1], records)
            return records
        except BaseException:
            for p in written:
                try:
                    p.unlink()
                except OSError:
                    pass
            raise

    def write_status(self) -> tuple:
        """This rank's part of the loop's vote about the write in flight (BackgroundWrite.status)."""
        return self._pending.status() if self._pending is not None else (0.0, 0.0, 0.0, 0.0)

    def poll(self, writes: tuple, step: int) -> None:
        """The vote's sum over the ranks (every rank reads the same one at the same step): once
        every rank's write of the save in flight has ended, commit it (rank 0) or report it."""
        w = self._pending
        if w is None:
            return
        seq, ok, failed, disk_full = writes
        if seq != w.seq * self.world or ok + failed < self.world:
            return  # a vote about an earlier save, or writes still running
        self._resolve(w, failed > 0, disk_full > 0, step)

    def flush(self, step: int) -> float:
        """Wait for this rank's write in flight (logged), agree with the others on the outcome
        (a collective: every rank calls it at the same step), then commit or report it.
        Returns the seconds waited."""
        w = self._pending
        if w is None:
            return 0.0
        waited = w.wait()
        if waited > 0:
            self._say(f"checkpoint {w.final.name}: waited {waited:.2f} s for its background write")
        err = w.error
        failed = ckpt_files.reduce_max(torch.tensor([int(err is not None), int(err is not None and _disk_full(err))]),
                                       self.strategy.acc.device)
        self._resolve(w, bool(failed[0]), bool(failed[1]), step, waited)
        return waited

    def _resolve(self, w: BackgroundWrite, failed: bool, disk_full: bool, step: int, waited: float = 0.0) -> None:
        """Every rank, at the same step: commit (rank 0) or report the write; `step` is the
        loop's step now (the metrics row), the checkpoint's is checkpoint/step."""
        self._pending = None
        if w.error is not None and not _io_error(w.error):
            print(f"zerotrain: rank {self.rank}: the background checkpoint write failed:\n{w.trace}",
                  file=sys.stderr, flush=True)  # a bug, not the disk: keep the traceback
        if failed:
            # One line for a full disk (whichever ranks hit it): rank 0's. Another error is also
            # reported by the rank it happened on.
            if self.is_main:
                ckpt_files.remove_tree(w.tmp)
                why = (f"disk full (no space left on {self.root})" if disk_full
                       else _describe(w.error, self.root) if w.error is not None
                       else "its write failed on another rank (that rank's line says why)")
                self._warn_not_saved(w, why)
            elif w.error is not None and not disk_full:
                print(f"zerotrain: WARNING: rank {self.rank}: checkpoint {w.final} was not saved: "
                      f"{_describe(w.error, self.root)}", flush=True)
            return
        nbytes = 0
        if self.is_main:
            try:
                nbytes = self._commit(w.tmp, w.final, w.step)
            except (OSError, CheckpointError) as e:
                ckpt_files.remove_tree(w.tmp)
                self._warn_not_saved(w, _describe(e, self.root))
                return
        self._last_saved = w.final
        if self.is_main:
            self._say(f"checkpoint {w.final} saved ({nbytes / 2**20:.1f} MiB; the loop was blocked {w.blocked_s:.2f} s, "
                      f"written in the background in {w.write_s:.2f} s)")
            self.log({"checkpoint/step": w.step, "checkpoint/save_s": w.blocked_s, "checkpoint/write_s": w.write_s,
                      "checkpoint/wait_s": w.waited_s + waited, "checkpoint/bytes": nbytes,
                      "checkpoint/snapshot_bytes": self.snapshot_bytes}, step)

    def _warn_not_saved(self, w: BackgroundWrite, why: str) -> None:
        prev = self.latest_path()
        print(f"zerotrain: WARNING: checkpoint {w.final} was not saved: {why}; "
              + (f"the previous checkpoint {prev} is kept; " if prev else "")
              + "training goes on and the next save tries again", flush=True)

    def close(self) -> None:
        """Wait for the write in flight (no collective: also after a failure on some ranks); a
        write never committed leaves only a `.tmp-` directory, which no resume picks."""
        if self._pending is not None:
            self._pending.wait()

    @property
    def lora(self) -> dict | None:
        """The LoRA adapter (models/lora.py) when model.lora is set: then only trained tensors are saved."""
        return self.workload.lora

    def _saved(self, slot) -> bool:
        """Whether a checkpoint holds this parameter: all of them, except a LoRA run's frozen base
        (re-read from its weights directory on resume: checkpoints are adapter-sized)."""
        return slot.trainable or self.lora is None

    def _piece(self, src) -> torch.Tensor:
        if isinstance(src, tuple):
            slot, kind = src
            return self.holder.read(slot, kind)
        return src.detach().reshape(-1).cpu().clone()

    def _commit(self, tmp: Path, final: Path, step: int) -> int:
        files = {}
        for r in range(self.world):
            part = tmp / f".part-rank{r:05d}.json"
            if not part.is_file():
                raise CheckpointError(f"rank {r}'s files are not visible from rank 0 in {tmp}: every node must write "
                                      f"to the same filesystem; put train.run_dir on shared storage")
            files.update(ckpt_files.read_json(part, "checkpoint part list"))
        ckpt_files.write_json(tmp / ckpt_files.MANIFEST, {"format": ckpt_files.FORMAT, "version": ckpt_files.VERSION,
                                                          "step": step, "world_size": self.world,
                                                          "files": dict(sorted(files.items()))})
        for r in range(self.world):
            (tmp / f".part-rank{r:05d}.json").unlink()
        ckpt_files.fsync_path(tmp / "rng")
        ckpt_files.fsync_path(tmp)
        old = None
        if final.exists():  # the same step saved again (e.g. after resuming): replace it whole
            old = final.with_name(ckpt_files.TMP_PREFIX + "old-" + final.name)
            ckpt_files.remove_tree(old)
            os.rename(final, old)
        os.rename(tmp, final)
        ckpt_files.fsync_path(self.root)
        ckpt_files.replace_text(self.root / ckpt_files.LATEST, final.name + "\n")
        if old is not None:
            ckpt_files.remove_tree(old)
        self.prune(keep_step=step)
        return sum(f["size"] for f in files.values())

    def prune(self, keep_step: int | None = None):
        """Delete all but the newest `keep_last` complete checkpoints up to `keep_step` (rank 0).
        Later steps (left by an attempt this run was resumed before) are kept but no longer
        `latest`, so --resume auto does not jump back to them."""
        if not self.is_main:
            return
        done = [(s, d) for s, d in ckpt_files.complete_checkpoints(self.root) if keep_step is None or s <= keep_step]
        for _, d in done[:-self.cfg.keep_last]:
            ckpt_files.remove_tree(d)

    def _meta(self, state) -> dict:
        h, wl, sampler = self.holder, self.workload, self.sampler
        return {
            "format": ckpt_files.FORMAT, "version": ckpt_files.VERSION, "step": state.step,
            "train_state": state.to_dict(),
            "world_size": self.world, "holder": h.name,
            "strategy": self.strategy.record(),
            "params": {s.name: {"shape": list(s.shape), "trainable": s.trainable,
                                **({"optimizer_step": h.step_of(s)} if s.trainable else {})}
                       for s in h.slots if self._saved(s)},
            **({"lora": adapter.checkpoint_meta(self.lora, [s for s in h.slots if not self._saved(s)])}
               if self.lora is not None else {}),
            "buffers": {n: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
                        for n, b in persistent_buffers(self.raw_model)},
            "moments": list(MOMENTS),
            "model": {"family": wl.family, "config": wl.model_config, "tied": [list(x) for x in wl.tied]},
            "data": {"global_batch": sampler.global_batch, "num_samples": sampler.num_samples,
                     "steps_per_epoch": sampler.steps_per_epoch, "seed": sampler.seed,
                     **({"mixture": sampler.plan.record()} if getattr(sampler, "plan", None) else {})},
            "state": {name: c.state_dict() for name, c in self.components.items()},
            "config": self.resolved_config,
        }

    # ------------------------------------------------------------------ load
    def resume(self, spec: str, load_optimizer: bool = True) -> TrainState | None:
        """checkpoint.resume: "none", "auto" (newest complete checkpoint of this run, if any) or a path.
        Returns the restored TrainState, or None when there was nothing to resume."""
        if spec == "none":
            return None
        if spec == "auto":
            ckpt = ckpt_files.newest_checkpoint(self.root)
            if ckpt is None:
                self._say(f"--resume auto: no checkpoint in {self.root} yet, starting from scratch")
                return None
        else:
            ckpt = ckpt_files.resolve_checkpoint(spec)
        return self.load(ckpt, load_optimizer)

    def load(self, path, load_optimizer: bool = True) -> TrainState:
        """Restores the tensors, engine counters and loss scale in place; returns the TrainState
        (step, data position) the run continues from."""
        t0 = time.perf_counter()
        ckpt = ckpt_files.resolve_checkpoint(path)
        manifest = ckpt_files.read_manifest(ckpt)
        ckpt_files.verify(ckpt, manifest, self.rank, self.world, self.strategy.acc.device)
        meta = ckpt_files.read_json(ckpt / ckpt_files.META, "checkpoint metadata")
        self._check_fits(ckpt, meta)
        reader = ckpt_files.PieceReader([ckpt / f for f in manifest["files"] if f.endswith(".safetensors")])
        try:
            self._restore_tensors(reader, meta, load_optimizer)
        finally:
            reader.close()
        st = self._restore_counters(meta)
        rng = ckpt / "rng" / f"rank{self.rank:05d}.json"
        # RNG streams only mean something for the same ranks; another world size keeps fresh seeds.
        same_ranks = meta["world_size"] == self.world and rng.is_file()
        self._pending_rng = ckpt_files.read_json(rng, "RNG state") if same_ranks else None
        _barrier()
        self.resumed_from = ckpt
        how = "" if load_optimizer else " (weights only: fresh optimizer moments)"
        self._say(f"resumed from {ckpt}{how}: step {st.step}, epoch {st.epoch} (+{st.offset} samples), "
                  f"saved by {meta['world_size']} process(es) [{meta['holder']}], loaded in "
                  f"{time.perf_counter() - t0:.2f} s")
        return st

    def _check_fits(self, ckpt: Path, meta: dict):
        adapter.check_resume(ckpt, meta.get("lora"), self.lora)
        want = {n: tuple(p["shape"]) for n, p in meta["params"].items()}
        want.update({n: tuple(shape) for n, shape in (meta.get("lora") or {}).get("frozen", {}).items()})
        have = {s.name: tuple(s.shape) for s in self.holder.slots}
        diff = shape_mismatch(want, have, "checkpoint", "model")
        if diff:
            raise CheckpointError(f"checkpoint {ckpt} does not fit model {self.model_name!r}:\n{diff}\n"
                                  f"resume with the model settings it was trained with (see {ckpt / ckpt_files.META})")
        d, s, b = meta["data"], self.sampler, self.batch
        if d["num_samples"] != s.num_samples:
            raise CheckpointError(f"checkpoint {ckpt} was trained on {d['num_samples']} training samples, this run has "
                                  f"{s.num_samples}: its data position does not apply; use the same data settings, or "
                                  f"start a new run from its weights with model.init_from")
        if d["global_batch"] != s.global_batch:
            raise CheckpointError(
                f"checkpoint {ckpt} was trained with a global batch of {d['global_batch']} samples, this run has "
                f"{s.global_batch} (micro {b.micro} x accum {b.accum} x world "
                f"{b.world}); set --train.global_batch_size {d['global_batch']} (any number of processes "
                f"then reads the same data order)")
        plan = getattr(s, "plan", None)
        if (d.get("mixture") or None) != (plan.record() if plan else None):
            self._say("warning: the checkpoint's data.sources mixture (names, weights, sizes) differs from this "
                      "run's: the rest of the epoch follows this run's mixture")
        if d["seed"] != s.seed:
            self._say(f"warning: the checkpoint used train.seed {d['seed']}, this run {s.seed}: "
                      f"the rest of the epoch sees a different data order")

    def _restore_tensors(self, reader, meta: dict, load_optimizer: bool):
        h = self.holder
        moments = load_optimizer
        h.begin_load()
        if moments:
            h.prepare_moments()
        with torch.no_grad():
            for s in h.slots:
                src = meta["params"].get(s.name)
                if src is None:
                    continue  # a LoRA checkpoint's frozen base: its weights came from the base directory
                a, b = s.need
                if b > a:
                    h.write(s, "param", reader.read("param", s.name, a, b))
                if not (moments and s.trainable and src.get("trainable")):
                    continue  # a parameter frozen in the checkpoint keeps fresh moments here
                if b > a:
                    for kind in MOMENTS:
                        h.write(s, kind, reader.read(kind, s.name, a, b))
                h.set_step(s, src["optimizer_step"])
            for name, buf in persistent_buffers(self.raw_model):
                if reader.has("buffer", name):
                    buf.copy_(reader.read("buffer", name, 0, buf.numel(), buf.dtype).view_as(buf))
        h.finish_load()

    def _restore_counters(self, meta: dict) -> TrainState:
        """The saved TrainState, then every registered component's state (the engine's step
        counters and loss scale, ...): a component the checkpoint has no record of gets {}."""
        known = TrainState.__dataclass_fields__
        st = TrainState(**{k: v for k, v in meta["train_state"].items() if k in known})
        saved = ckpt_files.component_states(meta)
        for name, component in self.components.items():
            component.load_state_dict(saved.get(name) or {}, st)
        return st

    def on_fit_start(self):
        """Restore RNG streams at the last moment before the first step (nothing in between may draw)."""
        if self._pending_rng is not None:
            ckpt_files.set_rng_state(self._pending_rng)
            self._pending_rng = None

    # ------------------------------------------------------------------ weights
    def init_from(self, path: str):
        """model.init_from: exported weights (any world size / stage), optimizer untouched."""
        from zerotrain.train.checkpoint.weights import WeightsReader
        w = WeightsReader(path, what="model.init_from")
        tied = self.workload.tied
        w.add_ties(tied)
        h = self.holder
        # A LoRA run takes the frozen base from the weights, under the base model's names; the
        # adapters keep their fresh initialisation (or what a resume then loads).
        slots = [s for s in h.slots if not (self.lora and is_adapter(s.name))]
        source = base_name if self.lora else (lambda n: n)
        have = {source(s.name): tuple(s.shape) for s in slots}
        have.update({n: tuple(b.shape) for n, b in persistent_buffers(self.raw_model)})
        found = w.shapes(ignore={alias for alias, _ in tied})
        diff = shape_mismatch(have, found, "model", "weights")
        if diff:
            raise ConfigError(f"model.init_from {path} does not match model {self.model_name!r}:\n{diff}\n"
                              f"point model.init_from at weights exported from the same architecture")
        h.begin_load()
        with torch.no_grad():
            for s in slots:
                a, b = s.need
                if b > a:
                    h.write(s, "param", w.read(source(s.name), a, b))
            for name, buf in persistent_buffers(self.raw_model):
                buf.copy_(w.read(name, 0, buf.numel(), buf.dtype).view_as(buf))
        h.finish_load()
        w.close()
        _barrier()
        self._say(f"initialised {'the frozen base ' if self.lora else ''}weights from {path} ({len(slots)} tensors)")

    def export(self, out_dir: str | Path | None = None) -> str:
        """Consolidated weights (HF layout; a LoRA run's adapter) from the live state
        (train/checkpoint/consolidate.py): a collective, every rank calls it."""
        from zerotrain.train.checkpoint.consolidate import export_adapter, export_weights
        t0 = time.perf_counter()
        out = Path(out_dir) if out_dir else self.export_dir
        dtype = self.cfg.export_dtype
        if self.lora is not None:
            n = export_adapter(out, self.holder, self.lora, dtype, self.is_main)
            _barrier()
            self._say(f"exported the {dtype} LoRA adapter ({n} tensors) to {out} in "
                      f"{time.perf_counter() - t0:.2f} s (zerotrain export --merge: full merged weights)")
            return str(out)
        export_weights(out, self.holder, self.raw_model, self.workload, self.cfg, self.is_main)
        _barrier()
        self._say(f"exported {dtype} weights to {out} in {time.perf_counter() - t0:.2f} s")
        return str(out)

    def latest_path(self) -> str | None:
        if self._last_saved is not None:
            return str(self._last_saved)
        found = ckpt_files.newest_checkpoint(self.root)
        return str(found) if found else None
