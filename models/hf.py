"""Local Hugging Face causal LMs: `model.name = "hf:<dir>"`, no network.

The directory is what `save_pretrained` writes: config.json plus model.safetensors (or
sharded safetensors + index). With config.json only, the architecture is trained from
random initialisation. Under ZeRO-3, Accelerate's DeepSpeed plugin (zero3_init_flag) keeps
an HfDeepSpeedConfig alive, so `from_pretrained` builds the model inside
deepspeed.zero.Init and loads the weights one partition at a time: the model never
exists whole on one device.

Exports: train/checkpoint/consolidate.py writes the weights (same names as `save_pretrained`) and
calls `save_hf_config` here for config.json, generation config and tokenizer files, so
`AutoModelForCausalLM.from_pretrained(<run_dir>/export)` just works.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

import torch

from zerotrain.models.errors import CheckpointError, ConfigError, DataError
from zerotrain.models.partitioned import builds_empty, hook_of
from zerotrain.models.spec import ModelSpec
from zerotrain.models.workload import Workload, restore_buffers

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# Copied next to exported weights so the export is a complete model directory.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "seq_length", "max_sequence_length")
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")


def model_dir(path: str) -> Path:
    """The model's local directory: `path`, or the cached snapshot of the Hub id it names
    (models/hub.py; train/launch/hub_fetch.py downloaded it before the model was resolved)."""
    import zerotrain.models.hub as hub
    d = hub.local_path(path, "model.name")
    if not d.is_dir():
        raise ConfigError(f"model.name hf:{path}: {d} is not a directory; give a local Hugging Face model "
                          f"directory (config.json + model.safetensors), e.g. one written by save_pretrained")
    if not (d / "config.json").is_file():
        raise ConfigError(f"model.name hf:{path}: {d} has no config.json; it must be a Hugging Face model "
                          f"directory (save_pretrained / huggingface-cli download output)")
    return d


def hub_commit(spec: ModelSpec) -> Optional[dict]:
    """{"id", "revision", "commit"} of a model named by a Hub id (config.json and the banner), else None."""
    import zerotrain.models.hub as hub
    return hub.commit_of(spec.name[3:], "model.name")


def remote_code(d: Path) -> list[str]:
    """The modeling files config.json's auto_map names (a model with its own code), [] for none."""
    import json
    try:
        auto_map = json.loads((d / "config.json").read_text()).get("auto_map") or {}
    except (ValueError, OSError, AttributeError):
        return []  # transformers' own read says what is wrong with the file
    refs = auto_map.values() if isinstance(auto_map, dict) else []
    refs = [r for ref in refs for r in (ref if isinstance(ref, (list, tuple)) else [ref]) if isinstance(r, str)]
    return sorted({f"{r.split('--')[-1].rsplit('.', 1)[0]}.py" for r in refs})


def load_config(path: str, trust_remote_code: bool = False):
    from transformers import AutoConfig
    d = model_dir(path)
    code = remote_code(d)
    if code and not trust_remote_code:
        raise ConfigError(f"model.name hf:{path}: {d / 'config.json'} names its own modeling code ({', '.join(code)} "
                          f"in auto_map); set model.trust_remote_code true to run it (local files only)")
    if trust_remote_code and not code:
        raise ConfigError(f"model.trust_remote_code: {d / 'config.json'} names no modeling code of its own (no "
                          f"auto_map); transformers knows this model: remove the key")
    try:
        # Local files only: a remote-code model runs the .py files of this directory, never a download.
        return AutoConfig.from_pretrained(str(d), local_files_only=True, trust_remote_code=trust_remote_code)
    except (ValueError, KeyError, OSError, ImportError) as e:
        raise ConfigError(f"model.name hf:{path}: transformers cannot read {d / 'config.json'} "
                          f"({str(e).splitlines()[0][:200]})") from None


def _first(config, keys) -> Optional[int]:
    for k in keys:
        v = getattr(config, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def spec_fields(path: str, trust_remote_code: bool = False, attn_implementation: Optional[str] = None) -> dict:
    """What models.resolve keeps of a local model directory, from its one read of config.json:
    context length, vocabulary and width before anything is built, and the parsed config.
    The attention implementation asked for (model.attn_implementation, else config.json's own) is
    kept as the dict's "attn_implementation": transformers' to_dict() leaves it out, and
    from_dict() reads it back under that key (absent: transformers' default)."""
    config = load_config(path, trust_remote_code)
    hf_config = config.to_dict()
    impl = attn_implementation or requested_attention(config)
    if impl:
        hf_config["attn_implementation"] = impl
    return {"context": _first(config, _CONTEXT_KEYS), "vocab_size": getattr(config, "vocab_size", None),
            "hidden_size": _first(config, _WIDTH_KEYS), "hf_config": hf_config}


def requested_attention(config) -> Optional[str]:
    """The attention implementation a transformers config asks for (config.json's
    attn_implementation), None when it names none. A str only (a per-sub-config dict: the text model's)."""
    impl = getattr(config, "_attn_implementation", None)
    if isinstance(impl, dict):
        impl = impl.get("") or impl.get("text_config")
    return impl if isinstance(impl, str) and impl else None


def config_of(spec: ModelSpec):
    """A fresh transformers config (the builders change theirs, e.g. use_cache) from the spec's
    parsed config.json, without reading the file again: from_dict is how AutoConfig.from_pretrained
    makes it too, and to_dict() -> from_dict() gives back an equal config. A model with its own
    code (model.trust_remote_code): its config class is in that code, so the directory is read again."""
    if spec.config.trust_remote_code:
        config = load_config(spec.name[3:], True)
        if spec.hf_config.get("attn_implementation"):
            config._attn_implementation = spec.hf_config["attn_implementation"]
        return config
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    return CONFIG_MAPPING[spec.hf_config["model_type"]].from_dict(spec.hf_config)


def weight_files(d: Path) -> list[str]:
    return [f for f in WEIGHT_FILES if (d / f).is_file()]


def _module_name(model, module) -> Optional[str]:
    for name, m in model.named_modules():
        if m is module:
            return name
    return None


def tied_names(model) -> list[tuple[str, str]]:
    """[(lm_head weight, input embedding weight)] when the config ties them."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    out_emb, in_emb = model.get_output_embeddings(), model.get_input_embeddings()
    if out_emb is None or in_emb is None or out_emb.weight is not in_emb.weight:
        return []
    return [(f"{_module_name(model, out_emb)}.weight", f"{_module_name(model, in_emb)}.weight")]


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))  # ZeRO-3: the full size, not the local shard


def _check_zero3(init_context):
    """Under ZeRO-3 transformers must see the DeepSpeed config, or from_pretrained would load
    whole weights into already-partitioned (empty) parameters."""
    from transformers.integrations import is_deepspeed_zero3_enabled as zero3_on  # backend-test: transformers' own global
    want = hook_of(init_context) is not None
    if want != zero3_on():
        raise RuntimeError(f"ZeRO-3 construction expected={want} but transformers reports "
                           f"is_deepspeed_zero3_enabled()={zero3_on()}: the Accelerator's "
                           f"DeepSpeedPlugin must be created (zero3_init_flag) before the model")


def check_vocab(data, model_vocab: int, what: str):
    """Token ids must index the model's embedding: an id >= vocab would crash (or, on GPU,
    corrupt memory) deep inside step 1. Raises before any training."""
    top = data.extra.get("max_token")
    if top is not None and top >= model_vocab:
        raise DataError(f"{data.extra.get('token_file')} contains token id {top} but {what} has a vocabulary of "
                        f"{model_vocab}; prepare the data with the model's tokenizer or raise the model's vocab size")


def build_hf(spec: ModelSpec, data, init_context):
    from transformers import AutoModelForCausalLM

    if data.task != "lm":
        raise ConfigError(f"model.name {spec.name} is a causal language model; use data.kind tokens or text "
                          f"(got a {data.task} task)")
    d = model_dir(spec.name[3:])
    config = config_of(spec)
    vocab = spec.vocab_size
    if vocab and "max_token" in data.extra:
        check_vocab(data, vocab, f"{d}")  # the ids actually present decide (a tokenizer may list unused extras)
    elif vocab and data.vocab_size and data.vocab_size > vocab:
        raise ConfigError(f"the data's vocabulary ({data.vocab_size}) is larger than {d}'s vocab_size {vocab}; "
                          f"prepare the data with this model's tokenizer (zerotrain prepare --tokenizer {d})")
    _check_zero3(init_context)
    config.use_cache = False  # training: no KV cache
    files = weight_files(d)
    # fp32 master weights; DeepSpeed bf16 / Accelerate autocast decide the compute dtype.
    remote = spec.config.trust_remote_code
    if builds_empty(init_context):
        # Shapes only (FSDP2 on ranks but 0): the backend fills every tensor from rank 0's build,
        # which reads the weights and checks them against config.json.
        with init_context():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=remote)
    elif files:
        try:
            model, info = AutoModelForCausalLM.from_pretrained(str(d), config=config, dtype=torch.float32,
                                                               local_files_only=True, output_loading_info=True,
                                                               trust_remote_code=remote,
                                                               use_safetensors=None if "pytorch_model" in files[0]
                                                               else True)
        except (ValueError, ImportError) as e:
            raise ConfigError(f"model.name {spec.name}: {str(e).splitlines()[0][:300]}"
                              f"{_attention_fix(spec, e)}") from None
        missing = list(info.get("missing_keys") or [])
        mismatched = list(info.get("mismatched_keys") or [])
        if missing or mismatched:
            raise CheckpointError(f"{d}: the weights do not fit config.json (missing: {missing[:4]}, shape "
                                  f"mismatch: {mismatched[:4]}); the directory is incomplete or mixed up")
    else:
        print(f"zerotrain: {d} has no weights ({', '.join(WEIGHT_FILES[:2])}): training {config.model_type} from "
              f"random initialisation", flush=True)
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=remote)
        except (ValueError, ImportError) as e:
            if not _attention_fix(spec, e):
                raise
            raise ConfigError(f"model.name {spec.name}: {str(e).splitlines()[0][:300]}{_attention_fix(spec, e)}") \
                from None
    attention = model.config._attn_implementation  # what transformers runs (its default when none was asked)
    if data.extra.get("packed"):  # the flag that packs documents into rows (data.packing, data.document_mask)
        check_packing(model, spec.name, data.extra["packed"])
    if hook_of(init_context) is not None:
        _restore_buffers(model, config, d, files, remote)
    if spec.config.activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"model.activation_checkpointing: transformers has no gradient checkpointing for "
                              f"{config.model_type} ({type(model).__name__}); set model.activation_checkpointing false")
        # Non-reentrant: gradients reach every trainable parameter even when a checkpointed layer's
        # input needs none (frozen embeddings), and the layers' ZeRO-3 hooks run in the recomputation.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    n_params = sum(_numel(p) for p in model.parameters())
    width = spec.hidden_size
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    flops = flops_per_token(model, width, layers, data.seq_len)
    moe = _moe(model, config, spec)
    if moe is not None:
        flops -= 6.0 * moe.info.active_params_delta  # FLOPs follow the active parameters (top-k experts)
    return Workload(model=model, task="lm", family="hf",
                    model_config={"family": "hf", "source": str(d.resolve()), "model_type": config.model_type,
                                  "config": config.to_dict(), "attn_implementation": attention,
                                  "num_params": n_params,
                                  **({"trust_remote_code": True} if remote else {}),
                                  **({"hub": hub_source} if (hub_source := hub_commit(spec)) else {})},
                    hidden_size=width, flops_per_item=flops, tied=tied_names(model), moe=moe)


def _attention_fix(spec: ModelSpec, error: Exception) -> str:
    """'; set ...' when transformers refused the attention implementation asked for (a kernel that is
    not installed or that the model does not have), '' for any other error."""
    impl = (spec.hf_config or {}).get("attn_implementation")
    if not impl or "attention" not in str(error).lower():
        return ""
    where = "model.attn_implementation" if spec.config.attn_implementation else \
        f"attn_implementation in {spec.name[3:]}/config.json"
    return f" ({where} is {impl}); set model.attn_implementation sdpa (or eager)"


def _moe(model, config, spec: ModelSpec):
    """models/moe.py's accumulators for a sparse-MoE model; None (and the override refused) for a dense one."""
    from zerotrain.models.moe import MoEStats, detect
    info = detect(model, config, spec.config.router_aux_loss_coef)
    if info is None:
        if spec.config.router_aux_loss_coef is not None:
            raise ConfigError(f"model.router_aux_loss_coef: {spec.name} ({config.model_type}) has no sparse "
                              f"mixture-of-experts block; remove the key")
        return None
    return MoEStats(info)


# Attention implementations for which transformers 5.x isolates packed documents from position_ids
# alone: masking_utils.find_packed_sequence_indices turns position restarts into a packed-sequence
# mask (eager, sdpa, flex_attention), and the flash kernels run varlen from the same positions.
PACKING_ATTENTION = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")


def check_packing(model, name: str, flag: str = "data.packing"):
    """data.packing / data.document_mask (`flag`): refuse a model that would attend across the
    packed documents. The model's
    attention must be one of PACKING_ATTENTION and its modeling code must build its mask with
    masking_utils (create_causal_mask: where the packed rows are detected)."""
    import inspect
    impl = getattr(model.config, "_attn_implementation", None)
    source = inspect.getsource(inspect.getmodule(type(model)))
    if impl not in PACKING_ATTENTION:
        raise ConfigError(f"{flag}: model.name {name} uses attention implementation {impl!r}, which cannot "
                          f"keep packed records apart; set model.attn_implementation to one of "
                          f"{', '.join(PACKING_ATTENTION)}, or set {flag} false")
    if "create_causal_mask" not in source:
        raise ConfigError(f"{flag}: {type(model).__name__} ({name}) does not build its attention mask with "
                          f"transformers' masking_utils, so it cannot isolate packed records; set {flag} false")


def flops_per_token(model, width: Optional[int], layers: Optional[int], seq_len: Optional[int]) -> float:
    """Training (fwd+bwd) FLOPs per token, the convention of models/gpt.py flops_per_token:

        6 * N + 12 * L * D * T

    N = every weight that takes part in a matmul: all parameters except embedding tables
    (token and learned position embeddings: lookups, no compute), plus the lm_head weight
    counted once whether or not it is tied to the token embedding (the V x D output matmul is
    real compute either way; model.parameters() lists a tied weight only once, so it must be
    added back). 12 * L * D * T: attention scores and weighted sum (full T x T), when the
    width, depth and sequence length are known."""
    out_emb = model.get_output_embeddings()
    lookups = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = out_emb.weight if out_emb is not None and getattr(out_emb, "weight", None) is not None else None
    n = sum(_numel(p) for p in model.parameters() if id(p) not in lookups and p is not head)
    if head is not None:
        n += _numel(head)
    flops = 6.0 * n
    if width and layers and seq_len:
        flops += 12.0 * layers * width * seq_len
    return flops


def _reference_build(config, remote: bool = False):
    """The architecture with its parameters on the meta device and real buffers, built outside
    any zero.Init and without touching the global RNG. `remote`: the class is the directory's own
    (auto_map, model.trust_remote_code)."""
    from accelerate import init_empty_weights
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    with torch.random.fork_rng(devices=[]), init_empty_weights(include_buffers=False):
        if remote:
            from transformers.dynamic_module_utils import get_class_from_dynamic_module
            cls = get_class_from_dynamic_module(config.auto_map["AutoModelForCausalLM"], config.name_or_path,
                                                local_files_only=True)
            return cls(config)
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)


def _restore_buffers(model, config, d: Path, files: list[str], remote: bool = False):
    """Buffers as an ordinary construction (and the weight files) make them, not as zero.Init's
    bf16 tensor constructors did (transformers protects RoPE tables, not every buffer)."""
    in_files = _checkpoint_keys(d, files)
    restore_buffers(model, _reference_build(config, remote), keep=lambda name: name in in_files)


def _checkpoint_keys(d: Path, files: list[str]) -> set[str]:
    """Tensor names stored in the directory's safetensors weights (persistent buffers loaded from there)."""
    import json
    if "model.safetensors.index.json" in files:
        return set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])
    if "model.safetensors" in files:
        from safetensors import safe_open
        with safe_open(str(d / "model.safetensors"), framework="pt") as f:
            return set(f.keys())
    return set()


def meta_hf(spec: ModelSpec) -> tuple:
    """The causal LM build_hf would make, parameters on the meta device (for sizing)."""
    config = config_of(spec)
    try:
        model = _reference_build(config, spec.config.trust_remote_code)
    except (ValueError, ImportError) as e:  # an attention kernel that is not there: the build's one line
        if not _attention_fix(spec, e):
            raise
        raise ConfigError(f"model.name {spec.name}: {str(e).splitlines()[0][:300]}{_attention_fix(spec, e)}") from None
    return model, {"family": "hf", "model_type": config.model_type}


def save_hf_config(model_config: dict, out_dir: str | os.PathLike, dtype: Optional[str] = None) -> list[str]:
    """Write config.json (+ generation/tokenizer files of the source directory) into an export
    directory, so that transformers loads it. `dtype`: "bfloat16"/"float32" of the exported
    weights. Returns the files written."""
    from transformers import AutoConfig
    if model_config.get("family") != "hf":
        raise ValueError(f"save_hf_config needs an hf model_config, got family {model_config.get('family')!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    src = Path(model_config.get("source", ""))
    if model_config.get("trust_remote_code"):
        return _save_remote_config(model_config, src, out, dtype)
    d = dict(model_config["config"])
    model_type = d.pop("model_type")
    config = AutoConfig.for_model(model_type, **d)
    config.use_cache = True  # the exported model is for inference too
    if dtype is not None:
        config.dtype = dtype
    config.save_pretrained(str(out))
    if model_config.get("attn_implementation"):  # what the run used (transformers' to_dict() drops it)
        _record_attention(out / "config.json", model_config["attn_implementation"])
    return ["config.json"] + _copy_side_files(src, out)


def _record_attention(path: Path, impl: str) -> None:
    """config.json's attn_implementation (transformers reads it back: from_pretrained builds the
    export with the attention the run trained with)."""
    import json
    d = json.loads(path.read_text())
    d["attn_implementation"] = impl
    path.write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")


def _copy_side_files(src: Path, out: Path, names=SIDE_FILES) -> list[str]:
    written = []
    for name in names:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy2(src / name, out / name)
            written.append(name)
    return written


def _save_remote_config(model_config: dict, src: Path, out: Path, dtype: Optional[str]) -> list[str]:
    """A model with its own code: config.json as trained (its auto_map kept) plus the source
    directory's .py files, so the export loads with trust_remote_code=True like the source."""
    import json
    d = dict(model_config["config"])
    d["use_cache"] = True
    if model_config.get("attn_implementation"):
        d["attn_implementation"] = model_config["attn_implementation"]
    if dtype is not None:
        d["dtype"] = dtype
    (out / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    code = sorted(p.name for p in src.glob("*.py")) if src.is_dir() else []
    return ["config.json"] + _copy_side_files(src, out, tuple(SIDE_FILES) + tuple(code))
