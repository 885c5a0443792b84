"""The run file's `model:` section: which model to build and its options.

Part of the run configuration (train/config.py's RunConfig holds it under `model`, loads it
strictly and lists its attribute docstrings in `--help`), but defined here because models/
depends on nothing in train/: the builders read it, models.resolve turns it into a ModelSpec.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerotrain.models.errors import ConfigError


@dataclass
class LoraConfig:
    """model.lora: train low-rank adapters (peft's LoRA) on a frozen language model."""

    r: int = 8
    """Rank of each adapter: a targeted Linear W (out x in) is trained as W + (alpha / r) B A with
    A (r x in) and B (out x r); W stays frozen."""
    alpha: float = 16.0
    """LoRA scaling numerator (peft's lora_alpha): the update is multiplied by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's lora_dropout)."""
    target_modules: Optional[list[str]] = None
    """Names of the Linear modules to adapt (the last part of their module path, e.g. q_proj,v_proj
    for Llama, qkv,proj for the GPT presets). None = every Linear layer except the output head."""

    def __post_init__(self):
        if self.r <= 0:
            raise ConfigError(f"model.lora.r must be a positive integer (got {self.r})")
        if self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha must be > 0 (got {self.alpha})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout must be in [0, 1) (got {self.dropout})")
        if self.target_modules is not None and (not self.target_modules or not all(self.target_modules)):
            raise ConfigError(f"model.lora.target_modules must list module names, e.g. q_proj,v_proj, or be null "
                              f"(every Linear layer but the output head); got {self.target_modules}")


@dataclass
class ModelConfig:
    name: str = "gpt-small-cpu"
    """GPT preset (gpt-tiny, gpt-small-cpu, gpt2-124m, gpt-350m, ... gpt-7b), a torchvision
    classifier (resnet18, resnet50, vit_b_16, ...), "linear", or "hf:<local model dir>"."""
    n_layer: Optional[int] = None
    """GPT overrides of the preset; None keeps the preset's value."""
    n_head: Optional[int] = None
    n_kv_head: Optional[int] = None
    d_model: Optional[int] = None
    seq_len: Optional[int] = None
    """Model context length (GPT). data.seq_len defaults to it."""
    vocab_size: Optional[int] = None
    """GPT vocabulary. None = the data's: the vocabulary a token file's sidecar or a shard set's
    manifest records (`zerotrain prepare` writes its tokenizer's), else the largest token id + 1
    (a raw .bin without a sidecar); 256 for text (bytes); the tokenizer's for sft and stream; the
    preset's own without language-model data. Set it to continue weights trained with another
    vocabulary (model.init_from, `zerotrain import`)."""
    dropout: float = 0.0
    tie_embeddings: Optional[bool] = None
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward: less memory, one more forward per step. GPT
    presets and hf: models (transformers' own, non-reentrant) and torchvision ResNet/ResNeXt/
    ViT/ConvNeXt/EfficientNet/MobileNet/RegNet/Swin/MaxViT/ShuffleNet; other models refuse it."""
    num_classes: Optional[int] = None
    """Vision: classifier outputs; None = number of classes found in the dataset."""
    pretrained: Optional[str] = None
    """Vision: local weights file (.safetensors, or a torchvision .pth read with weights_only=True)."""
    freeze_backbone: bool = False
    """Vision: train only the new classifier head."""
    channels_last: Optional[bool] = None
    """Vision: keep conv weights and input images in NHWC (channels-last) memory layout, which
    cuDNN's tensor-core convolutions use natively. None = on for torchvision models on a CUDA
    GPU, off elsewhere (on CPU it brings nothing measurable for these models)."""
    init_from: Optional[str] = None
    """Start from exported weights: a directory with model.safetensors or model.safetensors.index.json."""
    router_aux_loss_coef: Optional[float] = None
    """Mixture-of-experts hf: models: weight of the router's load-balancing (aux) loss added to
    the LM loss (models/moe.py). None = the model config's router_aux_loss_coef; 0 = logged only."""
    lora: Optional[LoraConfig] = None
    """LoRA fine-tuning (GPT presets and hf: models): only low-rank adapters are trained, the base
    weights stay frozen and are not saved in checkpoints (docs/lora.md). None = off; set any key,
    e.g. --model.lora.r 16, to turn it on."""

    def __post_init__(self):
        for k in ("n_layer", "n_head", "n_kv_head", "d_model", "seq_len", "vocab_size", "num_classes"):
            v = getattr(self, k)
            if v is not None and v <= 0:
                raise ConfigError(f"model.{k} must be a positive integer (got {v})")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1) (got {self.dropout})")
        if not self.name:
            raise ConfigError("model.name must not be empty")
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise ConfigError(f"model.router_aux_loss_coef must be >= 0 (got {self.router_aux_loss_coef})")
