"""LoRA (`model.lora`): low-rank adapters injected by peft into a frozen language model.

`apply(model, spec, ...)` puts peft's LoRA layers on the Linear modules `model.lora.target_modules`
names (by default every Linear layer except the output head) with `peft.inject_adapter_in_model`,
which changes the model in place instead of wrapping it in a PeftModel: the model keeps its class
(GPT, LlamaForCausalLM), its forward and its parameter names, except that a targeted Linear's
weight moves to `<module>.base_layer.weight` and the adapter adds `<module>.lora_A.default.weight`
and `<module>.lora_B.default.weight`. Only those adapter tensors require gradients, so the
optimizer (train/optim/optimizer.py skips frozen parameters), the planner and the checkpoint
holders see adapter-sized state.

ZeRO-3: the base model is built partitioned (deepspeed.zero.Init, or transformers' from_pretrained
under HfDeepSpeedConfig), the adapters are built *whole*, outside zero.Init, deliberately:
peft initialises them after construction (kaiming A, zero B), and inside zero.Init those writes
would land on empty partitions, leaving B with nn.Linear's random init, so the untrained adapter
would already change the model. Whole adapters are small (r x (in + out) per targeted layer);
DeepSpeed's engine converts every parameter without a ZeRO id into a partitioned one when it
starts (DeepSpeedZeRoOffload._convert_to_zero_parameters, broadcasting rank 0's values), so
after `accelerate.prepare` adapters larger than the persistence threshold are partitioned like
any other parameter. They take the base layer's dtype (peft moves them to it), i.e. the
training dtype under ZeRO-3, like every other parameter.

peft is imported only here and only when model.lora is set: importing it costs start-up time
every other run should not pay. models/ imports nothing of train/.

Names: `is_adapter(name)`, `base_name(name)` (the base model's name of a parameter, as the
weights the base was loaded from call it) and `adapter_key(name)` (the key PEFT's
adapter_model.safetensors uses, which `PeftModel.from_pretrained` reads).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from zerotrain.models.config import LoraConfig
from zerotrain.models.errors import ConfigError
from zerotrain.models.spec import ModelSpec

ADAPTER = "default"  # peft's adapter name; PEFT files leave it out of their keys
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LM_FAMILIES = ("gpt", "hf")


def is_adapter(name: str) -> bool:
    """A LoRA parameter (trained, saved, exported), as opposed to the frozen base."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """The parameter's name in the base model (peft moves a targeted Linear's weight to base_layer)."""
    return name.replace(".base_layer.", ".")


def adapter_key(name: str) -> str:
    """The key of an adapter tensor in PEFT's adapter_model.safetensors: PeftModel's module path
    (`base_model.model.` + ours) without the adapter name."""
    for part in ("lora_A", "lora_B"):
        name = name.replace(f".{part}.{ADAPTER}.", f".{part}.")
    return "base_model.model." + name


def linear_modules(model) -> dict[str, list[str]]:
    """{last part of the module path: [full paths]} of the model's nn.Linear modules."""
    import torch.nn as nn
    out: dict[str, list[str]] = {}
    for path, m in model.named_modules():
        if isinstance(m, nn.Linear) and path:
            out.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    return out


def _output_head(model) -> Optional[str]:
    """The module path of the LM head (left out of the default targets, as peft's "all-linear")."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else getattr(model, "lm_head", None)
    for path, m in model.named_modules():
        if m is head:
            return path
    return None


def targets(model, cfg: LoraConfig, tied: list, name: str) -> list[str]:
    """The validated target module names (leaf names of Linear modules). Unknown names and a
    head tied to the embedding are refused in one line."""
    linears = linear_modules(model)
    head = _output_head(model)
    if cfg.target_modules is None:
        chosen = sorted(leaf for leaf, paths in linears.items() if paths != [head])
    else:
        chosen = list(dict.fromkeys(cfg.target_modules))
        unknown = [t for t in chosen if t not in linears]
        if unknown:
            raise ConfigError(f"model.lora.target_modules: {', '.join(unknown)} "
                              f"{'is not a Linear module' if len(unknown) == 1 else 'are not Linear modules'} of "
                              f"{name}; its Linear modules are: {', '.join(sorted(linears))}")
    tied_heads = {alias for alias, _ in tied}  # e.g. lm_head.weight, the alias of the embedding
    for t in chosen:
        for path in linears.get(t, []):
            if f"{path}.weight" in tied_heads:
                raise ConfigError(f"model.lora.target_modules: {t} ({path}) shares its weight with the input "
                                  f"embedding (tied); an adapter on it would untie them in a merged model; "
                                  f"leave {t} out")
    if not chosen:
        raise ConfigError(f"model.lora: {name} has no Linear layer to adapt besides its output head")
    return chosen


def peft_config(lora: dict):
    """peft's LoraConfig for the adapter description `apply` returns."""
    import peft
    return peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                           target_modules=list(lora["target_modules"]), bias="none",
                           task_type=lora.get("task_type"), base_model_name_or_path=lora.get("base"))


def base_weights_dir(spec: ModelSpec) -> str:
    """Where the frozen base weights come from (re-read on every resume, and by a merged export):
    model.init_from, or the hf: directory's own weights. A random base is refused: there is
    nothing to adapt, and a checkpoint without the base could not be exported."""
    from zerotrain.models.hf import model_dir, weight_files
    cfg = spec.config
    if cfg.init_from:
        return str(Path(cfg.init_from).expanduser().resolve())
    if spec.family == "hf":
        d = model_dir(spec.name[3:])
        if any(f.endswith(".safetensors") or f.endswith(".safetensors.index.json") for f in weight_files(d)):
            return str(d.resolve())
        raise ConfigError(f"model.lora: {d} has no safetensors weights to adapt (LoRA trains adapters on a "
                          f"pretrained model); add model.safetensors there or set model.init_from")
    raise ConfigError(f"model.lora on {spec.name} needs model.init_from: the pretrained weights the adapters are "
                      f"trained on (e.g. runs/pretrain/export); a randomly initialised base has nothing to adapt")


def apply(model, spec: ModelSpec, tied: list, meta: bool = False) -> dict:
    """Inject LoRA layers into `model` in place (built whole, outside any zero.Init: module
    docstring) and freeze everything else. `meta`: adapters on the meta device (planning: no
    memory). Returns the adapter's description (kept in checkpoints and adapter_config.json)."""
    import peft
    cfg = spec.config.lora
    chosen = targets(model, cfg, tied, spec.name)
    lora = {"r": cfg.r, "alpha": cfg.alpha, "dropout": cfg.dropout, "target_modules": chosen,
            "task_type": "CAUSAL_LM" if spec.family == "hf" else None,
            "base": None if meta else base_weights_dir(spec)}
    peft.inject_adapter_in_model(peft_config(lora), model, adapter_name=ADAPTER, low_cpu_mem_usage=meta)
    return lora


def write_adapter_config(lora: dict, out_dir: str | os.PathLike) -> Path:
    """adapter_config.json as peft writes it (PeftConfig.save_pretrained), for PeftModel.from_pretrained."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    peft_config(lora).save_pretrained(str(out))
    return out / ADAPTER_CONFIG


def merged_delta(a, b, lora: dict):
    """W_merged - W for one targeted Linear: (alpha / r) B A, in fp32 (peft's merge for Linear
    without fan_in_fan_out)."""
    return (b.float() @ a.float()) * (lora["alpha"] / lora["r"])
