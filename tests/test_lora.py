"""LoRA (model.lora; models/lora.py, train/checkpoint/adapter.py): the config section, target
validation and refusals, adapters on hf: and GPT models, the planner's adapter-sized optimizer,
and the round trip on 2 processes under partitioned ZeRO-3: train, adapter-sized checkpoint,
exact resume (and on 1 process under DDP), PEFT adapter export that PeftModel loads, merged
export that transformers loads, logits compared; the GPT preset over model.init_from weights
(ZeRO-2, resumed on 2 processes under ZeRO-1, merged)."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from helpers import (SEQ, assert_zero3_planned_to_the_byte, fp32, hf_val_loss, lm_bundle, metrics, rank_infos,
                     run_train, save_tiny, train_losses)
from zerotrain.models import build_workload, resolve
from zerotrain.models.config import LoraConfig
from zerotrain.models.lora import adapter_key, is_adapter
from zerotrain.train.config import ModelConfig, load_config
from zerotrain.train.errors import ConfigError

os.environ["HF_HUB_OFFLINE"] = "1"


# ----------------------------------------------------------------------------- config

def test_lora_section_from_run_file_and_flags(tmp_path):
    from zerotrain.train.args import options_help
    assert load_config().model.lora is None  # off unless set
    cfg = load_config(overrides=[("model.lora.r", "4"), ("model.lora.target_modules", "q_proj,v_proj")])
    assert cfg.model.lora == LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  lora: {r: 16, alpha: 32, dropout: 0.05}\n")
    assert load_config(str(run)).model.lora == LoraConfig(r=16, alpha=32.0, dropout=0.05)
    assert load_config(str(run), [("model.lora.r", "2")]).model.lora.alpha == 32.0  # a flag edits the file's section
    assert load_config(str(run), [("model.lora", "null")]).model.lora is None       # ... or switches it off
    bad = [([("model.lora.rank", "4")], 'unknown option "--model.lora.rank"'),
           ([("model.lora.r", "0")], "model.lora.r must be a positive integer"),
           ([("model.lora.dropout", "1")], r"model.lora.dropout must be in \[0, 1\)"),
           ([("model.lora", "8")], '"--model.lora" is a section')]
    for overrides, message in bad:
        with pytest.raises(ConfigError, match=message):
            load_config(overrides=overrides)
    (tmp_path / "typo.yaml").write_text("model:\n  lora: {rank: 4}\n")
    with pytest.raises(ConfigError, match='unknown key "model.lora.rank"'):
        load_config(str(tmp_path / "typo.yaml"))
    assert "--model.lora.r (8)" in options_help() and "--model.lora.target_modules (None)" in options_help()


def test_unknown_targets_and_non_lms_are_refused_in_one_line(tmp_path):
    d = save_tiny("llama", tmp_path / "llama", 64)
    spec = resolve(ModelConfig(name=f"hf:{d}", lora=LoraConfig(target_modules=["q_proj", "qproj"])))
    with pytest.raises(ConfigError) as e:
        build_workload(spec, lm_bundle(64))
    assert "\n" not in str(e.value)
    assert str(e.value) == (f"model.lora.target_modules: qproj is not a Linear module of hf:{d}; its Linear modules "
                            f"are: down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj")
    for name in ("resnet18", "linear"):
        with pytest.raises(ConfigError, match=f"^model.lora is not a key of model family .* \\({name}\\); its keys: "):
            resolve(ModelConfig(name=name, lora=LoraConfig()))
    with pytest.raises(ConfigError, match="needs model.init_from"):  # a random GPT has nothing to adapt
        build_workload(resolve(ModelConfig(name="gpt-tiny", lora=LoraConfig())), lm_bundle(256))
    scratch = save_tiny("llama", tmp_path / "scratch", 64, weights=False)
    with pytest.raises(ConfigError, match="no safetensors weights to adapt"):
        build_workload(resolve(ModelConfig(name=f"hf:{scratch}", lora=LoraConfig())), lm_bundle(64))
    tied = ModelConfig(name="gpt-tiny", init_from=str(tmp_path), lora=LoraConfig(target_modules=["qkv", "lm_head"]))
    with pytest.raises(ConfigError, match="lm_head .* shares its weight with the input embedding"):
        build_workload(resolve(tied), lm_bundle(256))


# ----------------------------------------------------------------------------- adapters

def test_hf_adapters_are_the_only_trainable_tensors_and_start_as_the_base(tmp_path):
    from transformers import AutoModelForCausalLM
    d = save_tiny("llama", tmp_path / "llama", 64)
    wl = build_workload(resolve(ModelConfig(name=f"hf:{d}", lora=LoraConfig(r=4))), lm_bundle(64))
    assert wl.lora["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert wl.lora["base"] == str(d.resolve())
    trainable = [n for n, p in wl.model.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(n) for n in trainable)
    assert len(trainable) == 2 * 7 * 2  # A and B, 7 Linear layers a block, 2 blocks; lm_head left out
    assert adapter_key("model.layers.0.self_attn.q_proj.lora_A.default.weight") == \
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    base = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, local_files_only=True).eval()
    x = torch.randint(0, 64, (2, SEQ))
    with torch.no_grad():  # B = 0: the untrained adapter is the base model
        assert torch.equal(wl.logits(wl.model.eval(), {"input_ids": x}), base(input_ids=x).logits)


def test_gpt_projections_take_adapters_and_only_they_get_gradients(tmp_path):
    from zerotrain.models.config import ModelConfig as MC
    spec = resolve(MC(name="gpt-tiny", init_from=str(tmp_path), lora=LoraConfig(r=2)))
    from zerotrain.models import gpt as gpt_module
    from zerotrain.models import gpt_config, lora
    torch.manual_seed(0)
    model = gpt_module.GPT(gpt_config(spec.config, vocab_size=256))
    x = torch.randint(0, 256, (2, 16))
    before = model(x).detach()
    info = lora.apply(model, spec, [("lm_head.weight", "tok_emb.weight")])
    assert info["target_modules"] == ["down", "gate_up", "proj", "qkv"]  # every Linear but the tied head
    assert torch.equal(model(x), before)
    model(x).float().pow(2).mean().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(is_adapter(n) for n in grads)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {n for n, _ in model.named_parameters()
                                                                             if is_adapter(n)}


def test_plan_counts_optimizer_state_for_the_adapters_only(tmp_path, capsys):
    from zerotrain.train.commands.plan import main as plan
    full, lora = tmp_path / "full.yaml", tmp_path / "lora.yaml"
    full.write_text("model: {name: gpt-small-cpu}\n")
    lora.write_text("model: {name: gpt-small-cpu, lora: {r: 8, target_modules: [qkv, proj]}}\n")
    out = {}
    for f in (full, lora):
        assert plan([str(f), "--json", "--gpus-per-node", "2", "--device-mem", "80GB"]) == 0
        out[f.stem] = json.loads(capsys.readouterr().out)
    from zerotrain.models.gpt import PRESETS
    g = PRESETS["gpt-small-cpu"]
    kv = g.n_kv_head * g.head_dim
    adapter = g.n_layer * 8 * ((g.d_model + g.d_model + 2 * kv) + (g.d_model + g.d_model))  # r x (in + out)
    assert out["lora"]["trained_params"] == adapter
    assert out["lora"]["num_params"] == out["full"]["num_params"] + adapter
    ddp = {k: next(o for o in v["options"] if o["option"] == "DDP")["device_bytes"] for k, v in out.items()}
    assert ddp["lora"]["optimizer"] == 8 * adapter and ddp["lora"]["grads"] == 4 * adapter
    assert ddp["lora"]["optimizer"] < ddp["full"]["optimizer"] / 20


def test_resume_needs_the_same_adapter_on_the_same_base(tmp_path):
    from zerotrain.train.checkpoint.adapter import base_files, check_resume
    from zerotrain.train.errors import CheckpointError
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    lora = {"r": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["q_proj"], "base": str(tmp_path)}
    saved = {**lora, "base_files": base_files(str(tmp_path))}
    check_resume(tmp_path, saved, lora)
    with pytest.raises(CheckpointError, match="model.lora.r = 8, this run has 4"):
        check_resume(tmp_path, saved, {**lora, "r": 4})
    with pytest.raises(CheckpointError, match="holds a LoRA adapter .* without its base"):
        check_resume(tmp_path, saved, None)
    with pytest.raises(CheckpointError, match="holds a fully trained model"):
        check_resume(tmp_path, None, lora)
    (tmp_path / "model.safetensors").write_bytes(b"y" * 11)  # another base under the same name
    with pytest.raises(CheckpointError, match="only means something on its own base"):
        check_resume(tmp_path, saved, lora)


# ----------------------------------------------------------------------------- 2 processes, ZeRO-3

def _adapter_from_checkpoint(ckpt) -> dict:
    """The adapter assembled from every rank's pieces (what the ranks held, gathered offline)."""
    from zerotrain.train.checkpoint import files as io
    manifest, meta = io.read_manifest(ckpt), io.read_json(ckpt / io.META, "meta")
    reader = io.PieceReader([ckpt / f for f in manifest["files"] if f.endswith(".safetensors")])
    out = {n: reader.read("param", n, 0, math.prod(p["shape"])).view(p["shape"]) for n, p in meta["params"].items()}
    reader.close()
    return out


@pytest.mark.multiproc
def test_lora_round_trip_under_partitioned_zero3(tmp_path, corpus):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from zerotrain.train.commands.export import main as export
    src = save_tiny("llama", tmp_path / "llama", corpus["vocab"], tokenizer_dir=corpus["tok_dir"])
    ds = fp32(tmp_path, "zero3")
    args = ["--model.name", f"hf:{src}", "--model.lora.r", "16", "--model.lora.alpha", "32",
            "--model.lora.target_modules", "q_proj,v_proj", "--data.kind", "tokens", "--data.path",
            str(corpus["tokens"]), "--data.seq_len", str(SEQ), "--train.micro_batch_size", "4",
            "--train.grad_accum_steps", "2", "--train.max_steps", "6", "--train.eval_every", "0",
            "--train.eval_batches", "null", "--optim.lr", "1e-2", "--optim.warmup_steps", "1",
            "--logging.progress", "false", "--logging.every_steps", "1", "--checkpoint.every_steps", "3",
            "--checkpoint.keep_last", "3", "--checkpoint.export_dtype", "fp32"]
    env = {"HF_HUB_OFFLINE": "1"}
    a = tmp_path / "a"
    proc = run_train("torchrun", 2, ["--ds-config", ds, *args, "--train.run_dir", str(a)], env=env)
    # The base built partitioned by zero.Init, the adapters whole and then partitioned by the engine:
    # r=16 adapters of q_proj (A, B: 512 elements) and v_proj's A exceed the persistence threshold
    # (10 x hidden = 320), v_proj's B (16 x 16) stays whole.
    summary = next(line for line in proc.stdout.splitlines() if "deepspeed.zero.Init" in line)
    assert summary.startswith("zerotrain: model built partitioned") and "8 LoRA adapter tensors" in summary, summary
    assert "LoRA r=16 alpha=32 on q_proj,v_proj, base frozen" in proc.stdout
    for info in rank_infos(a):
        z = info["zero3"]
        assert z["built_outside_zero_init"] == 0 and z["partitioned_tensors"] == 2 + 7 * 2 + 3 * 2, z
    losses = train_losses(a)
    assert len(losses) == 6 and losses[6] < losses[1], losses
    # The planner against the measurement, frozen base with an untied head (embed_tokens, lm_head):
    # parameters and gradients to the byte (DeepSpeed's prefetched embedding is "gathered", no model state).
    assert_zero3_planned_to_the_byte(next(r for r in metrics(a) if "mem/model_states_bytes_per_rank" in r))

    # Checkpoints hold the adapter and its moments, not the frozen base.
    ckpt3, ckpt6 = a / "checkpoints" / "step_00000003", a / "checkpoints" / "step_00000006"
    meta = json.loads((ckpt6 / "meta.json").read_text())
    assert meta["params"] and all(is_adapter(n) and p["trainable"] for n, p in meta["params"].items())
    assert len(meta["lora"]["frozen"]) == 2 * (7 + 2) + 3  # matrices and norms, embeddings, final norm, head
    adapter_numel = sum(math.prod(p["shape"]) for p in meta["params"].values())
    full_numel = adapter_numel + sum(math.prod(s) for s in meta["lora"]["frozen"].values())
    ckpt_bytes = sum(f.stat().st_size for f in ckpt6.glob("*.safetensors"))
    print(f"LoRA checkpoint {ckpt_bytes} B for {adapter_numel} adapter parameters; the full model's state would be "
          f"{12 * full_numel} B")
    assert 12 * adapter_numel <= ckpt_bytes < 12 * adapter_numel + 16 * 1024 < 12 * full_numel / 5

    # Exact resume on the same 2 ranks; on 1 process under DDP the same losses up to summation order.
    b, c = tmp_path / "b", tmp_path / "c"
    run_train("torchrun", 2, ["--ds-config", ds, *args, "--resume", str(ckpt3), "--train.run_dir", str(b),
                              "--checkpoint.save_at_end", "false", "--checkpoint.export", "false"], env=env)
    assert {s: v for s, v in train_losses(b).items() if s > 3} == {s: v for s, v in losses.items() if s > 3}
    one = list(args)  # 1 process: accumulation 4 keeps the global batch of 16 (data order and LR unchanged)
    one[one.index("--train.grad_accum_steps") + 1] = "4"
    run_train("python", 1, ["--ds-config", fp32(tmp_path, "ddp"), *one, "--resume", str(ckpt3), "--train.run_dir",
                            str(c), "--checkpoint.save_at_end", "false", "--checkpoint.export", "false"], env=env)
    resumed = train_losses(c)
    assert sorted(resumed) == [4, 5, 6] and all(abs(resumed[s] - losses[s]) < 1e-4 for s in resumed), (resumed, losses)

    # The end-of-run export under ZeRO-3 is PEFT's adapter directory with the gathered adapter (not a
    # rank's shard): equal to the adapter assembled offline from every rank's checkpoint pieces.
    live = a / "export"
    assert sorted(p.name for p in live.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = load_file(str(live / "adapter_model.safetensors"))
    gathered = _adapter_from_checkpoint(ckpt6)
    assert set(saved) == {adapter_key(n) for n in gathered}
    for n, t in gathered.items():
        assert t.dim() == 2 and t.numel() > 0 and torch.equal(saved[adapter_key(n)], t), n
    assert any(t.abs().sum() > 0 for n, t in gathered.items() if ".lora_B." in n)  # B moved off zero: trained
    assert export([str(ckpt6), str(tmp_path / "offline"), "--dtype", "fp32"]) == 0  # the same from the checkpoint
    assert load_file(str(tmp_path / "offline" / "adapter_model.safetensors")).keys() == saved.keys()

    # PeftModel loads it; its logits are those of the trained model (base + the checkpoint's adapter).
    x = torch.randint(0, corpus["vocab"], (2, SEQ))
    base = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, str(live)).eval()
    trained = build_workload(resolve(ModelConfig(name=f"hf:{src}", lora=LoraConfig(
        r=16, alpha=32, target_modules=["q_proj", "v_proj"]))), lm_bundle(corpus["vocab"])).model.eval()
    params = dict(trained.named_parameters())
    with torch.no_grad():
        for n, t in gathered.items():
            params[n].copy_(t)
        logits = peft_model(input_ids=x).logits
        diff_adapter = (logits - trained(input_ids=x).logits).abs().max().item()
    val = [r for r in metrics(a) if "val/loss" in r][-1]
    assert math.isclose(hf_val_loss(peft_model, corpus["tokens"])[0], val["val/loss"], rel_tol=1e-4)

    # Merged: plain transformers weights, the base names, the same logits within 1e-5 (fp32).
    assert export([str(ckpt6), str(tmp_path / "merged"), "--merge", "--dtype", "fp32"]) == 0
    merged, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32,
                                                        local_files_only=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        diff_merged = (merged.eval()(input_ids=x).logits - logits).abs().max().item()
    print(f"logits max |diff|: PEFT adapter vs trained {diff_adapter:.3g}, merged vs PEFT {diff_merged:.3g}")
    assert diff_adapter < 1e-5 and diff_merged < 1e-5


@pytest.mark.multiproc
def test_gpt_lora_on_init_from_weights_merges_back(tmp_path):
    """The built-in GPT: LoRA on its projections over model.init_from weights (1 process, ZeRO-2
    fp32), the frozen base re-read on a resume on 2 processes under ZeRO-1, and the merged export
    equal to base + adapter."""
    from helpers import TINY
    from zerotrain.models import gpt, gpt_config
    from zerotrain.models import lora as lora_mod
    from zerotrain.train.checkpoint.weights import load_weights, write_weights
    from zerotrain.train.commands.export import main as export
    gcfg = gpt_config(ModelConfig(name="gpt-tiny"), vocab_size=256)
    torch.manual_seed(0)
    base = gpt.GPT(gcfg)
    params = dict(base.named_parameters())
    write_weights(tmp_path / "base", [(n, tuple(p.shape), torch.float32) for n, p in params.items()],
                  lambda n: params[n].detach(), dtype=torch.float32, max_shard_size="2GB",
                  tied=[("lm_head.weight", "tok_emb.weight")], family="gpt", model_config={"family": "gpt",
                                                                                        **gcfg.to_dict()})
    run = tmp_path / "run"
    args = [*TINY, "--model.init_from", str(tmp_path / "base"), "--train.global_batch_size", "8",
            "--model.lora.r", "4", "--model.lora.target_modules", "qkv,down", "--train.max_steps", "4",
            "--train.eval_every", "0", "--checkpoint.every_steps", "2", "--checkpoint.save_at_end", "true",
            "--train.run_dir", str(run)]
    proc = run_train("python", 1, ["--ds-config", fp32(tmp_path, "zero2"), *args])
    assert "initialised the frozen base weights from" in proc.stdout
    # Resumed on 2 processes under ZeRO-1: the base re-read from init_from, the adapter's fragments loaded.
    resumed = tmp_path / "resumed"
    run_train("torchrun", 2, ["--ds-config", fp32(tmp_path, "zero1"), *args, "--resume",
                              str(run / "checkpoints" / "step_00000002"), "--train.run_dir", str(resumed)])
    want, got = train_losses(run), train_losses(resumed)
    assert sorted(got) == [3, 4] and all(abs(got[s] - want[s]) < 1e-4 for s in got), (got, want)
    ckpt = run / "checkpoints" / "step_00000004"
    assert export([str(ckpt), str(tmp_path / "merged"), "--merge", "--dtype", "fp32"]) == 0
    merged = load_weights(gpt.GPT(gcfg), tmp_path / "merged").eval()
    spec = resolve(ModelConfig(name="gpt-tiny", init_from=str(tmp_path / "base"),
                               lora=LoraConfig(r=4, target_modules=["qkv", "down"])))
    lora_mod.apply(base, spec, [("lm_head.weight", "tok_emb.weight")])
    live = dict(base.named_parameters())
    with torch.no_grad():
        for n, t in _adapter_from_checkpoint(ckpt).items():
            live[n].copy_(t)
        x = torch.randint(0, 256, (2, 64))
        assert (merged(x) - base.eval()(x)).abs().max().item() < 1e-5
