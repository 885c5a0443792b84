"""Loading into the live run: a resume (checkpoint.resume: the tensors, the counters, the data
position, the RNG streams) and initial weights (model.init_from).

A resume first verifies every file against the manifest, then checks that the checkpoint fits
this run (`check_fits`: the parameters' names and shapes, the data the position applies to),
writes every tensor into whatever strategy and world size this run has (`restore_tensors`, through
the strategy's holder), and hands the TrainState and every registered component its record back
(`restore_counters`). Layout and guarantees: docs/checkpoints.md.

The Loader works on the state of its Checkpointer (train/checkpoint/manager.py).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from zerotrain.models.lora import base_name, is_adapter
from zerotrain.train.checkpoint import adapter
from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.checkpoint.files import MOMENTS, persistent_buffers
from zerotrain.train.checkpoint.state import Stateful, TrainState
from zerotrain.train.errors import CheckpointError, ConfigError


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


def restore_tensors(holder, model, reader: ckpt_files.PieceReader, meta: dict, load_optimizer: bool,
                    owners: dict | None = None) -> None:
    """Every parameter (and, with `load_optimizer`, its moments and optimizer step) this rank
    holds, and the model's persistent buffers, from the checkpoint's pieces; then each registered
    component's per-parameter tensors (`owners`: kind -> component, TensorState), handed the
    checkpoint's values of each trained slot.need (None where the checkpoint has none)."""
    h = holder
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
        for name, buf in persistent_buffers(model):
            if reader.has("buffer", name):
                buf.copy_(reader.read("buffer", name, 0, buf.numel(), buf.dtype).view_as(buf))
    h.finish_load()
    for kind, owner in (owners or {}).items():
        owner.load_tensors(kind, lambda s, kind=kind: reader.read(kind, s.name, *s.need)
                           if reader.has(kind, s.name) else None)


def restore_counters(meta: dict, components: dict[str, Stateful]) -> TrainState:
    """The saved TrainState, then every registered component's state (the engine's step
    counters and loss scale, ...): a component the checkpoint has no record of gets {}."""
    known = TrainState.__dataclass_fields__
    st = TrainState(**{k: v for k, v in meta["train_state"].items() if k in known})
    saved = ckpt_files.component_states(meta)
    for name, component in components.items():
        component.load_state_dict(saved.get(name) or {}, st)
    return st


class Loader:
    """Resume and init_from for the Checkpointer `ck`; keeps a resumed checkpoint's RNG streams
    until the first step (`on_fit_start`)."""

    def __init__(self, ck):
        self.ck = ck
        self.pending_rng = None

    def resume(self, spec: str, load_optimizer: bool = True) -> TrainState | None:
        """checkpoint.resume: "none", "auto" (newest complete checkpoint of this run, if any) or a path.
        Returns the restored TrainState, or None when there was nothing to resume."""
        if spec == "none":
            return None
        if spec == "auto":
            ckpt = ckpt_files.newest_checkpoint(self.ck.root)
            if ckpt is None:
                self.ck._say(f"--resume auto: no checkpoint in {self.ck.root} yet, starting from scratch")
                return None
        else:
            ckpt = ckpt_files.resolve_checkpoint(spec)
        return self.load(ckpt, load_optimizer)

    def load(self, path, load_optimizer: bool = True) -> TrainState:
        """Restores the tensors, engine counters and loss scale in place; returns the TrainState
        (step, data position) the run continues from."""
        ck = self.ck
        t0 = time.perf_counter()
        ckpt = ckpt_files.resolve_checkpoint(path)
        manifest = ckpt_files.read_manifest(ckpt)
        ckpt_files.verify(ckpt, manifest, ck.rank, ck.world, ck.strategy.acc.device)
        meta = ckpt_files.read_json(ckpt / ckpt_files.META, "checkpoint metadata")
        self.check_fits(ckpt, meta)
        reader = ckpt_files.PieceReader([ckpt / f for f in manifest["files"] if f.endswith(".safetensors")])
        try:
            restore_tensors(ck.holder, ck.raw_model, reader, meta, load_optimizer, ck.tensor_owners)
        finally:
            reader.close()
        st = restore_counters(meta, ck.registered)
        rng = ckpt / ckpt_files.rng_file(ck.rank)
        # RNG streams only mean something for the same ranks; another world size keeps fresh seeds.
        same_ranks = meta["world_size"] == ck.world and rng.is_file()
        self.pending_rng = ckpt_files.read_json(rng, "RNG state") if same_ranks else None
        ckpt_files.barrier()
        ck.resumed_from = ckpt
        how = "" if load_optimizer else " (weights only: fresh optimizer moments)"
        ck._say(f"resumed from {ckpt}{how}: step {st.step}, epoch {st.epoch} (+{st.offset} samples), "
                f"saved by {meta['world_size']} process(es) [{meta['holder']}], loaded in "
                f"{time.perf_counter() - t0:.2f} s")
        return st

    def check_fits(self, ckpt: Path, meta: dict):
        """Refuse a checkpoint of another model, training set or global batch (one message naming
        what to set); warn where only the data order of the rest of the epoch changes."""
        ck = self.ck
        adapter.check_resume(ckpt, meta.get("lora"), ck.lora)
        want = {n: tuple(p["shape"]) for n, p in meta["params"].items()}
        want.update({n: tuple(shape) for n, shape in (meta.get("lora") or {}).get("frozen", {}).items()})
        have = {s.name: tuple(s.shape) for s in ck.holder.slots}
        diff = shape_mismatch(want, have, "checkpoint", "model")
        if diff:
            raise CheckpointError(f"checkpoint {ckpt} does not fit model {ck.model_name!r}:\n{diff}\n"
                                  f"resume with the model settings it was trained with (see {ckpt / ckpt_files.META})")
        d, s, b = meta["data"], ck.sampler, ck.batch
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
            ck._say("warning: the checkpoint's data.sources mixture (names, weights, sizes) differs from this "
                    "run's: the rest of the epoch follows this run's mixture")
        if d["seed"] != s.seed:
            ck._say(f"warning: the checkpoint used train.seed {d['seed']}, this run {s.seed}: "
                    f"the rest of the epoch sees a different data order")

    def on_fit_start(self):
        """Restore RNG streams at the last moment before the first step (nothing in between may draw)."""
        if self.pending_rng is not None:
            ckpt_files.set_rng_state(self.pending_rng)
            self.pending_rng = None

    def init_from(self, path: str):
        """model.init_from: exported weights (any world size / stage), optimizer untouched."""
        from zerotrain.train.checkpoint.weights import WeightsReader
        import zerotrain.models.hub as hub
        ck = self.ck
        w = WeightsReader(str(hub.local_path(path, "model.init_from")), what="model.init_from")  # a dir or a Hub id
        tied = ck.workload.tied
        w.add_ties(tied)
        h = ck.holder
        # A LoRA run takes the frozen base from the weights, under the base model's names; the
        # adapters keep their fresh initialisation (or what a resume then loads).
        slots = [s for s in h.slots if not (ck.lora and is_adapter(s.name))]
        source = base_name if ck.lora else (lambda n: n)
        have = {source(s.name): tuple(s.shape) for s in slots}
        have.update({n: tuple(b.shape) for n, b in persistent_buffers(ck.raw_model)})
        found = w.shapes(ignore={alias for alias, _ in tied})
        diff = shape_mismatch(have, found, "model", "weights")
        if diff:
            raise ConfigError(f"model.init_from {path} does not match model {ck.model_name!r}:\n{diff}\n"
                              f"point model.init_from at weights exported from the same architecture")
        h.begin_load()
        with torch.no_grad():
            for s in slots:
                a, b = s.need
                if b > a:
                    h.write(s, "param", w.read(source(s.name), a, b))
            for name, buf in persistent_buffers(ck.raw_model):
                buf.copy_(w.read(name, 0, buf.numel(), buf.dtype).view_as(buf))
        h.finish_load()
        w.close()
        ckpt_files.barrier()
        ck._say(f"initialised {'the frozen base ' if ck.lora else ''}weights from {path} ({len(slots)} tensors)")
