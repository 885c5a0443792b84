"""Local Hugging Face causal LMs ("hf:<dir>"): loading without network, vocabulary checks,
and fine-tuning on 2 processes under ZeRO-2 and ZeRO-3 with an export that transformers
loads back and that reproduces the trained model's validation loss."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from helpers import SEQ, accelerate_yaml, fp32, hf_val_loss, lm_bundle, metrics, rank_infos, run_train, save_tiny
from zerotrain.models import build_workload, resolve
from zerotrain.train.config import ModelConfig
from zerotrain.train.data import DataBundle
from zerotrain.train.errors import ConfigError, DataError

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network


# ----------------------------------------------------------------------------- loading

def test_context_width_and_weights_load_exactly(tmp_path, corpus):
    from transformers import AutoModelForCausalLM
    d = save_tiny("gpt2", tmp_path / "gpt2", corpus["vocab"])
    spec = resolve(ModelConfig(name=f"hf:{d}"))  # context, vocabulary and width from config.json
    assert (spec.family, spec.context, spec.vocab_size, spec.hidden_size) == ("hf", 64, corpus["vocab"], 32)
    wl = build_workload(spec, lm_bundle(corpus["vocab"]))
    assert (wl.task, wl.family) == ("lm", "hf")
    assert wl.tied == [("lm_head.weight", "transformer.wte.weight")]
    assert next(wl.model.parameters()).dtype == torch.float32
    ref = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True).eval()
    x = torch.randint(0, corpus["vocab"], (2, SEQ))
    assert torch.equal(wl.logits(wl.model.eval(), {"input_ids": x}), ref(input_ids=x).logits)
    llama_dir = save_tiny("llama", tmp_path / "llama", corpus["vocab"])
    llama = build_workload(resolve(ModelConfig(name=f"hf:{llama_dir}")), lm_bundle(corpus["vocab"]))
    assert llama.tied == [] and llama.hidden_size == 32 and llama.flops_per_item > 0


def test_config_only_directory_trains_from_random_init(tmp_path, corpus, capsys):
    d = save_tiny("llama", tmp_path / "scratch", corpus["vocab"], weights=False)
    wl = build_workload(resolve(ModelConfig(name=f"hf:{d}")), lm_bundle(corpus["vocab"]))
    assert "random initialisation" in capsys.readouterr().out
    assert sum(p.numel() for p in wl.model.parameters()) > 0


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_flops_count_the_lm_head_matmul_tied_or_not(tmp_path, kind):
    """MFU's FLOPs: 6 * (non-embedding parameters + the V x D lm_head, counted once even when
    tied to the token embedding) + 12 * L * D * T, as models/gpt.py counts them. Tying shares
    storage, not compute: tied and untied models of the same shapes do the same FLOPs."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from zerotrain.models import gpt
    V, D, L, P, FFN, KV = 96, 32, 2, 64, 64, 16  # vocab, width, layers, positions, Llama MLP, Llama k/v width
    flops = {}
    for tied in (True, False):
        if kind == "gpt2":  # learned position embeddings (a lookup too), 4x GELU MLP, biases, LayerNorms
            cfg = GPT2Config(vocab_size=V, n_positions=P, n_embd=D, n_layer=L, n_head=2, tie_word_embeddings=tied)
            model = GPT2LMHeadModel(cfg)
            non_emb = L * (12 * D * D + 13 * D) + 2 * D
        else:  # GQA (4 heads, 2 k/v heads), SwiGLU, RMSNorm, no biases
            cfg = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=FFN, num_hidden_layers=L,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=P,
                              tie_word_embeddings=tied)
            model = LlamaForCausalLM(cfg)
            non_emb = L * (2 * D * D + 2 * D * KV + 3 * D * FFN + 2 * D) + D
        model.save_pretrained(str(tmp_path / f"{kind}-{tied}"))
        wl = build_workload(resolve(ModelConfig(name=f"hf:{tmp_path / f'{kind}-{tied}'}")), lm_bundle(V))
        assert bool(wl.tied) == tied
        emb_tables = V * D + (P * D if kind == "gpt2" else 0)
        assert wl.model_config["num_params"] == non_emb + emb_tables + (0 if tied else V * D)
        assert wl.flops_per_item == 6.0 * (non_emb + V * D) + 12.0 * L * D * SEQ
        flops[tied] = wl.flops_per_item
        if kind == "llama":  # the same architecture as zerotrain's own GPT: the same count
            g = gpt.GPTConfig(vocab_size=V, seq_len=P, n_layer=L, n_head=4, n_kv_head=2, d_model=D,
                              ffn_hidden=FFN, tie_embeddings=tied)
            assert wl.flops_per_item == g.flops_per_token(SEQ)
    assert flops[True] == flops[False]


def test_bad_directories_and_vocabularies_are_user_errors(tmp_path, corpus):
    with pytest.raises(ConfigError, match="is not a directory"):
        build_workload(resolve(ModelConfig(name=f"hf:{tmp_path / 'nope'}")), lm_bundle(10))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        build_workload(resolve(ModelConfig(name=f"hf:{tmp_path / 'empty'}")), lm_bundle(10))
    d = save_tiny("gpt2", tmp_path / "gpt2", corpus["vocab"])
    with pytest.raises(ConfigError, match="larger than .* vocab_size"):
        build_workload(resolve(ModelConfig(name=f"hf:{d}")), lm_bundle(corpus["vocab"] + 50))
    # Token ids the embedding cannot index are refused before training, naming the file.
    with pytest.raises(DataError, match="x.bin contains token id"):
        build_workload(resolve(ModelConfig(name=f"hf:{d}")), lm_bundle(10, max_token=corpus["vocab"]))
    images = DataBundle(train=None, val=None, task="classify", describe="", num_classes=3)
    with pytest.raises(ConfigError, match="causal language model"):
        build_workload(resolve(ModelConfig(name=f"hf:{d}")), images)


def test_save_hf_config_makes_a_loadable_directory(tmp_path, corpus):
    from zerotrain.models.hf import save_hf_config
    from transformers import AutoConfig, AutoTokenizer
    d = save_tiny("llama", tmp_path / "src", corpus["vocab"], tokenizer_dir=corpus["tok_dir"])
    wl = build_workload(resolve(ModelConfig(name=f"hf:{d}")), lm_bundle(corpus["vocab"]))
    written = save_hf_config(wl.model_config, tmp_path / "out", dtype="bfloat16")
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(written)
    cfg = AutoConfig.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    assert cfg.model_type == "llama" and cfg.num_key_value_heads == 2 and cfg.vocab_size == corpus["vocab"]
    assert cfg.dtype in ("bfloat16", torch.bfloat16) and cfg.use_cache
    assert len(AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)) == corpus["vocab"]
    with pytest.raises(ValueError, match="hf model_config"):
        save_hf_config({"family": "gpt"}, tmp_path / "x")


def with_attention(d, impl):
    """The model directory `d` with "attn_implementation": impl in its config.json."""
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "attn_implementation": impl}))
    return d


def test_attn_implementation_of_config_json_is_honoured_overridden_and_recorded(tmp_path, corpus):
    """config.json's attn_implementation is what transformers runs (its to_dict() drops it: the
    build must not); model.attn_implementation overrides it; the run records the one used and the
    export's config.json carries it, so from_pretrained(export) runs it too. A kernel that is not
    there, or a name transformers does not have, is a one-line error naming the key."""
    from transformers import AutoModelForCausalLM
    from zerotrain.models.hf import save_hf_config
    d = save_tiny("llama", tmp_path / "llama", corpus["vocab"])
    built = {}
    for impl in ("eager", "flex_attention"):
        with_attention(d, impl)
        for override in (None, "sdpa"):
            cfg = ModelConfig(name=f"hf:{d}", **({"attn_implementation": override} if override else {}))
            wl = build_workload(resolve(cfg), lm_bundle(corpus["vocab"]))
            built[impl, override] = (wl.model.config._attn_implementation, wl.model_config["attn_implementation"])
    assert built == {("eager", None): ("eager", "eager"), ("eager", "sdpa"): ("sdpa", "sdpa"),
                     ("flex_attention", None): ("flex_attention", "flex_attention"),
                     ("flex_attention", "sdpa"): ("sdpa", "sdpa")}, built
    wl = build_workload(resolve(ModelConfig(name=f"hf:{d}", attn_implementation="eager")), lm_bundle(corpus["vocab"]))
    save_hf_config(wl.model_config, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["attn_implementation"] == "eager"
    wl.model.save_pretrained(str(tmp_path / "weights"))  # the weights, as train/checkpoint/ exports them
    (tmp_path / "export" / "model.safetensors").write_bytes((tmp_path / "weights" / "model.safetensors").read_bytes())
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path / "export"), local_files_only=True)
    assert back.config._attn_implementation == "eager"
    with pytest.raises(ConfigError, match=r'^model.attn_implementation must be one of eager, sdpa, .*\(got "sdpa2"\) '
                                          r'\(did you mean "sdpa"\?\)'):
        ModelConfig(name=f"hf:{d}", attn_implementation="sdpa2")
    with pytest.raises(ConfigError, match=r"\(model.attn_implementation is flash_attention_2\); set "
                                          r"model.attn_implementation sdpa \(or eager\)$") as e:
        build_workload(resolve(ModelConfig(name=f"hf:{d}", attn_implementation="flash_attention_2")),
                       lm_bundle(corpus["vocab"]))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("where", ["flag", "config.json"])
def test_flex_attention_is_refused_on_the_cpu_in_one_line(tmp_path, capsys, where, fresh_accelerate):
    """torch's FlexAttention has no backward on the CPU: a run asking for it there (by flag or by
    the model's config.json) stopped at its first backward with torch's traceback. Now: one line
    naming model.attn_implementation and the fix, exit 2, before the data and the model."""
    from helpers import TINY, run_main
    d = save_tiny("llama", tmp_path / "llama", 256)
    if where == "config.json":
        with_attention(d, "flex_attention")
    flag = ["--model.attn_implementation", "flex_attention"] if where == "flag" else []
    capsys.readouterr()  # save_tiny's progress bar
    code, err = run_main(capsys, [*TINY, "--model.name", f"hf:{d}", *flag, "--train.max_steps", "1",
                                  "--logging.trackers", "jsonl", "--ds-config", fp32(tmp_path, "ddp"),
                                  "--train.run_dir", str(tmp_path / "run")])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "model.attn_implementation flex_attention" in lines[0] and "cannot train on the CPU" in lines[0], lines[0]
    assert "--model.attn_implementation sdpa" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# ----------------------------------------------------------------------------- fine-tuning on 2 processes

@pytest.mark.multiproc
@pytest.mark.parametrize("arch,stage,launcher", [("gpt2", "zero2", "torchrun"), ("llama", "zero3", "accelerate")])
def test_finetune_and_export_loads_back_with_identical_outputs(tmp_path, corpus, arch, stage, launcher):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    src = save_tiny(arch, tmp_path / arch, corpus["vocab"], tokenizer_dir=corpus["tok_dir"])
    ds = fp32(tmp_path, stage)
    run_dir = tmp_path / "run"
    args = ["--model.name", f"hf:{src}", "--data.kind", "tokens", "--data.path", str(corpus["tokens"]),
            "--data.seq_len", str(SEQ), "--train.micro_batch_size", "4", "--train.max_steps", "20",
            "--train.eval_every", "0", "--train.eval_batches", "null", "--optim.lr", "3e-3",
            "--optim.warmup_steps", "2", "--logging.progress", "false", "--logging.every_steps", "1",
            "--checkpoint.save_at_end", "false", "--checkpoint.export", "true", "--checkpoint.export_dtype", "fp32",
            "--train.run_dir", str(run_dir)]
    if stage == "zero3":  # transformers' own (non-reentrant) checkpointing, with partitioned layers
        args += ["--model.activation_checkpointing", "true"]
    if launcher == "accelerate":
        proc = run_train(launcher, 2, args, accelerate_config=accelerate_yaml(tmp_path, ds),
                         env={"HF_HUB_OFFLINE": "1"})
    else:
        proc = run_train(launcher, 2, ["--ds-config", ds, *args], env={"HF_HUB_OFFLINE": "1"})
    if stage == "zero3":
        # from_pretrained built the model inside deepspeed.zero.Init: every parameter a shard, and
        # every matrix stays one ("auto" persistence threshold: 10 x hidden size = 320 elements).
        assert "model built partitioned by deepspeed.zero.Init" in proc.stdout
        assert "built whole" not in proc.stdout
        for info in rank_infos(run_dir):
            z = info["zero3"]
            assert z["partitioned_tensors"] == 2 + 7 * 2, z  # embeddings, lm_head, 7 matrices a layer
            assert z["held_elements"] <= z["partitioned_elements"] / 2 + z["partitioned_tensors"]
    rows = metrics(run_dir)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    val = [r for r in rows if "val/loss" in r][-1]

    export = run_dir / "export"
    model, info = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32, local_files_only=True,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert AutoConfig.from_pretrained(str(export)).model_type == arch
    assert len(AutoTokenizer.from_pretrained(str(export), local_files_only=True)) == corpus["vocab"]
    model.eval()
    # The exported model reproduces the 2-rank validation loss of the trained one ...
    loss, n = hf_val_loss(model, corpus["tokens"])
    assert n == val["val/samples"]
    assert math.isclose(loss, val["val/loss"], rel_tol=1e-4), (loss, val["val/loss"])
    # ... it was really trained (not the initial weights) ...
    init = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, local_files_only=True).eval()
    assert hf_val_loss(init, corpus["tokens"])[0] > loss + 0.3
    # ... and from_pretrained reads exactly the exported tensors: identical logits to a manual load.
    manual = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(export)), dtype=torch.float32)
    state = load_file(str(export / "model.safetensors"))
    missing, unexpected = manual.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {a for a, _ in ([("lm_head.weight", None)] if arch == "gpt2" else [])}
    manual.tie_weights()
    x = torch.randint(0, corpus["vocab"], (2, SEQ))
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, manual.eval()(input_ids=x).logits)
    assert json.loads((export / "config.json").read_text())["vocab_size"] == corpus["vocab"]
