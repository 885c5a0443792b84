"""Model registry: resolve the run's model once, then build it, with the loss that trains it.

`model.name` is a GPT preset (models/gpt.py), "linear", a torchvision classifier
(models/vision.py), "hf:<local dir>" (models/hf.py) or "py:<module>:<function>"; it picks the
section's variant (models/config.py). `resolve(cfg)` checks the name and
reads what is known before any data into a ModelSpec (models/spec.py); the run's build, memory
planner and data length use that spec, and `build_workload(spec, data)` builds it. Every
builder returns a Workload: the nn.Module plus how to compute its loss and per-sample eval
statistics from a batch, so the trainer never branches on the model type.

models/ imports nothing from train/: its config section (models/config.py) and the error
classes (models/errors.py) live here, and train/ imports them.
"""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Optional

from zerotrain.models.config import ModelSection
from zerotrain.models.errors import ConfigError, did_you_mean
from zerotrain.models.spec import ModelSpec

# torch and the builders are imported in the functions that use them: train/config/ and
# train/errors.py import models.config and models.errors, which runs this file first, and the
# commands that never build a model (check, plan, plot, `train --help`) must not load torch.
if TYPE_CHECKING:
    import torch.nn as nn

    from zerotrain.models.workload import Workload


def resolve(cfg: ModelSection) -> ModelSpec:
    """The run's model, resolved once: the name checked (a ConfigError names the choices before
    any data is read), what is known before the data, a local model's config.json read. The
    section's variant is the family (models/config.py): keys of other families never get here."""
    from zerotrain.models import gpt
    name = cfg.name
    if cfg.family == "hf":
        from zerotrain.models.hf import spec_fields
        return ModelSpec(cfg, "hf", **spec_fields(name[3:], cfg.trust_remote_code, cfg.attn_implementation))
    if cfg.family == "gpt" and name in gpt.PRESETS:
        g = gpt_config(cfg, vocab_size=None)
        return ModelSpec(cfg, "gpt", context=g.seq_len, vocab_size=g.vocab_size, hidden_size=g.d_model)
    if cfg.family == "linear":
        return ModelSpec(cfg, "linear")
    if cfg.family == "py":
        from zerotrain.models.user import check
        check(cfg)  # the factory imports: a one-line error before any data is read
        return ModelSpec(cfg, "py")
    from zerotrain.models.vision import is_vision
    if cfg.family == "vision" and is_vision(name):
        return ModelSpec(cfg, "vision")
    raise ConfigError(f'model.name "{name}" is unknown{did_you_mean(name, list(gpt.PRESETS) + ["linear"])}: use a '
                      f'GPT preset ({", ".join(gpt.PRESETS)}), "linear", a torchvision classifier (e.g. resnet50), '
                      f'"hf:<local model dir>" or "py:<module>:<function>"')


def hidden_size_of(spec: ModelSpec, data=None) -> Optional[int]:
    """Model width before construction (fills DeepSpeed's "auto" bucket and ZeRO-3 sizes); None if
    unknown. Transformers: the hidden size (in the spec). Other models: the side of their largest
    weight (sqrt of its elements), which plays the same role for bucket and persistence sizes and
    needs the data (features, classes, image size)."""
    if spec.hidden_size is not None or data is None:
        return spec.hidden_size
    if spec.family == "linear":
        return max(1, math.isqrt(data.num_features + 1))
    if spec.family == "vision":
        from zerotrain.models.vision import arch_info
        info = arch_info(spec.name, spec.config.num_classes or data.num_classes, data.extra["image_size"])
        return max(1, math.isqrt(max(math.prod(s) for s in info.shapes.values())))
    if spec.family == "py":
        from zerotrain.models import user
        try:
            return user.width(user.meta(spec))
        except user.MetaUnavailable as e:  # built on the CPU instead: its width
            return e.width
    return None


def partition_counts(model: nn.Module, leave_out=()) -> dict:
    """What ZeRO-3 did with this model's parameters on this rank, from the parameters themselves.
    `partitioned_*`: tensors held as a 1/world shard (`held_elements` of them here); `whole_*`:
    tensors every rank holds in full (built outside zero.Init, or at most
    stage3_param_persistence_threshold elements once the engine has marked them).
    `leave_out`: parameters not to count (LoRA adapters, in partition_summary)."""
    skip = {id(p) for p in leave_out}
    params = [p for p in model.parameters() if id(p) not in skip]
    parted = [p for p in params if hasattr(p, "ds_id") and not getattr(p, "ds_persist", False)]
    whole = [p for p in params if not (hasattr(p, "ds_id") and not getattr(p, "ds_persist", False))]
    numel = lambda p: int(getattr(p, "ds_numel", p.numel()))  # noqa: E731 - the full size, not the shard
    return {"tensors": len(params), "elements": sum(map(numel, params)),
            "partitioned_tensors": len(parted), "partitioned_elements": sum(map(numel, parted)),
            "held_elements": sum(int(p.ds_tensor.numel()) for p in parted),
            "whole_tensors": len(whole), "whole_elements": sum(map(numel, whole)),
            "built_outside_zero_init": sum(not hasattr(p, "ds_id") for p in params)}


def partition_summary(model: nn.Module, world_size: int) -> str:
    """How the model was built under ZeRO-3: partitioned at construction (every parameter a
    DeepSpeed ZeRO-3 parameter holding only its shard) or whole. LoRA adapters are built whole
    on purpose (models/lora.py) and partitioned by the DeepSpeed engine: said, not warned about."""
    from zerotrain.models.lora import is_adapter
    adapters = [p for n, p in model.named_parameters() if is_adapter(n)]
    c = partition_counts(model, leave_out=adapters)
    lora = (f"; {len(adapters)} LoRA adapter tensors ({sum(p.numel() for p in adapters) / 1e6:.3f}M parameters) "
            f"built whole, partitioned when the DeepSpeed engine starts") if adapters else ""
    if c["built_outside_zero_init"]:
        return (f"WARNING: {c['built_outside_zero_init']} of {c['tensors']} parameters were built whole, outside "
                f"deepspeed.zero.Init ({c['elements'] / 1e6:.2f}M parameters){lora}")
    return (f"model built partitioned by deepspeed.zero.Init: {c['elements'] / 1e6:.2f}M parameters, "
            f"{c['held_elements'] / 1e6:.2f}M held by this rank ({world_size} ranks){lora}")


def gpt_config(cfg: ModelSection, vocab_size):
    """The GPTConfig that model section builds (vocab_size: the data's, unless model.vocab_size)."""
    from zerotrain.models import gpt
    try:
        return gpt.preset(cfg.name, n_layer=cfg.n_layer, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                          d_model=cfg.d_model, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size or vocab_size,
                          dropout=cfg.dropout, tie_embeddings=cfg.tie_embeddings,
                          activation_checkpointing=cfg.activation_checkpointing)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def meta_model(spec: ModelSpec, data) -> tuple[nn.Module, dict, Optional[int]]:
    """(the model with its parameters on the meta device, its model_config, its width): the
    architecture as build_workload makes it, for sizing before anything is allocated (the
    memory planner). Costs no parameter memory; validates like build_workload."""
    import torch
    width = hidden_size_of(spec, data)
    if spec.family == "hf":
        from zerotrain.models.hf import meta_hf, tied_names
        model, model_config = meta_hf(spec)
        if spec.config.lora is not None:
            from zerotrain.models import lora
            lora.apply(model, spec, tied_names(model), meta=True)
        return model, model_config, width
    if spec.family == "gpt":
        from zerotrain.models import gpt
        gcfg = gpt_config(spec.config, vocab_size=data.vocab_size if data is not None else None)
        with torch.device("meta"):
            model = gpt.GPT(gcfg)
        if spec.config.lora is not None:
            from zerotrain.models import lora
            lora.apply(model, spec, _gpt_tied(gcfg), meta=True)
        return model, {"family": "gpt", **gcfg.to_dict()}, width
    if spec.family == "linear":
        from zerotrain.models.linear import LinearRegression
        with torch.device("meta"):
            model = LinearRegression(data.num_features)
        return model, {"family": "linear", "num_features": data.num_features}, width
    if spec.family == "vision":
        from zerotrain.models.vision import meta_vision
        model, model_config = meta_vision(spec.config, data)
        return model, model_config, width
    if spec.family == "py":
        from zerotrain.models import user
        model = user.meta(spec)
        return model, user.model_config(spec, spec.config.loss), user.width(model)
    raise AssertionError(spec.family)  # resolve makes only the families above


def build_workload(spec: ModelSpec, data, init_context=contextlib.nullcontext) -> Workload:
    """`spec` from resolve; `data` is the DataBundle (vocab, classes, features); `init_context()`
    wraps construction (deepspeed.zero.Init under ZeRO-3, so that big models are built already
    partitioned)."""
    workload = _build(spec, data, init_context)
    if spec.config.lora is not None:
        # After the base exists (partitioned under ZeRO-3) and outside init_context: models/lora.py says why.
        from zerotrain.models import lora
        workload.lora = lora.apply(workload.model, spec, workload.tied)
    return workload


def _gpt_tied(gcfg) -> list:
    return [("lm_head.weight", "tok_emb.weight")] if gcfg.tie_embeddings else []


def _build(spec: ModelSpec, data, init_context) -> Workload:
    from zerotrain.models.workload import Workload
    name, cfg = spec.name, spec.config
    if spec.family == "hf":
        from zerotrain.models.hf import build_hf
        return build_hf(spec, data, init_context)
    if spec.family == "gpt":
        from zerotrain.models import gpt
        if data.task != "lm":
            raise ConfigError(f"model.name {name} is a language model but data.kind gives a {data.task} task")
        gcfg = gpt_config(cfg, vocab_size=data.vocab_size)
        if data.vocab_size and gcfg.vocab_size < data.vocab_size:
            raise ConfigError(f"model.vocab_size {gcfg.vocab_size} is smaller than the data's vocabulary "
                              f"{data.vocab_size}; raise model.vocab_size")
        if data.seq_len and data.seq_len > gcfg.seq_len:
            raise ConfigError(f"data.seq_len {data.seq_len} exceeds the model context model.seq_len {gcfg.seq_len}")
        with init_context():
            model = gpt.GPT(gcfg)
        return Workload(model=model, task="lm", family="gpt", model_config={"family": "gpt", **gcfg.to_dict()},
                        hidden_size=gcfg.d_model, flops_per_item=float(gcfg.flops_per_token(data.seq_len)),
                        tied=_gpt_tied(gcfg))
    if spec.family == "linear":
        from zerotrain.models.linear import LinearRegression
        if data.task != "regress":
            raise ConfigError(f'model.name "linear" needs data.kind = "regression" (got a {data.task} task)')
        with init_context():
            model = LinearRegression(data.num_features)
        return Workload(model=model, task="regress", family="linear",
                        model_config={"family": "linear", "num_features": data.num_features},
                        flops_per_item=6.0 * (data.num_features + 1))
    if spec.family == "vision":
        from zerotrain.models.vision import build_vision
        return build_vision(cfg, data, init_context)
    if spec.family == "py":
        from zerotrain.models.user import build_user
        return build_user(spec, data, init_context)
    raise AssertionError(spec.family)  # resolve makes only the families above
