"""What every save writes, and the synchronous save (the Checkpointer's `save` without
checkpoint.async; the asynchronous one is train/checkpoint/async_save.py).

This rank's part of a checkpoint: the pieces of the parameters and moments it owns
(`layout`: which file holds which piece, split at max_shard_size; `piece`: a piece's tensor),
its RNG streams, and on rank 0 the persistent buffers and meta.json (`meta`). Every rank writes
into `.tmp-step_X` and lists what it wrote (`.part-rank<R>.json`); rank 0 then commits: the
manifest (sizes + sha256) last, the directory renamed into place, `latest` moved, older
checkpoints pruned. Layout and guarantees: docs/checkpoints.md.

The Saver works on the state of its Checkpointer (train/checkpoint/manager.py), which owns what
the run hands a checkpoint.
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import torch

from zerotrain.train import testhooks
from zerotrain.train.checkpoint import adapter
from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.checkpoint.files import MOMENTS, persistent_buffers
from zerotrain.train.errors import CheckpointError


def disk_full(err: BaseException) -> bool:
    # safetensors reports ENOSPC as SafetensorError("... No space left on device (os error 28)").
    return (isinstance(err, OSError) and err.errno == errno.ENOSPC) or "(os error 28)" in str(err)


def io_error(err: BaseException) -> bool:
    return isinstance(err, (OSError, CheckpointError)) or type(err).__name__ == "SafetensorError"


NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # permission denied, not permitted, read-only mount


def not_writable(err: BaseException) -> bool:
    """A write refused by permissions or a read-only mount (safetensors reports it as "(os error N)")."""
    return (isinstance(err, OSError) and err.errno in NOT_WRITABLE) or \
        any(f"(os error {n})" in str(err) for n in NOT_WRITABLE)


def unwritable(path: Path, err: BaseException) -> str:
    """What a user reads for a directory the run cannot write into: the path, why, and the two fixes."""
    why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return (f"{path} is not writable ({why}); make it writable (fix its permissions or owner, or remount it "
            f"read-write) or point --train.run_dir at a writable directory")


def describe(err: BaseException, root: Path) -> str:
    if disk_full(err):
        return f"disk full (no space left on {root})"
    if not_writable(err):
        return f"the checkpoint directory {unwritable(root, err)}"
    return str(err) if io_error(err) else f"{type(err).__name__}: {err}"


def part_list(tmp: Path, rank: int) -> Path:
    """Rank `rank`'s list of the files it wrote ({file: size, sha256}), read by rank 0's commit."""
    return tmp / f".part-rank{rank:05d}.json"


class Saver:
    """The synchronous save of the Checkpointer `ck`, the layout and metadata every save (also an
    asynchronous one) writes, the commit and the pruning."""

    def __init__(self, ck):
        self.ck = ck

    def save(self, state) -> Path:
        ck = self.ck
        t0 = time.perf_counter()
        name = ckpt_files.step_dir_name(state.step)
        final, tmp = ck.root / name, ck.root / (ckpt_files.TMP_PREFIX + name)

        # Each _on_every_rank ends in a collective: the directory exists before anyone writes,
        # every rank's files are durable before rank 0 declares the checkpoint complete, and
        # nobody returns before it is.
        try:
            ck._on_every_rank(lambda: self.new_tmp_dir(tmp), f"creating {tmp}")
            ck._on_every_rank(lambda: ckpt_files.write_json(part_list(tmp, ck.rank), self.write_rank_files(tmp, state)),
                              f"writing checkpoint {final}")
            nbytes = ck._on_every_rank(lambda: self.commit(tmp, final, state.step) if ck.is_main else 0,
                                       f"completing checkpoint {final}")
        except CheckpointError:
            if ck.is_main and tmp.exists():  # give the space back; `latest` still names the previous save
                ckpt_files.remove_tree(tmp)
            raise
        ck._last_saved = final
        dt = time.perf_counter() - t0
        if ck.is_main:
            ck._say(f"checkpoint {final} saved ({nbytes / 2**20:.1f} MiB in {dt:.2f} s)")
            ck.log({"checkpoint/save_s": dt, "checkpoint/bytes": nbytes}, state.step)
        return final

    def new_tmp_dir(self, tmp: Path) -> None:
        """Rank 0: the save's .tmp- directory, after removing any a killed save left."""
        root = self.ck.root
        if self.ck.is_main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(ckpt_files.TMP_PREFIX + "*"):  # left by a save that was killed
                ckpt_files.remove_tree(stale)
            tmp.mkdir()

    def write_rank_files(self, tmp: Path, state) -> dict:
        ck = self.ck
        split, sources = self.layout()
        records = {}
        for fname, keys in split.filename_to_tensors.items():
            tensors = {k: self.piece(sources[k]) for k in keys}
            records[fname] = ckpt_files.save_tensors(tensors, tmp / fname)
            del tensors
            testhooks.fire("saved_file", step=state.step, rank=ck.rank)  # ZEROTRAIN_INJECT_KILL_IN_SAVE (train/testhooks.py)
        rng_name = ckpt_files.rng_file(ck.rank)
        records[rng_name] = ckpt_files.write_json(tmp / rng_name, ckpt_files.rng_state())
        if ck.is_main:
            records[ckpt_files.META] = ckpt_files.write_json(tmp / ckpt_files.META, self.meta(state))
        return records

    # ------------------------------------------------------------------ what this rank saves
    def saved(self, slot) -> bool:
        """Whether a checkpoint holds this parameter: all of them, except a LoRA run's frozen base
        (re-read from its weights directory on resume: checkpoints are adapter-sized)."""
        return slot.trainable or self.ck.lora is None

    def layout(self):
        """This rank's files (huggingface_hub's split at max_shard_size) and where each piece
        comes from: (slot, kind), or a persistent buffer (rank 0)."""
        from huggingface_hub import split_torch_state_dict_into_shards
        ck = self.ck
        sources, skeleton = {}, {}
        for s in ck.holder.slots:
            a, b = s.save
            if b <= a or not self.saved(s):
                continue
            extra = [kind for kind in ck.tensor_owners if self.source(s, kind) is not None] if s.trainable else []
            for kind in ("param",) + (MOMENTS if s.trainable else ()) + tuple(extra):
                key = ckpt_files.piece_key(kind, s.name, a)
                sources[key] = (s, kind)
                skeleton[key] = torch.empty(b - a, dtype=torch.float32, device="meta")
        if ck.is_main:
            for name, buf in persistent_buffers(ck.raw_model):
                key = ckpt_files.piece_key("buffer", name, 0)
                sources[key] = buf
                skeleton[key] = torch.empty(buf.numel(), dtype=buf.dtype, device="meta")
        # Files of at most max_shard_size: the host copy of one file is the save's extra memory.
        split = split_torch_state_dict_into_shards(skeleton, filename_pattern=f"rank{ck.rank:05d}{{suffix}}.safetensors",
                                                   max_shard_size=ck.cfg.max_shard_size)
        return split, sources

    def source(self, slot, kind: str) -> torch.Tensor | None:
        """The elements slot.save of `kind` as held (uncopied): the holder's master value and
        moments, or a registered component's tensor (train/checkpoint/state.py TensorState: it
        holds slot.need, of which slot.save is a part). None: no such state (yet)."""
        owner = self.ck.tensor_owners.get(kind)
        if owner is None:
            return self.ck.holder.source(slot, kind)
        t = owner.tensor(kind, slot)
        if t is None:
            return None
        a, b = slot.save
        return t[a - slot.need[0]:b - slot.need[0]]

    def piece(self, src) -> torch.Tensor:
        """The tensor of one of layout()'s sources, read now (a synchronous save)."""
        if isinstance(src, tuple):
            slot, kind = src
            if kind in self.ck.tensor_owners:  # an owned fp32 CPU copy, as Holder.read makes
                return self.source(slot, kind).detach().to("cpu", torch.float32, copy=True).reshape(-1)
            return self.ck.holder.read(slot, kind)
        return src.detach().reshape(-1).cpu().clone()

    def meta(self, state) -> dict:
        """meta.json (rank 0): the TrainState, what the tensors are, the model, the data order, the
        registered components' state and the resolved config."""
        ck = self.ck
        h, wl, sampler = ck.holder, ck.workload, ck.sampler
        return {
            "format": ckpt_files.FORMAT, "version": ckpt_files.VERSION, "step": state.step,
            "train_state": state.to_dict(),
            "world_size": ck.world, "holder": h.name,
            "strategy": ck.strategy.record(),
            "params": {s.name: {"shape": list(s.shape), "trainable": s.trainable,
                                **({"optimizer_step": h.step_of(s)} if s.trainable else {})}
                       for s in h.slots if self.saved(s)},
            **({"lora": adapter.checkpoint_meta(ck.lora, [s for s in h.slots if not self.saved(s)])}
               if ck.lora is not None else {}),
            "buffers": {n: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
                        for n, b in persistent_buffers(ck.raw_model)},
            "moments": list(MOMENTS),
            "tensors": {kind: owner.name for kind, owner in ck.tensor_owners.items()},
            "model": {"family": wl.family, "config": wl.model_config, "tied": [list(x) for x in wl.tied]},
            "data": {"global_batch": sampler.global_batch, "num_samples": sampler.num_samples,
                     "steps_per_epoch": sampler.steps_per_epoch, "seed": sampler.seed,
                     **({"mixture": sampler.plan.record()} if getattr(sampler, "plan", None) else {})},
            "state": {name: c.state_dict() for name, c in ck.registered.items()},
            "config": ck.resolved_config,
        }

    # ------------------------------------------------------------------ commit and prune (rank 0)
    def commit(self, tmp: Path, final: Path, step: int) -> int:
        """Rank 0, once every rank's files are durable: the manifest, the rename into place,
        `latest`, the pruning. Returns the checkpoint's bytes."""
        ck = self.ck
        files = {}
        for r in range(ck.world):
            part = part_list(tmp, r)
            if not part.is_file():
                raise CheckpointError(f"rank {r}'s files are not visible from rank 0 in {tmp}: every node must write "
                                      f"to the same filesystem; put train.run_dir on shared storage")
            files.update(ckpt_files.read_json(part, "checkpoint part list"))
        ckpt_files.write_json(tmp / ckpt_files.MANIFEST, {"format": ckpt_files.FORMAT, "version": ckpt_files.VERSION,
                                                          "step": step, "world_size": ck.world,
                                                          "files": dict(sorted(files.items()))})
        for r in range(ck.world):
            part_list(tmp, r).unlink()
        ckpt_files.fsync_path(tmp / "rng")
        ckpt_files.fsync_path(tmp)
        old = None
        if final.exists():  # the same step saved again (e.g. after resuming): replace it whole
            old = final.with_name(ckpt_files.TMP_PREFIX + "old-" + final.name)
            ckpt_files.remove_tree(old)
            os.rename(final, old)
        os.rename(tmp, final)
        ckpt_files.fsync_path(ck.root)
        ckpt_files.replace_text(ck.root / ckpt_files.LATEST, final.name + "\n")
        if old is not None:
            ckpt_files.remove_tree(old)
        self.prune(keep_step=step)
        return sum(f["size"] for f in files.values())

    def prune(self, keep_step: int | None = None):
        """Delete all but the newest `keep_last` complete checkpoints up to `keep_step` (rank 0).
        Later steps (left by an attempt this run was resumed before) are kept but no longer
        `latest`, so --resume auto does not jump back to them."""
        ck = self.ck
        if not ck.is_main:
            return
        done = [(s, d) for s, d in ckpt_files.complete_checkpoints(ck.root) if keep_step is None or s <= keep_step]
        for _, d in done[:-ck.cfg.keep_last]:
            ckpt_files.remove_tree(d)
