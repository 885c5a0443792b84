"""The run file's `model:` section: which model to build and its options.

Part of the run configuration (train/config/schema.py's RunConfig holds it under `model`, loads it
strictly and lists its attribute docstrings in `--help`), but defined here because models/
depends on nothing in train/: the builders read it, models.resolve turns it into a ModelSpec.

The section is a union tagged by the model family, which `model.name` decides (family_of): one
dataclass per family, each holding only the keys that family reads, so a key of another family
is an unknown key (train/config/loader.py). ModelConfig(name=..., **keys) makes the variant of
a name in code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import ClassVar, Optional

from zerotrain.models.errors import ConfigError, did_you_mean


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


class ModelSection:
    """What every family's variant shares: the tag (`name`) and the starting weights. The
    variants below add only the keys their builders read; a family without LoRA or activation
    checkpointing has no such key and reads as off (the ClassVars)."""

    FAMILY: ClassVar[str]
    TAG: ClassVar[str] = "name"  # the key that picks the variant (train/config/loader.py)
    lora: ClassVar[Optional[LoraConfig]] = None
    activation_checkpointing: ClassVar[bool] = False

    @classmethod
    def variants(cls) -> dict[str, type]:
        return MODEL_FAMILIES

    @classmethod
    def pick(cls, raw: dict) -> type:
        """The variant of a run file's model: mapping (its name, or the default's)."""
        name = raw.get("name", GptModel.name) if isinstance(raw, dict) else GptModel.name
        return MODEL_FAMILIES[family_of(name if isinstance(name, str) else "")]

    @classmethod
    def tag_text(cls) -> str:
        return f"model family {cls.FAMILY}"

    def _check_common(self):
        if not self.name:
            raise ConfigError("model.name must not be empty")
        if family_of(self.name) != self.FAMILY:
            raise ConfigError(f'model.name "{self.name}" is a {family_of(self.name)} model, not {self.FAMILY}')

    @property
    def family(self) -> str:
        return self.FAMILY


_NAME_DOC = ('GPT preset (gpt-tiny, gpt-small-cpu, gpt2-124m, gpt-350m, ... gpt-7b), a torchvision classifier '
             '(resnet18, resnet50, vit_b_16, ...), "linear", "hf:<local model dir>" or '
             '"py:<module>:<function>" (a factory of your own); it decides the family, and so the other keys.')


def _positive(cfg, keys):
    for k in keys:
        v = getattr(cfg, k)
        if v is not None and v <= 0:
            raise ConfigError(f"model.{k} must be a positive integer (got {v})")


@dataclass
class GptModel(ModelSection):
    """a GPT preset (models/gpt.py)."""
    FAMILY: ClassVar[str] = "gpt"
    name: str = "gpt-small-cpu"
    """GPT preset: gpt-tiny, gpt-small-cpu, gpt2-124m, gpt-350m, gpt-760m, gpt-3b, gpt-7b. Other
    families: a torchvision classifier (resnet18, ...), "linear", "hf:<local model dir>",
    "py:<module>:<function>"."""
    n_layer: Optional[int] = None
    """Overrides of the preset; None keeps the preset's value."""
    n_head: Optional[int] = None
    n_kv_head: Optional[int] = None
    d_model: Optional[int] = None
    seq_len: Optional[int] = None
    """Model context length. data.seq_len defaults to it."""
    vocab_size: Optional[int] = None
    """Vocabulary. None = the data's: the vocabulary a token file's sidecar or a shard set's
    manifest records (`zerotrain prepare` writes its tokenizer's), else the largest token id + 1
    (a raw .bin without a sidecar); 256 for text (bytes); the tokenizer's for sft and stream; the
    preset's own without language-model data. Set it to continue weights trained with another
    vocabulary (model.init_from, `zerotrain import`)."""
    dropout: float = 0.0
    tie_embeddings: Optional[bool] = None
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward: less memory, one more forward per step."""
    init_from: Optional[str] = None
    """Start from exported weights: a directory with model.safetensors or model.safetensors.index.json,
    or a Hub id org/name[@revision] holding them (through the cache, as model.name hf:)."""
    lora: Optional[LoraConfig] = None
    """LoRA fine-tuning: only low-rank adapters are trained, the base weights stay frozen and are
    not saved in checkpoints (docs/lora.md). None = off; set any key, e.g. --model.lora.r 16, to
    turn it on."""

    def __post_init__(self):
        self._check_common()
        _positive(self, ("n_layer", "n_head", "n_kv_head", "d_model", "seq_len", "vocab_size"))
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout must be in [0, 1) (got {self.dropout})")


# model.attn_implementation: transformers' own attention kernels (each keeps packed records apart).
ATTN_IMPLEMENTATIONS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


@dataclass
class HfModel(ModelSection):
    """a local Hugging Face causal LM (models/hf.py)."""
    FAMILY: ClassVar[str] = "hf"
    name: str = "hf:"
    """"hf:<local model dir>": a directory save_pretrained wrote (config.json, weights optional);
    or "hf:<org>/<name>[@<revision>]", a Hub id resolved through huggingface_hub's cache (a
    branch, tag or commit; default main): one process per node downloads what is missing while
    the others wait, HF_HUB_OFFLINE=1 reads the cache only. The commit hash is in config.json
    (model.resolved.hub) and the banner. A local path that exists wins over an id."""
    trust_remote_code: bool = False
    """Let transformers import the modelling code the directory (or the Hub id's cached snapshot)
    ships (auto_map in its config.json): Python from that directory runs in every rank. Off by
    default; transformers itself never downloads (the snapshot is fetched before, *.py included)."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward (transformers' own, non-reentrant): less
    memory, one more forward per step."""
    attn_implementation: Optional[str] = None
    """The attention kernel transformers runs: eager, sdpa, flex_attention, flash_attention_2 or
    flash_attention_3. None = the model's own (attn_implementation in its config.json), else
    transformers' default (sdpa where the model has it). The one used is in the banner and in the
    run's and the export's config.json. Packed rows (data.packing, data.document_mask) need one of
    these five; sequence parallelism needs sdpa (docs/long_context.md)."""
    router_aux_loss_coef: Optional[float] = None
    """Mixture-of-experts models: weight of the router's load-balancing (aux) loss added to the
    LM loss (models/moe.py). None = the model config's router_aux_loss_coef; 0 = logged only."""
    init_from: Optional[str] = None
    """Start from exported weights: a directory with model.safetensors or model.safetensors.index.json,
    or a Hub id org/name[@revision] holding them (through the cache, as model.name hf:)."""
    lora: Optional[LoraConfig] = None
    """LoRA fine-tuning: only low-rank adapters are trained, the base weights stay frozen and are
    not saved in checkpoints (docs/lora.md). None = off; set any key, e.g. --model.lora.r 16, to
    turn it on."""

    def __post_init__(self):
        self._check_common()
        if not self.name[3:]:
            raise ConfigError('model.name "hf:" needs a local model directory or a Hub id: hf:<dir> or '
                              'hf:<org>/<name>[@<revision>]')
        if self.attn_implementation is not None and self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ConfigError(f'model.attn_implementation must be one of {", ".join(ATTN_IMPLEMENTATIONS)} (got '
                              f'"{self.attn_implementation}"){did_you_mean(self.attn_implementation, ATTN_IMPLEMENTATIONS)}'
                              f'; or null for the model\'s own')
        if self.router_aux_loss_coef is not None and not self.router_aux_loss_coef >= 0:
            raise ConfigError(f"model.router_aux_loss_coef must be >= 0 (got {self.router_aux_loss_coef})")


@dataclass
class VisionModel(ModelSection):
    """a torchvision classifier (models/vision.py)."""
    FAMILY: ClassVar[str] = "vision"
    name: str = "resnet18"
    """A torchvision classifier: resnet18, resnet50, vit_b_16, convnext_tiny, ..."""
    num_classes: Optional[int] = None
    """Classifier outputs; None = number of classes found in the dataset."""
    pretrained: Optional[str] = None
    """Local weights file (.safetensors, or a torchvision .pth read with weights_only=True)."""
    freeze_backbone: bool = False
    """Train only the new classifier head."""
    channels_last: Optional[bool] = None
    """Keep conv weights and input images in NHWC (channels-last) memory layout, which cuDNN's
    tensor-core convolutions use natively. None = on on a CUDA GPU, off elsewhere (on CPU it
    brings nothing measurable for these models)."""
    activation_checkpointing: bool = False
    """Recompute each stage's activations in backward: ResNet/ResNeXt/ViT/ConvNeXt/EfficientNet/
    MobileNet/RegNet/Swin/MaxViT/ShuffleNet; other architectures refuse it."""
    init_from: Optional[str] = None
    """Start from exported weights: a directory with model.safetensors or model.safetensors.index.json,
    or a Hub id org/name[@revision] holding them (through the cache, as model.name hf:)."""

    def __post_init__(self):
        self._check_common()
        _positive(self, ("num_classes",))


@dataclass
class LinearModel(ModelSection):
    """"linear", a linear regression (models/linear.py) for data.kind regression."""
    FAMILY: ClassVar[str] = "linear"
    name: str = "linear"
    """"linear": one Linear layer, its width the data's number of features."""
    init_from: Optional[str] = None
    """Start from exported weights: a directory with model.safetensors or model.safetensors.index.json,
    or a Hub id org/name[@revision] holding them (through the cache, as model.name hf:)."""

    def __post_init__(self):
        self._check_common()


PY_LOSSES = ("lm", "classification", "model")


@dataclass
class PyModel(ModelSection):
    """a factory of your own, "py:<module>:<function>"."""
    FAMILY: ClassVar[str] = "py"
    name: str = "py:"
    """"py:<module>:<function>": the function (importable from the working directory or
    PYTHONPATH) is called with model.kwargs and returns the torch.nn.Module to train."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments passed to the factory (a mapping; on the command line YAML or JSON,
    e.g. --model.kwargs '{width: 256}')."""
    loss: Optional[str] = None
    """How the module is trained. "lm": forward(input_ids) returns (B, T, V) logits, trained with
    zerotrain's LM loss; "classification": forward(pixel_values) returns (B, C) logits, cross
    entropy; "model": forward(**batch) returns the loss itself (a scalar tensor, or an object or
    mapping with a "loss" entry). None = "lm" for language-model data, "classification" for images."""
    init_from: Optional[str] = None
    """Start from exported weights: a directory with model.safetensors or model.safetensors.index.json,
    or a Hub id org/name[@revision] holding them (through the cache, as model.name hf:)."""

    def __post_init__(self):
        self._check_common()
        module, _, function = self.name[3:].partition(":")
        if not module or not function:
            raise ConfigError(f'model.name "{self.name}" must be "py:<module>:<function>", e.g. py:mymodels:build')
        if self.loss is not None and self.loss not in PY_LOSSES:
            raise ConfigError(f'model.loss must be one of {", ".join(PY_LOSSES)} (got "{self.loss}")'
                              f'{did_you_mean(self.loss, PY_LOSSES)}')


MODEL_FAMILIES: dict[str, type] = {"gpt": GptModel, "hf": HfModel, "vision": VisionModel, "linear": LinearModel,
                                   "py": PyModel}


def family_of(name: str) -> str:
    """The family a model.name belongs to: hf:<dir>, py:<module>:<function>, "linear", a GPT
    preset (gpt*), else a torchvision classifier (models.resolve checks that it is one)."""
    if name.startswith("hf:"):
        return "hf"
    if name.startswith("py:"):
        return "py"
    if name == "linear":
        return "linear"
    if name.startswith("gpt"):
        return "gpt"
    return "vision"


def ModelConfig(name: str = GptModel.name, **keys) -> ModelSection:  # noqa: N802 - reads like the section it makes
    """The model: section of `name` with `keys`, e.g. ModelConfig(name="resnet18", num_classes=2).
    A key its family does not read raises a ConfigError naming the family."""
    cls = MODEL_FAMILIES[family_of(name)]
    names = [f.name for f in fields(cls)]
    for k in keys:
        if k not in names:
            raise ConfigError(f"model.{k} is not a key of model family {cls.FAMILY} ({name}); its keys: "
                              f"{', '.join(names)}{did_you_mean(k, names)}")
    return cls(name=name, **keys)
