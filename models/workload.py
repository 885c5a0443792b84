"""What every model builder returns: the nn.Module plus how to compute its loss and per-sample
eval statistics from a batch (so the trainer never branches on the model type), and the
buffer repair for models built under deepspeed.zero.Init."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotrain.models.errors import ConfigError
from zerotrain.models.losses import IGNORE_INDEX, cross_entropy, token_losses

if TYPE_CHECKING:
    from zerotrain.models.moe import MoEInfo, MoEStats
    from zerotrain.models.preference import Preference


@dataclass
class Workload:
    model: nn.Module
    task: str                              # "lm" | "classify" | "regress"
    family: str                            # "gpt" | "hf" | "vision" | "linear" | "py"
    model_config: dict                     # enough to rebuild the architecture (saved with exports)
    hidden_size: Optional[int] = None
    flops_per_item: Optional[float] = None  # training FLOPs per token (LM) or per sample
    tied: list = field(default_factory=list)  # [(alias, source)] parameter names sharing storage
    lora: Optional[dict] = None             # model.lora's adapter (models/lora.py apply): r, alpha, targets, base
    moe: Optional["MoEStats"] = None        # sparse-MoE hf: models (models/moe.py): aux loss, expert load
    model_loss: bool = False                # py: models with model.loss "model": forward(**batch) returns the loss
    sparse: Optional["MoEInfo"] = None      # sparse-MoE blocks of a py: model: ZeRO-3 leaves, its own loss
    preference: Optional["Preference"] = None  # train.objective dpo: the pair loss and its metrics (models/preference.py)

    @property
    def moe_info(self) -> Optional["MoEInfo"]:
        """The sparse-MoE blocks to make ZeRO-3 leaves (hf: models' with their aux loss, or a py: model's)."""
        return self.moe.info if self.moe is not None else self.sparse

    def logits(self, model, batch):
        """Packed rows (data.packing, data.document_mask) carry position_ids that restart per
        document: transformers builds its packed-sequence mask from them (models/hf.py
        check_packing); the GPT takes the document index too and masks with it."""
        if self.family == "hf":
            return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids")).logits
        if self.task == "lm":
            if "doc_ids" in batch:
                return model(batch["input_ids"], position_ids=batch["position_ids"], doc_ids=batch["doc_ids"])
            return model(batch["input_ids"])
        if self.task == "classify":
            return model(batch["pixel_values"])
        return model(batch["x"])

    def loss(self, model, batch, denominator: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean loss over the micro-batch, in fp32. LMs: models/losses.py's chunked
        cross-entropy, the fp32 mathematics of F.cross_entropy(logits.float(), labels) without
        an fp32 copy of the (B, T, V) logits or a saved fp32 log-softmax.
        `denominator` (LMs only): the summed token loss is divided by it instead of by this
        micro-batch's number of labelled tokens (the trainer's token-count normalisation).
        A py: model with model.loss "model" returns its own loss from forward(**batch)
        (models/user.py): taken as it is, `denominator` not applied."""
        if self.preference is not None:  # pairs of preference data: DPO / IPO / SimPO, mean over pairs
            return self.preference.loss(self, model, batch)
        if self.model_loss:
            return own_loss(model(**batch))
        if self.moe is not None:  # the router's aux loss and routed tokens come with the logits
            out = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), output_router_logits=True)
            lm = cross_entropy(out.logits.reshape(-1, out.logits.size(-1)), batch["labels"].reshape(-1),
                               denominator=denominator)
            return self.moe.loss(out, lm)
        out = self.logits(model, batch)
        if self.task == "lm":
            self._check_lm_logits(out, batch)
            return cross_entropy(out.reshape(-1, out.size(-1)), batch["labels"].reshape(-1), denominator=denominator)
        assert denominator is None, "token-count normalisation is for language models"
        out = out.float()  # classification / regression outputs are small
        if self.task == "classify":
            return F.cross_entropy(out, batch["labels"])
        return F.mse_loss(out, batch["y"].float())

    def _check_lm_logits(self, out: torch.Tensor, batch) -> None:
        """A py: model with model.loss lm must return (B, T, V) logits for (B, T) input_ids: one
        row per position. Shapes only (no device read); anything else is the run's one line,
        naming model.name and the contract, instead of a traceback from inside the loss."""
        if self.family != "py":
            return
        ids = batch["input_ids"]
        if out.dim() != 3 or tuple(out.shape[:2]) != tuple(ids.shape):
            b, t = ids.shape
            raise ConfigError(f'model.name "py:{self.model_config["factory"]}" with model.loss lm: forward(input_ids) '
                              f"returned shape {tuple(out.shape)} for input_ids {(b, t)}; the contract is logits "
                              f"(B, T, V) = ({b}, {t}, vocab), one row per position: return those, or set "
                              f'model.loss "model" and return the loss from forward(**batch)')

    def positions(self, batch) -> int:
        """Token positions the model's training forward ran on for this micro-batch: the batch as
        built, padding included (a fixed-length row, a row padded to its batch's longest
        record, preference pairs as rows or packed into rows). Shapes only: no device read.
        0 for a batch without token rows (images, regression)."""
        if self.preference is not None:
            return self.preference.positions(batch)
        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        return ids.numel() if ids is not None else 0

    @torch.no_grad()
    def eval_stats(self, model, batch) -> dict[str, torch.Tensor]:
        """Per-sample statistics (shape [B]) so that gather_for_metrics can drop padding exactly.
        A model that computes its own loss gives one number per micro-batch: each sample carries it."""
        if self.preference is not None:
            return self.preference.eval_stats(self, model, batch)
        if self.model_loss:
            loss = own_loss(model(**batch))
            return {"loss": loss.expand(next(iter(batch.values())).size(0))}
        out = self.logits(model, batch)
        if self.task == "lm":
            self._check_lm_logits(out, batch)
            labels = batch["labels"]
            per_tok = token_losses(out.reshape(-1, out.size(-1)), labels.reshape(-1)).view(labels.shape)  # (B, T)
            # Per sample: the mean over its labelled tokens and their number, so that the
            # validation loss is token-weighted (masked prompts, padding: samples differ in tokens).
            tokens = (labels != IGNORE_INDEX).sum(1)                                             # (B,)
            return {"loss": per_tok.sum(1) / tokens.clamp(min=1).to(per_tok.dtype), "tokens": tokens.to(per_tok.dtype)}
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


def own_loss(out) -> torch.Tensor:
    """The loss a py: model with model.loss "model" returned from forward(**batch) (models/user.py):
    a scalar tensor, or a ModelOutput / mapping with a "loss" entry; fp32."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", out)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        from zerotrain.models.errors import ConfigError
        raise ConfigError(f'model.loss "model": forward(**batch) must return the loss as a scalar tensor (or an '
                          f'object with .loss); it returned {type(out).__name__}')
    return loss.reshape(()).float()


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
