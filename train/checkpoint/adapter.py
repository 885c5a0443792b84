"""LoRA checkpoints and exports (model.lora; the adapters themselves: models/lora.py).

A LoRA run's checkpoint holds the adapter and its optimizer state only (the pieces of the
trained tensors, as for any run: docs/checkpoints.md) plus, in meta.json's "lora", the adapter's
settings, the names and shapes of the frozen base parameters and the sizes of the base weight
files. The frozen base is not copied into every checkpoint: a resume rebuilds it from the base
directory (the hf: directory or model.init_from) and `check_resume` refuses a base whose files
changed since.

Exports:
  adapter  PEFT's layout, what `PeftModel.from_pretrained(base, dir)` loads:
           adapter_config.json + adapter_model.safetensors (keys `base_model.model.<module>.lora_A.weight`).
           Written from the gathered adapter (live: DeepSpeed's full-parameter gather under ZeRO-3,
           never a rank's empty or partial shard) or from a checkpoint's pieces (offline).
  merged   `zerotrain export --merge`: the base weights with (alpha / r) B A added to every
           targeted Linear, under the base model's names, in the HF layout of any export
           (train/checkpoint/weights.py), so AutoModelForCausalLM.from_pretrained loads it.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from zerotrain.models import lora as lora_names
from zerotrain.train.checkpoint import files as ckpt_files
from zerotrain.train.checkpoint.weights import EXPORT_DTYPES, WeightsReader, write_weights
from zerotrain.train.config.moved import upgrade_saved
from zerotrain.train.errors import CheckpointError, ConfigError


def base_files(base_dir: str) -> dict[str, int]:
    """{file: size} of the base directory's weight files: what a resume compares."""
    d = Path(base_dir)
    return {p.name: p.stat().st_size for p in sorted(d.glob("*.safetensors"))}


def checkpoint_meta(lora: dict, frozen_slots) -> dict:
    """meta.json's "lora": the adapter, the frozen parameters it left out, the base files it needs."""
    return {**lora, "frozen": {s.name: list(s.shape) for s in frozen_slots}, "base_files": base_files(lora["base"])}


def check_resume(ckpt: Path, saved: dict | None, current: dict | None):
    """A checkpoint resumes only into a run with the same adapter on the same base."""
    if saved is None and current is None:
        return
    if saved is None:
        raise CheckpointError(f"checkpoint {ckpt} holds a fully trained model, this run trains a LoRA adapter "
                              f"(model.lora): start the LoRA run from its weights with model.init_from (zerotrain "
                              f"export it first), or resume without model.lora")
    if current is None:
        raise CheckpointError(f"checkpoint {ckpt} holds a LoRA adapter (r={saved['r']}, on "
                              f"{','.join(saved['target_modules'])}) without its base: resume with the same "
                              f"model.lora section, or export it (zerotrain export --merge) and start from that")
    for k in ("r", "alpha", "target_modules"):
        if saved[k] != current[k]:
            raise CheckpointError(f"checkpoint {ckpt} was trained with model.lora.{k} = {saved[k]}, this run has "
                                  f"{current[k]}; resume with the same model.lora settings")
    now = base_files(current["base"])
    if saved.get("base_files") != now:
        raise CheckpointError(f"checkpoint {ckpt}'s LoRA adapter was trained on base weights {saved['base_files']} "
                              f"(file sizes), but {current['base']} now has {now}: the adapter only means something "
                              f"on its own base; point model.name / model.init_from at that base")


def write_adapter(out_dir, lora: dict, tensors: dict[str, torch.Tensor], dtype: torch.dtype,
                  is_writer: bool = True) -> Path:
    """PEFT's adapter directory from whole adapter tensors {our parameter name: tensor}."""
    out = Path(out_dir)
    if not is_writer:
        return out
    # The failure users meet with ZeRO-3: a rank's [0]-shaped shard saved as the adapter. Never write one.
    bad = [f"{n}: {list(t.shape)}" for n, t in tensors.items() if t.dim() != 2 or t.numel() == 0]
    if bad or not tensors:
        raise RuntimeError(f"refusing to write an incomplete LoRA adapter (tensors not gathered?): {bad[:4]}")
    tmp = out.with_name(f".{out.name}.tmp")
    ckpt_files.remove_tree(tmp)
    tmp.mkdir(parents=True)
    state = {lora_names.adapter_key(n): t.to(dtype).contiguous() for n, t in tensors.items()}
    ckpt_files.save_file(state, tmp / lora_names.ADAPTER_WEIGHTS, {"format": "pt"})
    ckpt_files.fsync_path(tmp / lora_names.ADAPTER_WEIGHTS)
    lora_names.write_adapter_config(lora, tmp)
    ckpt_files.replace_dir(tmp, out)
    return out


def _module_of(adapter_param: str) -> tuple[str, str]:
    """("<module>", "lora_A"|"lora_B") of `<module>.lora_A.default.weight`."""
    for part in ("lora_A", "lora_B"):
        marker = f".{part}."
        if marker in adapter_param:
            return adapter_param.split(marker)[0], part
    raise ValueError(adapter_param)


def export_lora_checkpoint(ckpt_path, out_dir, merge: bool = False, dtype: str | None = None,
                           max_shard_size: str | None = None) -> Path:
    """A LoRA checkpoint -> PEFT adapter directory, or with `merge` full merged weights. Offline:
    one CPU process, no process group; the merge reads the base one tensor at a time."""
    ckpt = ckpt_files.resolve_checkpoint(ckpt_path)
    manifest = ckpt_files.read_manifest(ckpt)
    ckpt_files.verify(ckpt, manifest)
    meta = ckpt_files.read_json(ckpt / ckpt_files.META, "checkpoint metadata")
    lora = meta.get("lora")
    if lora is None:
        raise ConfigError(f"{ckpt} is not a LoRA checkpoint (no model.lora): --merge applies to LoRA adapters only; "
                          f"export it without --merge")
    ck_cfg = (upgrade_saved(meta.get("config")) or {}).get("checkpoint") or {}  # a 0.1 checkpoint too
    dtype = dtype or ck_cfg.get("export_dtype", "bf16")
    if dtype not in EXPORT_DTYPES:
        raise ConfigError(f'--dtype must be "bf16" or "fp32" (got "{dtype}")')
    reader = ckpt_files.PieceReader([ckpt / f for f in manifest["files"] if f.endswith(".safetensors")])
    try:
        adapter = {n: reader.read("param", n, 0, math.prod(p["shape"])).view(p["shape"])
                   for n, p in meta["params"].items()}
        if not merge:
            return write_adapter(out_dir, lora, adapter, EXPORT_DTYPES[dtype])
        return _write_merged(Path(out_dir), meta, lora, adapter, reader, EXPORT_DTYPES[dtype],
                             max_shard_size or ck_cfg.get("max_shard_size", "2GB"))
    finally:
        reader.close()


def _write_merged(out: Path, meta: dict, lora: dict, adapter: dict, reader, dtype, max_shard_size) -> Path:
    """Base + (alpha / r) B A for every targeted Linear, under the base model's names."""
    pairs: dict[str, dict] = {}
    for n, t in adapter.items():
        module, part = _module_of(n)
        pairs.setdefault(module, {})[part] = t
    deltas = {f"{module}.weight": lora_names.merged_delta(p["lora_A"], p["lora_B"], lora) for module, p in pairs.items()}
    model = meta["model"]
    tied = [tuple(x) for x in model["tied"]]
    if not Path(lora["base"]).is_dir():
        raise ConfigError(f"the LoRA base weights {lora['base']} (where the run read them) are not there; the "
                          f"merged export needs them")
    base = WeightsReader(lora["base"], what="the LoRA base weights")
    base.add_ties(tied)
    buffers = meta.get("buffers", {})
    entries = [(lora_names.base_name(n), tuple(shape), torch.float32) for n, shape in lora["frozen"].items()]
    entries += [(n, tuple(b["shape"]), getattr(torch, b["dtype"])) for n, b in buffers.items()]

    shapes = {n: shape for n, shape, _ in entries}

    def get(name):
        if name in buffers:
            b = buffers[name]
            return reader.read("buffer", name, 0, math.prod(b["shape"]), getattr(torch, b["dtype"]))
        w = base.read(name, 0, math.prod(shapes[name])).view(shapes[name])
        return w + deltas[name] if name in deltas else w

    try:
        return write_weights(out, entries, get, dtype=dtype, max_shard_size=max_shard_size, tied=tied,
                             family=model["family"], model_config=model["config"])
    finally:
        base.close()
