"""checkpoint.async: the save protocol of the Checkpointer when saves are written in the background.

A save copies this rank's state into reused host buffers at the step boundary (`snapshot`) and
writes the same files a synchronous save writes (train/checkpoint/save.py) in a background thread
(train/checkpoint/background.py: `Staging`, `BackgroundWrite`) while training goes on. Ranks
learn that every write is durable from the loop's per-step vote (`write_status`, `poll`: no
collective of its own), or, when the next save, the last step or a stop comes first, by waiting
for it (`flush`: one collective, at a save); only then does rank 0 commit (manifest, rename,
`latest`). A failed write is one warning line; the previous checkpoint stays `latest`.
Lifecycle and guarantees: docs/checkpoints.md "Asynchronous saves".
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from zerotrain.train import testhooks
from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.checkpoint.background import BackgroundWrite, Staging
from zerotrain.train.checkpoint.save import describe, disk_full, io_error, part_list
from zerotrain.train.errors import CheckpointError


class AsyncSaver:
    """The asynchronous saves of the Checkpointer `ck`: the host snapshot, the write in flight and
    its outcome. Keeps what lives from one save to the next: the host buffers and the write."""

    def __init__(self, ck):
        self.ck = ck
        self.staging: Staging | None = None
        self.pending: BackgroundWrite | None = None
        self.saves = 0  # asynchronous saves started: the same number on every rank
        # Why the newest save settled failed (None once a later one is committed): what the end
        # of the run reports instead of success (Checkpointer.unsaved_at_end).
        self.lost: str | None = None

    def save(self, state) -> Path:
        """Wait for the previous write if it is still running (logged), agree on the directory
        (as a synchronous save does), copy this rank's state into the host buffers, and start
        writing them in the background. Committing comes later (`poll` / `flush`)."""
        ck = self.ck
        t0 = time.perf_counter()
        waited = self.flush(state.step)
        name = ckpt_files.step_dir_name(state.step)
        final, tmp = ck.root / name, ck.root / (ckpt_files.TMP_PREFIX + name)

        ck._on_every_rank(lambda: ck.saver.new_tmp_dir(tmp), f"creating {tmp}")
        files, rng, meta = self.snapshot(state)
        self.saves += 1
        self.pending = BackgroundWrite(
            seq=self.saves, step=state.step, tmp=tmp, final=final, blocked_s=time.perf_counter() - t0,
            waited_s=waited, work=lambda w: self.write_snapshot(w, files, rng, meta), disk_full=disk_full).start()
        return final

    def snapshot(self, state) -> tuple[dict, dict, dict | None]:
        """This rank's pieces in the reused host buffers ({file: {key: tensor}}), its RNG streams
        and (rank 0) the metadata, all as of this step boundary."""
        ck = self.ck
        if self.staging is None:
            self.staging = Staging(ck.strategy.acc.device)
        split, sources = ck.saver.layout()
        st = self.staging
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
                        files[fname][k] = st.copy(k, ck.saver.source(slot, kind), b - a)
                    else:  # a persistent buffer, in its own dtype
                        files[fname][k] = st.copy(k, src, src.numel(), src.dtype)
        st.end()
        meta = json.loads(json.dumps(ck.saver.meta(state), default=str)) if ck.is_main else None
        return files, ckpt_files.rng_state(), meta

    @property
    def snapshot_bytes(self) -> int:
        """Host memory the asynchronous saves keep (0 before the first one)."""
        return self.staging.nbytes if self.staging else 0

    def write_snapshot(self, w: BackgroundWrite, files: dict, rng: dict, meta: dict | None) -> dict:
        """In the writer thread: the files a synchronous save writes, from the snapshot, each
        fsynced, then this rank's part list. On failure this rank's files are removed again
        (a full disk gets its space back at once)."""
        rank = self.ck.rank
        self.staging.ready()
        written = []
        try:
            records = {}
            for fname, tensors in files.items():
                written.append(w.tmp / fname)
                records[fname] = ckpt_files.save_tensors(tensors, w.tmp / fname)
                testhooks.fire("saved_file", step=w.step, rank=rank)  # ZEROTRAIN_INJECT_KILL_IN_SAVE
                testhooks.fire("writing", step=w.step, waiting=w.waiting)  # ZEROTRAIN_INJECT_SIGTERM_IN_WRITE
            rng_name = ckpt_files.rng_file(rank)
            written.append(w.tmp / rng_name)
            records[rng_name] = ckpt_files.write_json(w.tmp / rng_name, rng)
            if meta is not None:
                written.append(w.tmp / ckpt_files.META)
                records[ckpt_files.META] = ckpt_files.write_json(w.tmp / ckpt_files.META, meta)
            written.append(part_list(w.tmp, rank))
            ckpt_files.write_json(written[-1], records)
            return records
        except BaseException:
            for p in written:
                try:
                    p.unlink()
                except OSError:
                    pass
            raise

    # ------------------------------------------------------------------ the write's outcome
    def write_status(self) -> tuple:
        """This rank's part of the loop's vote about the write in flight (BackgroundWrite.status)."""
        return self.pending.status() if self.pending is not None else (0.0, 0.0, 0.0, 0.0)

    def poll(self, writes: tuple, step: int, last: bool = False) -> None:
        """The vote's sum over the ranks (every rank reads the same one at the same step): once
        every rank's write of the save in flight has ended, commit it (rank 0) or report it.
        `last`: no save follows in this run (the warning of a failure says so)."""
        w = self.pending
        if w is None:
            return
        seq, ok, failed, full = writes
        if seq != w.seq * self.ck.world or ok + failed < self.ck.world:
            return  # a vote about an earlier save, or writes still running
        self.resolve(w, failed > 0, full > 0, step, last=last)

    def flush(self, step: int, last: bool = False) -> float:
        """Wait for this rank's write in flight (logged), agree with the others on the outcome
        (a collective: every rank calls it at the same step), then commit or report it.
        `last`: the run's last step, no save follows. Returns the seconds waited."""
        w = self.pending
        if w is None:
            return 0.0
        waited = w.wait()
        if waited > 0:
            self.ck._say(f"checkpoint {w.final.name}: waited {waited:.2f} s for its background write")
        err = w.error
        failed = ckpt_files.reduce_max(torch.tensor([int(err is not None), int(err is not None and disk_full(err))]),
                                       self.ck.strategy.acc.device)
        self.resolve(w, bool(failed[0]), bool(failed[1]), step, waited, last=last)
        return waited

    def resolve(self, w: BackgroundWrite, failed: bool, full: bool, step: int, waited: float = 0.0,
                last: bool = False) -> None:
        """Every rank, at the same step: commit (rank 0) or report the write; `step` is the
        loop's step now (the metrics row), the checkpoint's is checkpoint/step. A failure is kept
        in `lost` until a later save commits (every rank, except a commit failing on rank 0 only:
        the end of the run agrees on it, Checkpointer.unsaved_at_end)."""
        ck = self.ck
        self.pending = None
        if w.error is not None and not io_error(w.error):
            print(f"zerotrain: rank {ck.rank}: the background checkpoint write failed:\n{w.trace}",
                  file=sys.stderr, flush=True)  # a bug, not the disk: keep the traceback
        if failed:
            # One line for a full disk (whichever ranks hit it): rank 0's. Another error is also
            # reported by the rank it happened on.
            why = (f"disk full (no space left on {ck.root})" if full
                   else describe(w.error, ck.root) if w.error is not None
                   else "its write failed on another rank (that rank's line says why)")
            self.lost = f"checkpoint {w.final.name} was not saved: {why}"
            if ck.is_main:
                ckpt_files.remove_tree(w.tmp)
                self.warn_not_saved(w, why, last)
            elif w.error is not None and not full:
                print(f"zerotrain: WARNING: rank {ck.rank}: checkpoint {w.final} was not saved: "
                      f"{describe(w.error, ck.root)}", flush=True)
            return
        nbytes = 0
        if ck.is_main:
            try:
                nbytes = ck.saver.commit(w.tmp, w.final, w.step)
            except (OSError, CheckpointError) as e:
                ckpt_files.remove_tree(w.tmp)
                self.lost = f"checkpoint {w.final.name} was not saved: {describe(e, ck.root)}"
                self.warn_not_saved(w, describe(e, ck.root), last)
                return
        ck._last_saved = w.final
        self.lost = None
        if ck.is_main:
            ck._say(f"checkpoint {w.final} saved ({nbytes / 2**20:.1f} MiB; the loop was blocked {w.blocked_s:.2f} s, "
                    f"written in the background in {w.write_s:.2f} s)")
            ck.log({"checkpoint/step": w.step, "checkpoint/save_s": w.blocked_s, "checkpoint/write_s": w.write_s,
                    "checkpoint/wait_s": w.waited_s + waited, "checkpoint/bytes": nbytes,
                    "checkpoint/snapshot_bytes": self.snapshot_bytes}, step)

    def warn_not_saved(self, w: BackgroundWrite, why: str, last: bool = False) -> None:
        """Rank 0's one line for a save that failed. `last`: no save follows (the run's last
        step): the run ends with an error instead (Checkpointer.unsaved_at_end)."""
        prev = self.ck.latest_path()
        print(f"zerotrain: WARNING: checkpoint {w.final} was not saved: {why}; "
              + (f"the previous checkpoint {prev} is kept; " if prev else "")
              + ("this was the run's last save: it ends with an error" if last
                 else "training goes on and the next save tries again"), flush=True)

    def close(self) -> None:
        """Wait for the write in flight (no collective: also after a failure on some ranks); a
        write never committed leaves only a `.tmp-` directory, which no resume picks."""
        if self.pending is not None:
            self.pending.wait()
