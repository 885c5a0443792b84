"""Model registry: build any supported model by name, with the loss that trains it.

`model.name` is a GPT preset (models/gpt.py), "linear", a torchvision classifier
(models/vision.py) or "hf:<local dir>" (models/hf.py). Every builder returns a Workload:
the nn.Module plus how to compute its loss and per-sample eval statistics from a batch,
so the trainer never branches on the model type.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

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
        """Mean loss over the micro-batch, in fp32."""
        out = self.logits(model, batch).float()
        if self.task == "lm":
            return F.cross_entropy(out.view(-1, out.size(-1)), batch["labels"].reshape(-1))
        if self.task == "classify":
            return F.cross_entropy(out, batch["labels"])
        return F.mse_loss(out, batch["y"].float())

    @torch.no_grad()
    def eval_stats(self, model, batch) -> dict[str, torch.Tensor]:
        """Per-sample statistics (shape [B]) so that gather_for_metrics can drop padding exactly."""
        out = self.logits(model, batch).float()
        if self.task == "lm":
            per_tok = F.cross_entropy(out.transpose(1, 2), batch["labels"], reduction="none")  # (B, T)
            return {"loss": per_tok.mean(1)}
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

    @torch.no_grad()
    def match_norm_stats_dtype(self, model, dtype: torch.dtype):
        """DeepSpeed bf16/fp16 casts parameters but keeps buffers in fp32, and batch_norm refuses a
        bf16 weight with fp32 running statistics: keep them in the parameters' dtype."""
        for m, name in self._norm_stats(model):
            if getattr(m, name).dtype != dtype:
                setattr(m, name, getattr(m, name).to(dtype))

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


def hidden_size_of(cfg: ModelConfig) -> Optional[int]:
    """Model width before construction (fills DeepSpeed's "auto" bucket sizes); None if unknown."""
    if cfg.name.startswith("hf:"):
        from models.hf import hf_hidden_size
        return hf_hidden_size(cfg.name[3:])
    from models import gpt
    if cfg.name in gpt.PRESETS:
        return _gpt_config(cfg, vocab_size=None).d_model
    return None


def partition_summary(model: nn.Module, world_size: int) -> str:
    """How the model was built under ZeRO-3, from the parameters themselves: partitioned at
    construction (every parameter a DeepSpeed ZeRO-3 parameter holding only its shard) or whole."""
    params = list(model.parameters())
    zero = [p for p in params if hasattr(p, "ds_id")]
    total = sum(int(getattr(p, "ds_numel", p.numel())) for p in params)
    if len(zero) != len(params):
        return (f"WARNING: {len(params) - len(zero)} of {len(params)} parameters were built whole, outside "
                f"deepspeed.zero.Init ({total / 1e6:.2f}M parameters)")
    local = sum(p.ds_tensor.numel() for p in zero)
    return (f"model built partitioned by deepspeed.zero.Init: {total / 1e6:.2f}M parameters, "
            f"{local / 1e6:.2f}M held by this rank ({world_size} ranks)")


def _gpt_config(cfg: ModelConfig, vocab_size):
    from models import gpt
    try:
        return gpt.preset(cfg.name, n_layer=cfg.n_layer, n_head=cfg.n_head, n_kv_head=cfg.n_kv_head,
                          d_model=cfg.d_model, seq_len=cfg.seq_len, vocab_size=cfg.vocab_size or vocab_size,
                          dropout=cfg.dropout, tie_embeddings=cfg.tie_embeddings,
                          activation_checkpointing=cfg.activation_checkpointing)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


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
