"""`zerotrain import`: a native DeepSpeed checkpoint (`global_step*/`, ZeRO-0..3, any world
size) -> fp32 master weights, AdamW moments and steps per parameter name, then written as a
world-size-1 zerotrain checkpoint (each tensor whole, one piece) that the loader reshards into
any world size and stage.

Reading: every pickle goes through safe_unpickle.restricted_load (tensors and plain
containers only), including the torch.load calls inside DeepSpeed's own readers
(`torch_load_restricted`). The layouts are DeepSpeed's:

- ZeRO-1/2/3: `deepspeed.utils.zero_to_fp32` reassembles the flat fp32 partitions of every
  rank into whole tensors (`_get_fp32_state_dict_from_zero{2,3}_checkpoint`, what
  `get_fp32_state_dict_from_zero_checkpoint` runs). The AdamW moments are flat partitions with
  exactly the layout of the fp32 partitions (`base_optimizer_state` / the ZeRO-3 optimizer's
  state per sub-group), so the same functions reassemble them when handed the moment
  partitions instead of the fp32 ones.
- ZeRO-0: zero_to_fp32 does not handle it (no `*_optim_states.pt`: "ValueError ... is not a
  zero checkpoint"), and DeepSpeed keeps no parameter names for the optimizer there. The
  weights are `mp_rank_00_model_states.pt`'s `module` state dict (fp32 only: under bf16/fp16
  ZeRO-0 the fp32 master copy lives elsewhere, refused below); the moments are the torch
  optimizer's `state_dict()` (`optimizer`), indexed by position, which is matched to names
  through the parameter groups of the run config's model (each index's shape is checked).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.checkpoint.files import MOMENTS
from zerotrain.train.checkpoint.safe_unpickle import restricted_load, torch_load_restricted
from zerotrain.train.errors import CheckpointError


@dataclass
class Imported:
    """What a foreign checkpoint holds, by parameter name (fp32, whole tensors)."""

    source: str                                   # "DeepSpeed ZeRO-2, 2 ranks"
    weights: dict[str, torch.Tensor]              # canonical parameters (tied aliases removed)
    moments: dict[str, dict[str, torch.Tensor]]   # kind -> name -> tensor (trainable parameters)
    steps: dict[str, int]                         # name -> AdamW step count
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    tied: dict[str, str] = field(default_factory=dict)   # alias -> source
    global_steps: int = 0
    global_samples: int | None = None
    skipped_steps: int = 0
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------- finding the files

_MODEL_FILE = re.compile(r"(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt")


def holds_deepspeed_files(p: Path) -> bool:
    return p.is_dir() and any(_MODEL_FILE.fullmatch(f.name) for f in p.iterdir())


def find_deepspeed_step_dir(src: str | Path) -> Path | None:
    """A `global_stepN` directory, or a save_checkpoint root (its `latest` tag, else the newest
    global_step*); None when `src` holds no DeepSpeed checkpoint."""
    p = Path(src)
    if holds_deepspeed_files(p):
        return p
    if not p.is_dir():
        return None
    latest = p / "latest"
    if latest.is_file() and holds_deepspeed_files(p / latest.read_text().strip()):
        return p / latest.read_text().strip()
    steps = sorted((d for d in p.iterdir() if holds_deepspeed_files(d)),
                   key=lambda d: int(m.group(1)) if (m := re.search(r"(\d+)$", d.name)) else -1)
    return steps[-1] if steps else None


def _mp_files(step_dir: Path) -> tuple[list[Path], list[Path]]:
    model = sorted(step_dir.glob("*model_states.pt"))
    optim = sorted(step_dir.glob("*optim_states.pt"))
    mp = {re.search(r"mp_rank_(\d+)", f.name).group(1) for f in model}
    if mp != {"00"}:
        raise CheckpointError(f"{step_dir} has tensor/pipeline-parallel parts (mp_rank {sorted(mp)}): only "
                              f"data-parallel DeepSpeed checkpoints (mp_rank_00) can be imported")
    return model, optim


# ---------------------------------------------------------------------------- reading

def read_deepspeed(step_dir: Path, optimizer_order=None) -> Imported:
    """`optimizer_order(shapes_by_index, group_sizes) -> [name per index] | None`: ZeRO-0 only,
    names the torch optimizer's parameter indices (the run config's model decides)."""
    model_files, optim_files = _mp_files(step_dir)
    if not optim_files:
        return _read_zero0(step_dir, model_files[0], optimizer_order)
    from deepspeed.utils import zero_to_fp32 as z
    with torch_load_restricted(), _quiet(z):
        zms = z.parse_model_states([str(f) for f in model_files])
        optim = [restricted_load(f) for f in _natural(optim_files)]
    osd = [o["optimizer_state_dict"] for o in optim]
    stage = int(osd[0]["zero_stage"])
    by_group = partitions_by_group(osd)
    world = osd[0]["partition_count"]
    world = max(world) if isinstance(world, list) else int(world)
    if world != len(optim_files):
        raise CheckpointError(f"{step_dir}: the checkpoint was written by {world} ranks but has {len(optim_files)} "
                              f"*_optim_states.pt files (a rank's file is missing)")
    full, moments, base = _merge_partitions(z, zms, osd, by_group, world)
    tied = {a: s for a, s in zms[0].shared_params}
    buffers = dict(zms[0].buffers)
    for d in moments.values():
        for n in list(d):
            if n in tied or n in buffers:
                del d[n]
    weights = {n: t.float() for n, t in full.items() if n not in tied and n not in buffers}
    steps = {}
    group_steps = [int(s.get("step", 0)) for _, s in sorted(base[0]["state"].items())]
    for g, shapes in enumerate(zms[0].param_shapes):
        # ZeRO-1/2: one optimizer state per parameter group; ZeRO-3 keeps one per sub-group
        # (sub_group_size splits groups), all stepped together: their common count.
        st = group_steps[g] if by_group else max(group_steps, default=0)
        for name in shapes:
            steps[name] = st
    ms = restricted_load(model_files[0])
    notes = []
    if ms.get("lr_scheduler"):
        notes.append("DeepSpeed's LR scheduler state is not imported: the run file's optim schedule applies "
                     "(a function of the step)")
    return Imported(source=f"DeepSpeed ZeRO-{stage}, {world} ranks", weights=weights, moments=moments, steps=steps,
                    buffers={n: b.float() if b.is_floating_point() else b for n, b in buffers.items()}, tied=tied,
                    global_steps=int(ms.get("global_steps", 0)), global_samples=ms.get("global_samples"),
                    skipped_steps=int(ms.get("skipped_steps", 0) or 0), notes=notes)


def partitions_by_group(osd: list) -> bool:
    """Whether a DeepSpeed checkpoint's ranks hold one flat fp32 partition per parameter group
    (ZeRO-1/2, `single_partition_of_fp32_groups`) rather than per sub-group (ZeRO-3,
    `fp32_flat_groups`): read from the foreign checkpoint's own record of its stage."""
    return int(osd[0]["zero_stage"]) < 3


def _merge_partitions(z, zms, osd: list, by_group: bool, world: int) -> tuple[dict, dict, list]:
    """(whole fp32 weights by name, whole moments by kind and name, each rank's base optimizer
    state): zero_to_fp32 (`z`) reassembles the ranks' flat fp32 partitions, and the moment
    partitions, which have exactly their layout."""
    paddings = osd[0].get("param_alignment_paddings")
    if by_group:
        base = [o["base_optimizer_state"] for o in osd]
        groups = [o["single_partition_of_fp32_groups"] for o in osd]
    else:
        base = [o["optimizer_state_dict"] for o in osd]
        groups = [o["fp32_flat_groups"] for o in osd]
    ngroups = len(groups[0])

    def merge(flat):
        if by_group:
            sd = z._get_fp32_state_dict_from_zero2_checkpoint(world, flat, zms, flat is not groups, paddings)
        else:
            sd = z._get_fp32_state_dict_from_zero3_checkpoint(world, flat, zms, flat is not groups)
        return {k: v for k, v in z.to_torch_tensor(sd).items()}

    with torch_load_restricted(), _quiet(z):
        full = merge(groups)
        moments = {}
        for kind in MOMENTS:
            flat = [[b["state"][g][kind] for g in range(ngroups)] for b in base]
            moments[kind] = merge(flat)
    return full, moments, base


def _quiet(z):
    """zero_to_fp32 prints its progress (print + tqdm); the import prints its own summary."""
    import contextlib
    import io

    @contextlib.contextmanager
    def cm():
        saved = getattr(z, "tqdm", None)
        z.tqdm = lambda it, *a, **k: it
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                yield
        finally:
            z.tqdm = saved
    return cm()


def _natural(files):
    return sorted(files, key=lambda f: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", f.name)])


def _read_zero0(step_dir: Path, model_file: Path, optimizer_order) -> Imported:
    """ZeRO-0 (DeepSpeed's zero_to_fp32 does not cover it): the module state dict and the torch
    optimizer's state dict from mp_rank_00_model_states.pt."""
    ms = restricted_load(model_file)
    module = ms.get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"{model_file} has no 'module' state dict: not a DeepSpeed model-states file")
    buffer_names = set(ms.get("buffer_names") or [])
    dtypes = {str(t.dtype) for n, t in module.items() if n not in buffer_names and t.is_floating_point()}
    if dtypes != {"torch.float32"}:
        raise CheckpointError(f"{model_file}: a ZeRO-0 checkpoint with {sorted(dtypes)} weights; only fp32 ZeRO-0 "
                              f"checkpoints can be imported (the fp32 master copy of bf16/fp16 ZeRO-0 is not "
                              f"in this file)")
    # Tied parameters are one storage saved under two names: keep the first name.
    seen, tied, weights, buffers = {}, {}, {}, {}
    for n, t in module.items():
        if n in buffer_names:
            buffers[n] = t
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            tied[n] = seen[key]
        else:
            seen[key] = n
            weights[n] = t.float()
    moments, steps, notes = {k: {} for k in MOMENTS}, {}, []
    opt = ms.get("optimizer")
    if isinstance(opt, dict) and "state" in opt and "param_groups" in opt:
        sizes = [len(g["params"]) for g in opt["param_groups"]]
        index = [i for g in opt["param_groups"] for i in g["params"]]
        shapes = [tuple(opt["state"][i]["exp_avg"].shape) if i in opt["state"] else None for i in index]
        names = optimizer_order(shapes, sizes) if optimizer_order else None
        if names is None:
            notes.append("the ZeRO-0 optimizer's parameter order does not match the run config's model "
                         "(DeepSpeed records no names there): its moments were not imported")
        else:
            for i, name in zip(index, names):
                s = opt["state"].get(i)
                if not s:
                    continue
                for kind in MOMENTS:
                    moments[kind][name] = s[kind].float()
                steps[name] = int(s["step"])
    else:
        notes.append(f"{model_file} holds no optimizer state: fresh AdamW moments")
    return Imported(source="DeepSpeed ZeRO-0, "
                           f"{ms.get('dp_world_size', '?')} ranks", weights=weights, moments=moments, steps=steps,
                    buffers=buffers, tied=tied, global_steps=int(ms.get("global_steps", 0)),
                    global_samples=ms.get("global_samples"), skipped_steps=int(ms.get("skipped_steps", 0) or 0),
                    notes=notes)


# ---------------------------------------------------------------------------- writing

def write_checkpoint(out: Path, imp: Imported, meta: dict) -> Path:
    """A world-size-1 zerotrain checkpoint at `out` (written to a temp dir, renamed into place):
    `meta` is meta.json minus what comes from `imp` (params, buffers)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(ckpt_files.TMP_PREFIX + out.name)
    ckpt_files.remove_tree(tmp)
    tmp.mkdir()
    try:
        tensors = {}
        for name, t in imp.weights.items():
            tensors[ckpt_files.piece_key("param", name, 0)] = t.detach().reshape(-1).float().contiguous()
            if name in imp.steps:
                for kind in MOMENTS:
                    moment = imp.moments[kind][name]
                    tensors[ckpt_files.piece_key(kind, name, 0)] = moment.reshape(-1).float().contiguous()
        for name, b in imp.buffers.items():
            tensors[ckpt_files.piece_key("buffer", name, 0)] = b.detach().reshape(-1).contiguous()
        files = {"rank00000.safetensors": ckpt_files.save_tensors(tensors, tmp / "rank00000.safetensors")}
        full = {**meta,
                "params": {n: {"shape": list(t.shape), "trainable": n in imp.steps,
                               **({"optimizer_step": imp.steps[n]} if n in imp.steps else {})}
                           for n, t in imp.weights.items()},
                "buffers": {n: {"shape": list(b.shape), "dtype": str(b.dtype).removeprefix("torch.")}
                            for n, b in imp.buffers.items()},
                "moments": list(MOMENTS)}
        files[ckpt_files.META] = ckpt_files.write_json(tmp / ckpt_files.META, full)
        ckpt_files.write_json(tmp / ckpt_files.MANIFEST, {"format": ckpt_files.FORMAT, "version": ckpt_files.VERSION,
                                                          "step": meta["step"], "world_size": 1,
                                                          "files": dict(sorted(files.items()))})
        ckpt_files.replace_dir(tmp, out)
    except BaseException:
        ckpt_files.remove_tree(tmp)
        raise
    return out


# ---------------------------------------------------------------------------- HF Trainer / Accelerate

HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def find_hf_checkpoint(src: str | Path) -> Path | None:
    """A Trainer `checkpoint-N` folder (trainer_state.json + weights), or an output dir holding
    them (the newest one); None otherwise."""
    p = Path(src)

    def is_ckpt(d: Path) -> bool:
        return (d / "trainer_state.json").is_file() and any((d / w).is_file() for w in HF_WEIGHTS)

    if not p.is_dir():
        return None
    if is_ckpt(p):
        return p
    found = [(int(m.group(1)), d) for d in p.iterdir() if (m := re.fullmatch(r"checkpoint-(\d+)", d.name)) and is_ckpt(d)]
    return max(found)[1] if found else None


def _hf_weights(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    if (d / "model.safetensors").is_file():
        return load_file(str(d / "model.safetensors"))
    if (d / "model.safetensors.index.json").is_file():
        index = ckpt_files.read_json(d / "model.safetensors.index.json", "weights index")
        out = {}
        for f in sorted(set(index["weight_map"].values())):
            out.update(load_file(str(d / f)))
        return out
    sd = restricted_load(d / "pytorch_model.bin")
    if not isinstance(sd, dict):
        raise CheckpointError(f"{d / 'pytorch_model.bin'} is not a state dict")
    return sd


def read_hf_trainer(d: Path, optimizer_order=None) -> Imported:
    """An HF Trainer / Accelerate `checkpoint-N` folder saved without DeepSpeed: the weights
    (safetensors, or pytorch_model.bin through the restricted unpickler), the torch optimizer's
    state_dict (`optimizer.pt`, by position: named through `optimizer_order`, like ZeRO-0), and
    trainer_state.json's global_step. Not read: training_args.bin (a pickled TrainingArguments:
    code), rng_state.pth (numpy objects; RNG streams start fresh), scheduler.pt (zerotrain's LR
    is a function of the step)."""
    state = ckpt_files.read_json(d / "trainer_state.json", "HF Trainer state")
    step = int(state.get("global_step", 0))
    weights = {n: t.float() if t.is_floating_point() else t for n, t in _hf_weights(d).items()}
    moments, steps, notes = {k: {} for k in MOMENTS}, {}, []
    notes.append("RNG streams (rng_state.pth) and training_args.bin are not imported (RNG starts fresh)")
    opt_file = d / "optimizer.pt"
    if opt_file.is_file():
        opt = restricted_load(opt_file)
        sizes = [len(g["params"]) for g in opt["param_groups"]]
        index = [i for g in opt["param_groups"] for i in g["params"]]
        shapes = [tuple(opt["state"][i]["exp_avg"].shape) if i in opt["state"] else None for i in index]
        names = optimizer_order(shapes, sizes) if optimizer_order else None
        if names is None:
            notes.append(f"the parameter order of {opt_file} matches neither the Trainer's nor zerotrain's grouping "
                         f"of the run config's model: its moments were not imported")
        else:
            for i, name in zip(index, names):
                s = opt["state"].get(i)
                if s and "exp_avg" in s:
                    for kind in MOMENTS:
                        moments[kind][name] = s[kind].float()
                    steps[name] = int(s["step"])
    else:
        notes.append(f"{d} has no optimizer.pt: fresh AdamW moments")
    return Imported(source=f"HF Trainer checkpoint (step {step})", weights=weights, moments=moments, steps=steps,
                    global_steps=step, global_samples=None, notes=notes)
