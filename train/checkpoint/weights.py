"""Consolidated weights in the Hugging Face layout (the offline `zerotrain export` command is train/commands/export.py).

    model-00001-of-00003.safetensors ...   (or model.safetensors when one shard suffices)
    model.safetensors.index.json           weight_map + metadata (total_size, tied aliases)
    config.json                            the model config (transformers' for hf: models)

Shards are planned by huggingface_hub.split_torch_state_dict_into_shards and written with
safetensors. Tied weights are stored once; every shard's metadata and the index map the
alias to its source ({"lm_head.weight": "tok_emb.weight"}, huggingface_hub's convention)
and `load_weights` re-ties them. The writer holds one shard at a time.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.config.moved import upgrade_saved
from zerotrain.train.errors import CheckpointError, ConfigError

EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def _write_config(d: Path, family: str, model_config: dict, dtype: torch.dtype):
    if family == "hf":
        try:
            from zerotrain.models.hf import save_hf_config  # transformers' config.json, so from_pretrained loads the export
        except ImportError:
            save_hf_config = None
        if save_hf_config is not None:
            save_hf_config(model_config, d, dtype=str(dtype).removeprefix("torch."))
            return
    ckpt_files.write_json(d / "config.json", model_config)


def write_weights(out_dir: Path, entries, get_tensor, *, dtype, max_shard_size, tied, family: str, model_config: dict,
                  is_writer: bool = True) -> Path:
    """entries: [(name, shape, source dtype)]. get_tensor(name) is called for every entry in
    the same order on every rank (it may be a collective); only the writer keeps tensors."""
    from huggingface_hub import split_torch_state_dict_into_shards

    def out_dtype(src):
        return dtype if src.is_floating_point else src

    skeleton = {n: torch.empty(shape, dtype=out_dtype(src), device="meta") for n, shape, src in entries}
    split = split_torch_state_dict_into_shards(skeleton, max_shard_size=max_shard_size)
    aliases = {alias: source for alias, source in tied if source in skeleton and alias not in skeleton}
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    if is_writer:
        ckpt_files.remove_tree(tmp)
        tmp.mkdir(parents=True)
    for fname, names in split.filename_to_tensors.items():
        shard = {}
        for n in names:
            t = get_tensor(n)
            if is_writer:
                shard[n] = t.reshape(skeleton[n].shape).to(dtype=skeleton[n].dtype, copy=True).contiguous()
        if is_writer:
            ckpt_files.write_safetensors(shard, tmp / fname, {"format": "pt", **aliases})
            ckpt_files.fsync_path(tmp / fname)
        del shard
    if not is_writer:
        return out_dir
    if split.is_sharded:
        ckpt_files.write_json(tmp / INDEX, {"metadata": {**split.metadata, **aliases},
                                            "weight_map": split.tensor_to_filename})
    _write_config(tmp, family, model_config, dtype)
    ckpt_files.replace_dir(tmp, out_dir)
    return out_dir


# ---------------------------------------------------------------------------- reading exports

class WeightsReader:
    """Exported weights (sharded or not), read tensor by tensor or row range by row range."""

    def __init__(self, path, what: str = "weights"):
        from safetensors import safe_open
        self.path = p = Path(path)
        if (p / INDEX).is_file():
            index = ckpt_files.read_json(p / INDEX, f"{what} index")
            files = sorted(set(index["weight_map"].values()))
            meta = index.get("metadata") or {}
        elif (p / SINGLE).is_file():
            files, meta = [SINGLE], None
        else:
            raise ConfigError(f"{what} {p}: no {SINGLE} or {INDEX} there; point it at a directory written by "
                              f"`zerotrain export` or checkpoint.export (e.g. runs/x/export)")
        self._handles, self.where, self.shape_of = {}, {}, {}
        for f in files:
            try:
                h = safe_open(str(p / f), framework="pt")
            except Exception as e:  # safetensors' own error types
                raise CheckpointError(f"{p / f} is not a readable safetensors file ({e})") from None
            self._handles[f] = h
            meta = meta if meta is not None else (h.metadata() or {})
            for k in h.keys():
                self.where[k] = f
                self.shape_of[k] = tuple(h.get_slice(k).get_shape())
        self.aliases = {a: s for a, s in meta.items() if s in self.where and a not in self.where}

    def add_ties(self, tied):
        """The model's own ties: a source stored only under its alias's name still loads."""
        for alias, src in tied:
            if src not in self.where and alias in self.where:
                self.aliases[src] = alias

    def shapes(self, ignore=()) -> dict:
        """{name: shape} of every tensor the weights provide, aliases included, minus `ignore`."""
        out = {n: self.shape_of[n] for n in self.where}
        out.update({a: self.shape_of[s] for a, s in self.aliases.items()})
        return {n: v for n, v in out.items() if n not in ignore}

    def _key(self, name: str) -> str:
        return name if name in self.where else self.aliases[name]

    def tensor(self, name: str) -> torch.Tensor:
        key = self._key(name)
        return self._handles[self.where[key]].get_tensor(key)

    def read(self, name: str, start: int, stop: int, dtype=torch.float32) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor, reading only the rows that hold them."""
        key = self._key(name)
        shape = self.shape_of[key]
        sl = self._handles[self.where[key]].get_slice(key)
        if len(shape) <= 1:
            return sl[start:stop].reshape(-1).to(dtype)
        row = math.prod(shape[1:])
        r0, r1 = start // row, -(-stop // row)
        rows = sl[r0:r1].reshape(-1)
        return rows[start - r0 * row: stop - r0 * row].to(dtype)

    def close(self):
        self._handles.clear()


def load_weights(model: torch.nn.Module, path, strict: bool = True) -> torch.nn.Module:
    """Load exported weights into a (non-distributed) model and re-tie aliased weights."""
    w = WeightsReader(path)
    state = {k: w.tensor(k) for k in w.where}
    missing, unexpected = model.load_state_dict(state, strict=False)
    for alias, src in w.aliases.items():
        mod_name, _, attr = alias.rpartition(".")
        owner = model.get_submodule(mod_name) if mod_name else model
        setattr(owner, attr, model.get_parameter(src))
    missing = [m for m in missing if m not in w.aliases]
    if strict and (missing or unexpected):
        raise CheckpointError(f"weights {path} do not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
    w.close()
    return model


# ---------------------------------------------------------------------------- offline export

def export_checkpoint(ckpt_path, out_dir, dtype: str | None = None, max_shard_size: str | None = None) -> Path:
    """A resumable checkpoint -> HF-layout weights, with no process group and no GPU:
    each tensor is assembled from the pieces all ranks wrote."""
    ckpt = ckpt_files.resolve_checkpoint(ckpt_path)
    manifest = ckpt_files.read_manifest(ckpt)
    ckpt_files.verify(ckpt, manifest)  # the same check a resume runs (here one process hashes every file)
    meta = ckpt_files.read_json(ckpt / ckpt_files.META, "checkpoint metadata")
    ck_cfg = (upgrade_saved(meta.get("config")) or {}).get("checkpoint") or {}  # a 0.1 checkpoint too
    dtype = dtype or ck_cfg.get("export_dtype", "bf16")
    max_shard_size = max_shard_size or ck_cfg.get("max_shard_size", "2GB")
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f'--dtype must be "bf16" or "fp32" (got "{dtype}")')
    buffers = meta.get("buffers", {})
    entries = [(n, tuple(p["shape"]), torch.float32) for n, p in meta["params"].items()]
    entries += [(n, tuple(b["shape"]), getattr(torch, b["dtype"])) for n, b in buffers.items()]
    how = {n: ("buffer" if n in buffers else "param", math.prod(shape), d) for n, shape, d in entries}
    reader = ckpt_files.PieceReader([ckpt / f for f in manifest["files"] if f.endswith(".safetensors")])
    try:
        def get(name):
            kind, numel, src_dtype = how[name]
            return reader.read(kind, name, 0, numel, src_dtype)

        model = meta["model"]
        write_weights(Path(out_dir), entries, get, dtype=EXPORT_DTYPES[dtype], max_shard_size=max_shard_size,
                      tied=[tuple(x) for x in model["tied"]], family=model["family"], model_config=model["config"])
    finally:
        reader.close()
    return Path(out_dir)
