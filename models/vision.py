"""Torchvision image classifiers by name: new head, local pretrained weights, ZeRO-3 construction.

`model.name` is any torchvision classification architecture (resnet18, resnet50, vit_b_16,
efficientnet_b0, ...). The classifier head is sized for `model.num_classes` (default: the
classes of the dataset). Pretrained weights come from a local file only (nothing is
downloaded); parameters whose shape depends on the number of classes (the head) are
found generically by building the architecture twice on the meta device, so loading a
1000-class ImageNet file into a 7-class model replaces exactly the head.

Under ZeRO-3 the model is built inside deepspeed.zero.Init, which partitions each leaf
module as soon as its own __init__ returns. Torchvision initialises weights *afterwards*
in the parent's __init__ (`for m in self.modules(): nn.init.kaiming_normal_(m.weight)`),
which on an already-partitioned (empty) tensor is a silent no-op. `gathering_inits`
makes each such nn.init call gather that one parameter, initialise it on rank 0 and
re-partition it, so the partitioned model gets exactly the weights an ordinary build
would (bit-identical for the same seed in fp32). What it gathers with is the strategy's hook
(models/partitioned.py): models/ imports no backend.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from zerotrain.models.partitioned import PartitionedInit, hook_of

from zerotrain.models.config import VisionModel
from zerotrain.models.errors import CheckpointError, ConfigError
from zerotrain.models.workload import Workload, restore_buffers

_INIT_FUNCS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
               "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


@functools.lru_cache(maxsize=1)
def classifier_names() -> tuple[str, ...]:
    import torchvision
    return tuple(torchvision.models.list_models(module=torchvision.models))


def is_vision(name: str) -> bool:
    return name in classifier_names()


def _builder_kwargs(name: str, num_classes: int, image_size: int) -> dict:
    kw = {"weights": None, "num_classes": num_classes}
    if name in ("googlenet", "inception_v3"):
        # Auxiliary heads return a tuple in train mode; the Workload expects plain logits.
        kw.update(aux_logits=False, init_weights=True)
    if name.startswith("vit_"):
        kw["image_size"] = image_size  # ViT's position table is sized for the input
    return kw


def construct(name: str, num_classes: int, image_size: int) -> nn.Module:
    """The bare architecture, randomly initialised (what an export's weights load into)."""
    import torchvision
    return torchvision.models.get_model(name, **_builder_kwargs(name, num_classes, image_size))


@dataclass
class ArchInfo:
    shapes: dict[str, tuple]           # state-dict key -> shape for the requested num_classes
    head: list[str]                    # keys whose shape depends on num_classes
    flops_per_sample: Optional[float]  # forward FLOPs of one image (None if not measurable)


def reference_build(name: str, num_classes: int, image_size: int) -> nn.Module:
    """Parameters on the meta device (no memory), buffers real: what an ordinary construction
    makes of them (models.restore_buffers gives those to a model built under zero.Init)."""
    # init_empty_weights (not `torch.device("meta")`): some builders (RegNet) compute
    # layer widths with real tensor arithmetic that meta tensors cannot do.
    from accelerate import init_empty_weights
    # Some builders draw initial values on the CPU before init_empty_weights moves them to meta
    # (ViT's position embedding): leave the global RNG as it was, so that the real model's
    # weights do not depend on whether this ran before (arch_info is cached).
    with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):
        return construct(name, num_classes, image_size)


def _meta_build(name: str, num_classes: int, image_size: int) -> nn.Module:
    return reference_build(name, num_classes, image_size).to("meta")


@functools.lru_cache(maxsize=4)
def arch_info(name: str, num_classes: int, image_size: int) -> ArchInfo:
    """Shapes, head keys and FLOPs from two meta-device builds and one meta forward: costs no
    memory, and a too-small image size fails here with a message instead of in step 1."""
    from torch.utils.flop_counter import FlopCounterMode
    try:
        a = _meta_build(name, num_classes, image_size)
        b = _meta_build(name, num_classes + 1, image_size)
    except (AssertionError, ValueError) as e:  # e.g. ViT: "Input shape indivisible by patch size!"
        raise ConfigError(f"model.name {name} cannot be built for data.image_size {image_size}: {e}") from None
    sa, sb = a.state_dict(), b.state_dict()
    head = [k for k in sa if sa[k].shape != sb[k].shape]
    flops = None
    a.eval()
    try:
        with FlopCounterMode(display=False) as counter:
            a(torch.empty(1, 3, image_size, image_size, device="meta"))
        flops = float(counter.get_total_flops())
    except NotImplementedError:
        pass  # an op without a meta kernel: skip the check, not the run
    except (AssertionError, RuntimeError, ValueError) as e:
        raise ConfigError(f"model.name {name} cannot classify {image_size}x{image_size} images "
                          f"(data.image_size): {str(e).splitlines()[0]}; use a larger data.image_size "
                          f"(224 is what torchvision's weights were trained at)") from None
    return ArchInfo(shapes={k: tuple(v.shape) for k, v in sa.items()}, head=head, flops_per_sample=flops)


# ----------------------------------------------------------------------------- pretrained weights

def _hub_hint(name: str, tag: str) -> str:
    import torchvision
    try:
        enum = torchvision.models.get_model_weights(name)
        url = enum[tag].url if tag in enum.__members__ else enum.DEFAULT.url
    except (ValueError, KeyError, AttributeError):
        return ""
    return (f"; on a machine with internet download {url} (or run `python -c \"import torchvision; "
            f"torchvision.models.get_model('{name}', weights='{tag}')\"`, which saves it under "
            f"~/.cache/torch/hub/checkpoints/), copy the file here and pass --model.pretrained /path/to/"
            f"{os.path.basename(url)}")


def resolve_pretrained(name: str, spec: str) -> Path:
    """A local file path, or a torchvision weights tag (IMAGENET1K_V2, DEFAULT) that is already in
    the local torch hub cache. Never downloads."""
    p = Path(spec).expanduser()
    if p.is_file():
        return p
    looks_like_tag = "/" not in spec and "." not in spec
    if looks_like_tag:
        import torchvision
        try:
            enum = torchvision.models.get_model_weights(name)
        except ValueError:
            enum = None
        if enum is not None and spec in enum.__members__:
            cached = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(enum[spec].url)
            if cached.is_file():
                return cached
            raise ConfigError(f"model.pretrained {spec}: zerotrain does not download weights and {cached} is not "
                              f"there{_hub_hint(name, spec)}")
        tags = ", ".join(enum.__members__) if enum is not None else "none known"
        raise ConfigError(f"model.pretrained {spec!r} is neither a file nor a torchvision weights tag of {name} "
                          f"({tags}); give a local .safetensors or .pth file")
    raise ConfigError(f"model.pretrained {p} does not exist; give a local .safetensors or torchvision .pth file"
                      f"{_hub_hint(name, 'DEFAULT')}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a .safetensors file or a torch pickle read with weights_only=True (no code runs)."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            sd = load_file(str(path))
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is the file's fault
        raise CheckpointError(f"model.pretrained {path}: cannot read it as "
                              f"{'safetensors' if path.suffix == '.safetensors' else 'a torch weights file'} "
                              f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); give a .safetensors file or "
                              f"a plain state_dict saved with torch.save") from None
    for wrapper in ("state_dict", "model", "model_state_dict"):  # training-script checkpoints
        if isinstance(sd, dict) and isinstance(sd.get(wrapper), dict):
            sd = sd[wrapper]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CheckpointError(f"model.pretrained {path} does not hold a state_dict (name -> tensor)")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def match_weights(sd: dict, info: ArchInfo, path: Path, name: str) -> tuple[dict, list[str]]:
    """The tensors to load and the head keys left at their fresh initialisation.
    Anything else that does not fit is an error: silently re-initialising a backbone
    layer would look like a successful fine-tune of a worse model."""
    head = set(info.head)
    optional = ("num_batches_tracked",)  # absent from checkpoints of old torch versions
    unexpected = [k for k in sd if k not in info.shapes and not k.startswith("aux")]  # aux heads are dropped
    missing = [k for k in info.shapes if k not in sd and k not in head and not k.endswith(optional)]
    wrong = [f"{k} {tuple(sd[k].shape)} vs {info.shapes[k]}" for k in info.shapes
             if k in sd and k not in head and tuple(sd[k].shape) != info.shapes[k]]
    if unexpected or missing or wrong:
        parts = [f"{label}: {', '.join(keys[:4])}{' ...' if len(keys) > 4 else ''}"
                 for label, keys in (("unexpected keys", unexpected), ("missing keys", missing),
                                     ("shape mismatch (file vs model)", wrong)) if keys]
        raise CheckpointError(f"model.pretrained {path} does not fit {name} ({'; '.join(parts)}); is it a {name} "
                              f"checkpoint (and, for ViT, trained at this data.image_size)?")
    use = {k: v for k, v in sd.items() if k in info.shapes and tuple(v.shape) == info.shapes[k]}
    return use, [k for k in info.head if k not in use]


def load_into(model: nn.Module, weights: dict[str, torch.Tensor], partition: Optional[PartitionedInit] = None):
    """Copy `weights` into a model that may be ZeRO-3 partitioned (one module at a time; `partition`:
    the strategy's hook, models/partitioned.py, when it is)."""
    import torch.distributed as dist
    for prefix, module in model.named_modules():
        prefix = f"{prefix}." if prefix else ""
        for bname, buf in module.named_buffers(recurse=False):
            if prefix + bname in weights:
                buf.data.copy_(weights[prefix + bname])
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if prefix + n in weights]
        if not params:
            continue
        partitioned = partition.partitioned([p for _, p in params]) if partition is not None else []
        if partitioned:
            gather = partition.gathered(partitioned, modifier_rank=0)
        else:
            gather = contextlib.nullcontext()
        with gather, torch.no_grad():
            if not partitioned or not dist.is_initialized() or dist.get_rank() == 0:
                for n, p in params:
                    p.data.copy_(weights[prefix + n])


# ----------------------------------------------------------------------------- ZeRO-3 construction

def _gathering(fn, partition: PartitionedInit):
    @functools.wraps(fn)
    def init_whole(tensor, *args, **kwargs):
        if not partition.needs_gather(tensor):
            return fn(tensor, *args, **kwargs)
        # Every rank runs `fn` (same RNG stream); rank 0's result is broadcast and re-partitioned.
        with partition.gathered([tensor], modifier_rank=0):
            fn(tensor, *args, **kwargs)
        return tensor
    return init_whole


@contextlib.contextmanager
def gathering_inits(partition: Optional[PartitionedInit]):
    """Make torch.nn.init work on parameters that zero.Init already partitioned (`partition`: the
    strategy's hook; None: nothing is partitioned, nothing to do): in nn.init itself and wherever
    torch.nn / torchvision imported the functions by name (nn.MultiheadAttention does
    `from torch.nn.init import constant_`)."""
    if partition is None:
        yield
        return
    import sys
    originals = {id(getattr(nn.init, n)): getattr(nn.init, n) for n in _INIT_FUNCS if hasattr(nn.init, n)}
    wrapped = {i: _gathering(fn, partition) for i, fn in originals.items()}
    patched = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not (mod_name.startswith(("torch.nn", "torchvision"))):
            continue
        for n in _INIT_FUNCS:
            fn = getattr(mod, n, None)
            if fn is not None and id(fn) in originals and originals[id(fn)] is fn:
                patched.append((mod, n, fn))
    try:
        for mod, n, fn in patched:
            setattr(mod, n, wrapped[id(fn)])
        yield
    finally:
        for mod, n, fn in patched:
            setattr(mod, n, fn)


# ----------------------------------------------------------------------------- activation checkpointing

# Architecture name prefix -> containers whose children are the checkpointed units (residual
# blocks, transformer layers, stages). Each unit starts with a convolution, a norm or a layer
# of its own, never with an in-place activation of its input (which recomputation would see
# modified): VGG, AlexNet, SqueezeNet, DenseNet, MNASNet, GoogLeNet and Inception are not listed.
CHECKPOINT_UNITS = {
    "resnet": ("layer1", "layer2", "layer3", "layer4"), "resnext": ("layer1", "layer2", "layer3", "layer4"),
    "wide_resnet": ("layer1", "layer2", "layer3", "layer4"), "vit_": ("encoder.layers",),
    "convnext": ("features",), "efficientnet": ("features",), "mobilenet": ("features",),
    "regnet": ("trunk_output",), "swin": ("features",), "maxvit": ("blocks",),
    "shufflenet": ("stage2", "stage3", "stage4"),
}


def enable_activation_checkpointing(model: nn.Module, name: str) -> int:
    """Recompute each block of a torchvision classifier in backward (models/checkpointing.py);
    ConfigError for an architecture where that is not possible. Returns the number of units."""
    from zerotrain.models.checkpointing import checkpoint_modules
    prefix = next((p for p in CHECKPOINT_UNITS if name.startswith(p)), None)
    if prefix is None:
        families = ", ".join(p.rstrip("_") + "*" for p in CHECKPOINT_UNITS)
        raise ConfigError(f"model.activation_checkpointing: {name} has no blocks zerotrain can recompute (its "
                          f"layers modify their inputs in place, or it has no repeated blocks); supported: "
                          f"{families}; set model.activation_checkpointing false")
    units = [child for path in CHECKPOINT_UNITS[prefix] for child in model.get_submodule(path).children()]
    return checkpoint_modules(units)


# ----------------------------------------------------------------------------- the workload

def build_vision(cfg: VisionModel, data, init_context):
    name = cfg.name
    if data.task != "classify":
        raise ConfigError(f'model.name {name} is an image classifier; it needs data.kind = "imagefolder" '
                          f"(got a {data.task} task)")
    num_classes = cfg.num_classes or data.num_classes
    if data.num_classes and num_classes < data.num_classes:
        raise ConfigError(f"model.num_classes {num_classes} is smaller than the {data.num_classes} classes in "
                          f"the dataset; raise it or leave it unset")
    image_size = data.extra["image_size"]
    info = arch_info(name, num_classes, image_size)
    weights, new_head = None, info.head
    if cfg.pretrained:
        path = resolve_pretrained(name, cfg.pretrained)
        weights, new_head = match_weights(read_state_dict(path), info, path, name)
    elif cfg.freeze_backbone:
        raise ConfigError("model.freeze_backbone needs model.pretrained (a frozen random backbone learns nothing)")

    partition = hook_of(init_context)
    with init_context(), gathering_inits(partition):
        model = construct(name, num_classes, image_size)
    if partition is not None:
        # zero.Init made the BatchNorm statistics bf16; the file's (or fresh) fp32 values go in next.
            restore_buffers(model, reference_build(name, num_classes, image_size))
    if weights is not None:
        load_into(model, weights, partition)
    if cfg.freeze_backbone:
        trainable = set(info.head)
        for n, p in model.named_parameters():
            p.requires_grad_(n in trainable)
    if cfg.activation_checkpointing:
        enable_activation_checkpointing(model, name)
    return Workload(model=model, task="classify", family="vision",
                    model_config={"family": "vision", "arch": name, "num_classes": num_classes,
                                  "image_size": image_size, "class_names": data.class_names,
                                  "pretrained": cfg.pretrained, "new_head": new_head,
                                  "frozen_backbone": cfg.freeze_backbone},
                    # training = forward + backward (2x forward)
                    flops_per_item=3 * info.flops_per_sample if info.flops_per_sample else None)


def meta_vision(cfg: VisionModel, data) -> tuple[nn.Module, dict]:
    """The classifier build_vision would make, parameters on the meta device (for sizing)."""
    num_classes = cfg.num_classes or data.num_classes
    image_size = data.extra["image_size"]
    info = arch_info(cfg.name, num_classes, image_size)
    model = reference_build(cfg.name, num_classes, image_size)
    if cfg.freeze_backbone:
        for n, p in model.named_parameters():
            p.requires_grad_(n in set(info.head))
    return model, {"family": "vision", "arch": cfg.name, "num_classes": num_classes, "image_size": image_size}


def load_exported(export_dir: str | os.PathLike) -> tuple[nn.Module, dict]:
    """(model in eval mode, its config.json) from a zerotrain export of a vision run: what
    inference code needs, with nothing but torchvision and safetensors."""
    import json

    from safetensors.torch import load_file
    d = Path(export_dir)
    try:
        meta = json.loads((d / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d}: no readable config.json ({e}); is it a zerotrain export directory?") from None
    if meta.get("family") != "vision":
        raise CheckpointError(f"{d} holds a {meta.get('family')!r} model, not a vision classifier")
    if (d / "model.safetensors.index.json").is_file():
        files = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    sd = {}
    for f in files:
        sd.update(load_file(str(d / f)))
    model = construct(meta["arch"], meta["num_classes"], meta["image_size"])
    model.load_state_dict(sd, strict=True)
    return model.eval(), meta
