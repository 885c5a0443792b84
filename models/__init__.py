"""Model registry: build any supported model by name, with the loss that trains it.

`model.name` is a GPT preset (models/gpt.py), "linear", a torchvision classifier
(models/vision.py) or "hf:<local dir>" (models/hf.py). Every builder returns a Workload:
the nn.Module plus how to compute its loss and per-sample eval statistics from a batch,
so the trainer never branches on the model type.
"""

from __future__ import annotations

import contextlib
import math
import types
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.losses import cross_entropy, token_losses
from train.config import ModelConfig
from train.errors import ConfigError


@dataclass
class Workload:
    model: nn.Module
    task: str                              # "lm" | "classify" | "regress"
    family: str                            # "gpt" | "hf" | "vision" | "linear"
    model_config: dict                     # enough to rebuild the architecture (saved with exports)
    hidden_size: Optional[int] = None
    flops_per_item: Optional[float] = None  # training FLOPs per token (LM) or per sample
    tied: list = field(default_factory=list)  # [(alias, source)] parameter names sharing storage

    def logits(self, model, batch):
        if self.family == "hf":
            return model(input_ids=batch["input_ids"]).logits
        if self.task == "lm":
            return model(batch["input_ids"])
        if self.task == "classify":
            return model(batch["pixel_values"])
        return model(batch["x"])

    def loss(self, model, batch) -> torch.Tensor:
        """Mean loss over the micro-batch, in fp32. LMs: models/losses.py's chunked
        cross-entropy, the fp32 mathematics of F.cross_entropy(logits.float(), labels) without
        an fp32 copy of the (B, T, V) logits or a saved fp32 log-softmax (issue 12)."""
        out = self.logits(model, batch)
        if self.task == "lm":
            return cross_entropy(out.reshape(-1, out.size(-1)), batch["labels"].reshape(-1))
        out = out.float()  # classification / regression outputs are small
        if self.task == "classify":
            return F.cross_entropy(out, batch["labels"])
        return F.mse_loss(out, batch["y"].float())

    @torch.no_grad()
    def eval_stats(self, model, batch) -> dict[str, torch.Tensor]:
        """Per-sample statistics (shape [B]) so that gather_for_metrics can drop padding exactly."""
        out = self.logits(model, batch)
        if self.task == "lm":
            labels = batch["labels"]
            per_tok = token_losses(out.reshape(-1, out.size(-1)), labels.reshape(-1)).view(labels.shape)  # (B, T)
            return {"loss": per_tok.mean(1)}
        out = out.float()
        if self.task == "classify":
            labels = batch["labels"]
            top = out.topk(min(5, out.size(-1)), dim=-1).indices                            # (B, 5)
            return {"loss": F.cross_entropy(out, labels, reduction="none"),
                    "top1": (top[:, 0] == labels).float(),
                    "top5": (top == labels[:, None]).any(-1).float()}
        return {"loss": ((out - batch["y"].float()) ** 2).mean(-1)}

    @staticmethod
    def _norm_stats(model) -> list[tuple[nn.Module, str]]:
        return [(m, name) for m in model.modules()
                if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
                for name in ("running_mean", "running_var") if getattr(m, name) is not None]

    @staticmethod
    def keep_norm_stats_fp32(model) -> int:
        """DeepSpeed bf16/fp16 casts the parameters, not the buffers, and batch_norm refuses a
        16-bit weight next to fp32 running statistics. Rounding the statistics to 16 bits (and
        accumulating their momentum updates there) would change the model; instead each BatchNorm
        computes with its affine parameters upcast: statistics stay fp32 under every strategy,
        input and output keep the compute dtype. Returns the number of BatchNorm modules."""
        n = 0
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm):
                m.forward = types.MethodType(_batch_norm_fp32_affine, m)
                n += 1
        return n

    @torch.no_grad()
    def sync_norm_stats(self, model):
        """Average BatchNorm running statistics over ranks before evaluating or exporting.
        DDP copies rank 0's buffers at each training forward, DeepSpeed never syncs them: without
        this each rank evaluates with its own statistics and rank 0 exports only its own."""
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        bufs = [getattr(m, name) for m, name in self._norm_stats(model)]
        if not bufs:
            return
        flat = torch.cat([b.float().reshape(-1) for b in bufs])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for b in bufs:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()


def _batch_norm_fp32_affine(self, x: torch.Tensor) -> torch.Tensor:
    """torch's _BatchNorm.forward (torch 2.x) with weight and bias in fp32: the mixed-dtype
    batch_norm kernels (16-bit input, fp32 parameters and statistics) exist on CPU and CUDA."""
    self._check_input_dim(x)
    momentum = 0.0 if self.momentum is None else self.momentum
    if self.training and self.track_running_stats and self.num_batches_tracked is not None:
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
    bn_training = self.training or (self.running_mean is None and self.running_var is None)
    use_stats = not self.training or self.track_running_stats
    return F.batch_norm(x, self.running_mean if use_stats else None, self.running_var if use_stats else None,
                        None if self.weight is None else self.weight.float(),
                        None if self.bias is None else self.bias.float(), bn_training, momentum, self.eps)


def restore_buffers(model: nn.Module, reference: nn.Module, keep: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Give a model built inside deepspeed.zero.Init the buffers an ordinary construction makes.

    zero.Init turns every floating tensor created in a constructor into the training dtype
    (bf16): rotary tables, BatchNorm statistics, masks. Under ZeRO-1/2 and DDP they stay as
    built (fp32), so without this a ZeRO-3 bf16 run trains a different model. `reference` is the
    same architecture built with its parameters on the meta device and real buffers
    (accelerate.init_empty_weights(include_buffers=False): no parameter memory). Buffers for
    which keep(name) is true (loaded from a checkpoint) only get their dtype back. Returns
    the names of the buffers replaced."""
    ref = dict(reference.named_buffers())
    fixed = []
    for name, buf in model.named_buffers():
        r = ref.get(name)
        if buf is None or r is None or not buf.is_floating_point() or r.device.type == "meta":
            continue
        if keep(name):
            if buf.dtype != r.dtype:
                buf.data = buf.data.to(r.dtype)
                fixed.append(name)
        elif buf.dtype != r.dtype or not torch.equal(buf.data.cpu(), r):
            buf.data = r.to(buf.device).clone()
            fixed.append(name)
    return fixed


def lm_context(cfg: ModelConfig) -> tuple[Optional[int], Optional[int]]:
    """(context length, vocab size) of an LM before it is built; (None, None) otherwise."""
    if cfg.name.startswith("hf:"):
        from models.hf import hf_context
        return hf_context(cfg.name[3:])
    from models import gpt
    if cfg.name in gpt.PRESETS:
        c = _gpt_config(cfg, vocab_size=None)
        return c.seq_len, c.vocab_size
    check_model_name(cfg.name)
    return None, None


def check_model_name(name: str):
    """Fail before any data is read if `model.name` names nothing zerotrain can build."""
    from models import gpt
    if name in gpt.PRESETS or name == "linear" or name.startswith("hf:"):
        return
    from models.vision import is_vision
    if is_vision(name):
        return
    from train.errors import did_you_mean
    raise ConfigError(f'model.name "{name}" is unknown{did_you_mean(name, list(gpt.PRESETS) + ["linear"])}: use a '
                      f'GPT preset ({", ".join(gpt.PRESETS)}), "linear", a torchvision classifier (e.g. resnet50) '
                      f'or "hf:<local model dir>"')


def hidden_size_of(cfg: ModelConfig, data=None) -> Optional[int]:
    """Model width before construction (fills DeepSpeed's "auto" bucket and ZeRO-3 sizes); None if
    unknown. Transformers: the hidden size. Other models: the side of their largest weight
    (sqrt of its elements), which plays the same role for bucket and persistence sizes."""
    if cfg.name.startswith("hf:"):
        from models.hf import hf_hidden_size
        return hf_hidden_size(cfg.name[3:])
    from models import gpt
    if cfg.name in gpt.PRESETS:
        return _gpt_config(cfg, vocab_size=None).d_model
    if data is None:
        return None
    if cfg.name == "linear":
        return max(1, math.isqrt(data.num_features + 1))
    from models.vision import arch_info, is_vision
    if is_vision(cfg.name):
        info = arch_info(cfg.name, cfg.num_classes or data.num_classes, data.extra["image_size"])
        return max(1, math.isqrt(max(math.prod(s) for s in info.shapes.values())))
    return None


def partition_counts(model: nn.Module) -> dict:
    """What ZeRO-3 did with this model's parameters on this rank, from the parameters themselves.
    `partitioned_*`: tensors held as a 1/world shard (`held_elements` of them here); `whole_*`:
    tensors every rank holds in full (built outside zero.Init, or at most
    stage3_param_persistence_threshold elements once the engine has marked them)."""
    params = list(model.parameters())
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
    DeepSpeed ZeRO-3 parameter holding only its shard) or whole."""
    c = partition_counts(model)
    if c["built_outside_zero_init"]:
        return (f"WARNING: {c['built_outside_zero_init']} of {c['tensors']} parameters were built whole, outside "
                f"deepspeed.zero.Init ({c['elements'] / 1e6:.2f}M parameters)")
    return (f"model built partitioned by deepspeed.zero.Init: {c['elements'] / 1e6:.2f}M parameters, "
            f"{c['held_elements'] / 1e6:.2f}M held by this rank ({world_size} ranks)")


def _gpt_config(cfg: ModelConfig, vocab_size):
    from models import gpt
    try:
        return gpt.preset(cfg.name, n_layer=cfg.n_layer, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                          d_model=cfg.d_model, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size or vocab_size,
                          dropout=cfg.dropout, tie_embeddings=cfg.tie_embeddings,
                          activation_checkpointing=cfg.activation_checkpointing)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def meta_model(cfg: ModelConfig, data) -> tuple[nn.Module, dict, Optional[int]]:
    """(the model with its parameters on the meta device, its model_config, its width): the
    architecture as build_workload makes it, for sizing before anything is allocated (the
    memory planner). Costs no parameter memory; validates like build_workload."""
    from models import gpt
    name = cfg.name
    width = hidden_size_of(cfg, data)
    if name.startswith("hf:"):
        from models.hf import meta_hf
        model, model_config = meta_hf(cfg)
        return model, model_config, width
    if name in gpt.PRESETS:
        gcfg = _gpt_config(cfg, vocab_size=data.vocab_size)
        with torch.device("meta"):
            model = gpt.GPT(gcfg)
        return model, {"family": "gpt", **gcfg.to_dict()}, width
    if name == "linear":
        from models.linear import LinearRegression
        with torch.device("meta"):
            model = LinearRegression(data.num_features)
        return model, {"family": "linear", "num_features": data.num_features}, width
    from models.vision import is_vision, meta_vision
    if is_vision(name):
        model, model_config = meta_vision(cfg, data)
        return model, model_config, width
    check_model_name(name)
    raise AssertionError(name)


def build_workload(cfg: ModelConfig, data, init_context=contextlib.nullcontext) -> Workload:
    """`data` is the DataBundle (vocab, classes, features); `init_context()` wraps construction
    (deepspeed.zero.Init under ZeRO-3, so that big models are built already partitioned)."""
    from models import gpt
    name = cfg.name
    if name.startswith("hf:"):
        from models.hf import build_hf
        return build_hf(cfg, data, init_context)
    if name in gpt.PRESETS:
        if data.task != "lm":
            raise ConfigError(f"model.name {name} is a language model but data.kind gives a {data.task} task")
        gcfg = _gpt_config(cfg, vocab_size=data.vocab_size)
        if data.vocab_size and gcfg.vocab_size < data.vocab_size:
            raise ConfigError(f"model.vocab_size {gcfg.vocab_size} is smaller than the data's vocabulary "
                              f"{data.vocab_size}; raise model.vocab_size")
        if data.seq_len and data.seq_len > gcfg.seq_len:
            raise ConfigError(f"data.seq_len {data.seq_len} exceeds the model context model.seq_len {gcfg.seq_len}")
        with init_context():
            model = gpt.GPT(gcfg)
        return Workload(model=model, task="lm", family="gpt", model_config={"family": "gpt", **gcfg.to_dict()},
                        hidden_size=gcfg.d_model, flops_per_item=float(gcfg.flops_per_token(data.seq_len)),
                        tied=[("lm_head.weight", "tok_emb.weight")] if gcfg.tie_embeddings else [])
    if name == "linear":
        from models.linear import LinearRegression
        if data.task != "regress":
            raise ConfigError(f'model.name "linear" needs data.kind = "regression" (got a {data.task} task)')
        if cfg.activation_checkpointing:
            raise ConfigError('model.activation_checkpointing: model "linear" has no activations to recompute; '
                              "set it to false")
        with init_context():
            model = LinearRegression(data.num_features)
        return Workload(model=model, task="regress", family="linear",
                        model_config={"family": "linear", "num_features": data.num_features},
                        flops_per_item=6.0 * (data.num_features + 1))
    from models.vision import build_vision, is_vision
    if is_vision(name):
        return build_vision(cfg, data, init_context)
    check_model_name(name)
    raise AssertionError(name)  # check_model_name accepts only names handled above
