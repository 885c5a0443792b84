"""Run-config loading, overrides, validation, and DeepSpeed-JSON resolution (no processes)."""

from __future__ import annotations

import json

import pytest

from helpers import REPO
from zerotrain.train.args import parse_train_args
from zerotrain.train.config import RunConfig, load_config
from zerotrain.train.strategy.ds_config import load_ds_setup
from zerotrain.train.errors import ConfigError
from zerotrain.train.optim.schedule import lr_at


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_defaults_and_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "run.yaml", "optim:\n  lr: 1.0e-3\n  betas: [0.8, 0.9]\ntrain:\n  micro_batch_size: 4\n")
    cfg = load_config(path, [("optim.lr", "3e-4"), ("train.max_steps", "7"), ("model.tie_embeddings", "false"),
                             ("logging.wandb.tags", "a,b"), ("model.n_layer", "null")])
    assert cfg.optim.lr == 3e-4                     # CLI beats the file
    assert cfg.optim.betas == (0.8, 0.9)            # file beats the default, list -> tuple
    assert cfg.train.micro_batch_size == 4 and cfg.train.max_steps == 7
    assert cfg.model.tie_embeddings is False and cfg.model.n_layer is None
    assert cfg.logging.wandb.tags == ["a", "b"]
    assert cfg.data.kind == "text"                  # untouched default
    # YAML 1.1 reads 3e-4 (no dot) as a string: still accepted for a float field.
    assert load_config(write(tmp_path, "r2.yaml", "optim:\n  lr: 3e-4\n")).optim.lr == 3e-4


def test_json_run_file_round_trip(tmp_path):
    d = RunConfig().to_dict()
    d["optim"]["lr"] = 0.01
    cfg = load_config(write(tmp_path, "run.json", json.dumps(d)))
    assert cfg.to_dict() == d


@pytest.mark.parametrize("text,needle", [
    ("optim:\n  lrr: 1\n", 'unknown key "optim.lrr" (did you mean "lr"?)'),
    ("optimizer:\n  lr: 1\n", 'unknown key "optimizer" (did you mean "optim"?)'),
    ("train:\n  micro_batch_size: four\n", "train.micro_batch_size must be an integer"),
    ("train:\n  micro_batch_size: 2.5\n", "train.micro_batch_size must be an integer"),
    ("logging:\n  progress: 1\n", "logging.progress must be a boolean"),
    ("train:\n  micro_batch_size: 0\n", "train.micro_batch_size must be a positive integer"),
    ("optim:\n  lr: -1\n", "optim.lr must be > 0"),
    ("optim:\n  betas: [0.9]\n", "optim.betas must be a list of 2 numbers"),
    ("model:\n  dropout: 1.5\n", "model.dropout must be in [0, 1)"),
    ("data:\n  kind: txt\n", 'data.kind "txt" is not one of'),
    ("checkpoint:\n  keep_last: 0\n", "checkpoint.keep_last must be >= 1"),
    ("optim: 3\n", "optim must be a mapping"),
    ("train:\n  max_steps: 10\n    eval: 3\n", ":3:"),               # YAML syntax error: line number
    # A key only another data kind reads is not a key of this kind's section: refused, naming both.
    ("data:\n  kind: tokens\n  path: t.bin\n  max_bytes: 1000\n",
     "data.max_bytes is not a key of data.kind tokens (its keys: kind, path, sources,"),
    ("data:\n  kind: sft\n  path: d.jsonl\n  image_size: 64\n", "; data.kind imagefolder has it"),
    ("data:\n  tokenizer: tok\n", "data.tokenizer is not a key of data.kind text (its keys: kind, path, seq_len,"),
    ("data:\n  kind: tokens\n  packing: true\n", "data.packing is not a key of data.kind tokens"),
    ("model:\n  name: resnet18\n  n_layer: 2\n", "model.n_layer is not a key of model family vision"),
    ("model:\n  name: gpt-tiny\n  router_aux_loss_coef: 0.1\n", "; model family hf has it"),
    ("model:\n  name: linear\n  lora:\n    r: 4\n", "model.lora is not a key of model family linear"),
    ("model:\n  name: py:mod\n", 'model.name "py:mod" must be "py:<module>:<function>"'),
    ("model:\n  name: py:m:f\n  loss: mse\n", "model.loss must be one of lm, classification, model"),
    ("model:\n  name: py:m:f\n  kwargs: [1]\n", "model.kwargs must be a mapping"),
])
def test_bad_run_file_names_the_key(tmp_path, text, needle):
    path = write(tmp_path, "run.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value) and "run.yaml" in str(e.value)


def test_bad_json_reports_line_and_column(tmp_path):
    with pytest.raises(ConfigError, match=r"run\.json:2:\d+: invalid JSON"):
        load_config(write(tmp_path, "run.json", '{"optim":\n {"lr": 1,}}'))


@pytest.mark.parametrize("override,needle", [
    (("optim.lrr", "1"), 'unknown option "--optim.lrr" (did you mean "lr"?)'),
    (("optim", "1"), "is a section"),
    (("optim.lr.x", "1"), "is not a section"),
    (("train.max_steps", "ten"), "train.max_steps must be an integer"),
])
def test_bad_override(override, needle):
    with pytest.raises(ConfigError, match=None) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_cli_parsing_accepts_local_rank_and_dotted_forms():
    a = parse_train_args(["--config", "x.yaml", "--local_rank=1", "--optim.lr=1e-3", "--train.max_steps", "5",
                          "--resume", "auto", "--ds-config", "d.json", "--local_rank", "0", "--optim.min_lr", "-0"])
    assert a.config == "x.yaml" and a.ds_config == "d.json"
    assert ("optim.lr", "1e-3") in a.overrides and ("train.max_steps", "5") in a.overrides
    assert ("checkpoint.resume", "auto") in a.overrides and ("optim.min_lr", "-0") in a.overrides
    with pytest.raises(ConfigError, match="unknown argument"):
        parse_train_args(["--bogus"])
    with pytest.raises(ConfigError, match="needs a value"):
        parse_train_args(["--optim.lr"])


@pytest.mark.parametrize("argv, message", [
    (["--conf", "x.yaml"], "unknown argument '--conf'"),  # no abbreviations
    (["-c"], "-c needs a value"),  # the flag as typed
    (["--config", "--debug"], "--config needs a value"),
    (["--resume"], "--resume needs a value"),
])
def test_cli_parsing_errors_name_the_flag(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_train_args(argv)
    assert str(e.value).startswith(message)


def test_cli_shorthands_keep_their_place_among_dotted_overrides():
    a = parse_train_args(["--checkpoint.resume", "none", "--debug", "--resume=auto", "--peak-flops", "1e12"])
    assert a.overrides == [("checkpoint.resume", "none"), ("checkpoint.resume", "auto"), ("logging.peak_flops", "1e12")]
    assert a.debug


def test_cli_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as e:
        parse_train_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: train/main.py") and "  --optim.lr (" in out and "  --train.max_steps (" in out
    # A GPT preset's vocabulary comes from the data when unset, not from the preset: the help says so.
    vocab = out.split("  --model.vocab_size (None)\n", 1)[1].split("\n  --", 1)[0]
    assert "None = the data's" in vocab and "largest token id + 1" in vocab and "256 for text" in vocab, vocab


def test_batch_arithmetic():
    t = RunConfig().train
    t.micro_batch_size, t.global_batch_size = 4, 32
    b = t.batch(world_size=2)
    assert (b.micro, b.accum, b.world, b.global_size) == (4, 4, 2, 32)
    t.global_batch_size = 36
    with pytest.raises(ConfigError, match="not divisible by train.micro_batch_size x world size = 4 x 2 = 8"):
        t.batch(2)
    t.global_batch_size, t.grad_accum_steps = 32, 2
    with pytest.raises(ConfigError, match="contradicts"):
        t.batch(2)


def test_lr_schedule_is_a_function_of_the_global_step():
    o = RunConfig().optim
    o.lr, o.min_lr, o.warmup_steps = 1.0, 0.1, 4
    lrs = [lr_at(o, s, 20) for s in range(20)]
    assert lrs[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])       # linear warmup
    assert lrs[4] == pytest.approx(1.0)                          # peak
    assert lrs[12] == pytest.approx(0.1 + 0.45 * (1 + __import__("math").cos(__import__("math").pi * 0.5)))
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))         # monotone decay
    assert lr_at(o, 100, 20) == pytest.approx(0.1)                 # floor after the end


# ------------------------------------------------------------------ DeepSpeed JSON

def _resolve(tmp_path, ds: dict, cuda=False, **run):
    cfg = load_config(None, list(run.items()))
    path = write(tmp_path, "ds.json", json.dumps(ds))
    return load_ds_setup(path, cfg, cfg.train.batch(2), 100, cuda=cuda)


def test_shipped_configs_resolve(tmp_path):
    cfg = load_config(None)
    stages = {}
    for name in ("ddp", "ddp_fp32", "zero0", "zero1", "zero2", "zero3", "zero2_offload", "zero3_offload",
                 "zero2_fp32", "zero2_fp16"):
        ds = load_ds_setup(str(REPO / "ds_configs" / f"{name}.json"), cfg, cfg.train.batch(2), 100,
                             cuda=name.endswith("fp16"), hidden_size=128)
        z = ds.settings  # the backend's own record: ZeroSettings, DDPSettings
        stages[name] = (ds.backend, ds.precision) + ((z.stage, z.offload_optimizer, z.offload_param)
                                                     if ds.backend == "deepspeed" else ())
        if ds.backend == "deepspeed":
            r = ds.resolved
            assert r["train_micro_batch_size_per_gpu"] == 8 and r["gradient_accumulation_steps"] == 1
            assert r["train_batch_size"] == 16 and r["gradient_clipping"] == 1.0
            assert "optimizer" not in r and "scheduler" not in r   # zerotrain builds both
            assert "auto" not in json.dumps(r)
            # bf16 accumulates gradients in fp32 from stage 1 on (DeepSpeed has no fp32 accumulation at stage 0)
            want = {"grad_accum_dtype": "fp32"} if ds.precision == "bf16" and ds.settings.stage >= 1 else None
            assert r.get("data_types") == want, name
            z = r["zero_optimization"]
            if ds.settings.stage >= 1:  # buckets sized from the width (128), not DeepSpeed's 5e8 elements
                assert z["reduce_bucket_size"] == 128 * 128, name
            if ds.settings.stage == 3:
                assert z["stage3_param_persistence_threshold"] == 1280 and z["sub_group_size"] == 24 * 128 * 128
    assert stages == {
        "ddp": ("ddp", "bf16"), "ddp_fp32": ("ddp", "fp32"), "zero0": ("deepspeed", "bf16", 0, None, None),
        "zero1": ("deepspeed", "bf16", 1, None, None), "zero2": ("deepspeed", "bf16", 2, None, None),
        "zero3": ("deepspeed", "bf16", 3, None, None), "zero2_offload": ("deepspeed", "bf16", 2, "cpu", None),
        "zero3_offload": ("deepspeed", "bf16", 3, "cpu", "cpu"), "zero2_fp32": ("deepspeed", "fp32", 2, None, None),
        "zero2_fp16": ("deepspeed", "fp16", 2, None, None)}


@pytest.mark.parametrize("ds,needle", [
    ({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}},
     '"train_micro_batch_size_per_gpu": 4 contradicts the run config train.micro_batch_size = 8'),
    ({"gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2}}, "train.grad_accum_steps = 1"),
    ({"gradient_clipping": 0.5, "zero_optimization": {"stage": 2}}, "train.grad_clip = 1.0"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both"),
    ({"bf16": {"enabled": "yes"}}, '"bf16.enabled" must be true, false or "auto"'),
    ({"zero_optimization": {"stage": 4}}, "must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2, "stage3_prefetch_bucket_size": 1}}, "only apply to ZeRO-3"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "only apply to ZeRO-3"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "needs ZeRO stage 1, 2 or 3"),
    ({"ddp": {"bucket_cap": 25}}, '"ddp.bucket_cap" is not a DDP option (did you mean "bucket_cap_mb"?)'),
    ({"ddp": {}, "zero_optimization": {"stage": 2}}, "cannot also set zero_optimization"),
    ({"optimizer": {"type": "Lamb"}}, "not supported"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}, '"optimizer.params.lr": 0.1 contradicts'),
    ({"scheduler": {"type": "WarmupLR"}}, 'means schedule "constant"'),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}}, "no hidden size"),
    ({"zero_optimization": {"stage": 2, "foo": "auto"}}, 'cannot fill "auto" for zero_optimization.foo'),
    ({"zero_optimization": {"stage": 2, "sub_group_size": 1000}}, "only apply to ZeRO-3"),
    ({"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}, "data_types": {"grad_accum_dtype": "fp32"}},
     "needs ZeRO stage 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2}, "data_types": {"grad_accum_dtype": "fp64"}}, "is not a dtype"),
])
def test_ds_json_contradictions_are_errors(tmp_path, ds, needle):
    with pytest.raises(ConfigError) as e:
        _resolve(tmp_path, ds)
    assert needle in str(e.value) and "ds.json" in str(e.value)


def test_fp16_on_cpu_is_refused_with_advice(tmp_path):
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU.*use bf16"):
        _resolve(tmp_path, {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}})
    # The same file is fine where CUDA exists (the check is about the device, not the file).
    ds = _resolve(tmp_path, {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, cuda=True)
    assert ds.precision == "fp16"


def test_fp32_accumulation_is_for_bf16(tmp_path):
    # Filled for bf16 from stage 1 when the JSON is silent, kept when it says otherwise.
    ds = _resolve(tmp_path, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    assert ds.resolved["data_types"] == {"grad_accum_dtype": "fp32"}
    ds = _resolve(tmp_path, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
                             "data_types": {"grad_accum_dtype": "bf16"}})
    assert ds.resolved["data_types"] == {"grad_accum_dtype": "bf16"}
    assert "data_types" not in _resolve(tmp_path, {"bf16": {"enabled": True}, "zero_optimization": {"stage": 0}}).resolved
    with pytest.raises(ConfigError, match='is for bf16.*remove "data_types"'):
        _resolve(tmp_path, {"fp16": {"enabled": True}, "zero_optimization": {"stage": 2},
                            "data_types": {"grad_accum_dtype": "fp32"}}, cuda=True)


def test_auto_zero_sizes_scale_with_the_model_width(tmp_path):
    cfg = load_config(None)
    path = write(tmp_path, "z3.json", json.dumps({"zero_optimization": {"stage": 3, **{k: "auto" for k in (
        "reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
        "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size")}}}))
    for h in (64, 4096):
        z = load_ds_setup(path, cfg, cfg.train.batch(2), 10, cuda=False, hidden_size=h).resolved["zero_optimization"]
        assert z["reduce_bucket_size"] == h * h and z["stage3_param_persistence_threshold"] == 10 * h
        assert z["stage3_max_live_parameters"] == z["stage3_max_reuse_distance"] == z["sub_group_size"] == 24 * h * h
    # `zerotrain check` validates before any data exists: the sizes are left for the run.
    z = load_ds_setup(path, cfg, cfg.train.batch(2), 10, cuda=False, sizes_later=True).resolved["zero_optimization"]
    assert z["reduce_bucket_size"] == "auto"


def test_matching_concrete_values_are_accepted(tmp_path):
    ds = _resolve(tmp_path, {"train_micro_batch_size_per_gpu": 8, "train_batch_size": 16, "gradient_clipping": 1,
                             "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}},
                             "zero_optimization": {"stage": 1}})
    assert ds.settings.stage == 1 and ds.resolved["gradient_clipping"] == 1


def test_missing_ds_config_lists_shipped_files(tmp_path):
    cfg = load_config(None)
    with pytest.raises(ConfigError, match="not found.*ds_configs/zero2.json"):
        load_ds_setup(str(tmp_path / "nope.json"), cfg, cfg.train.batch(1), 10, cuda=False)


def test_none_on_the_command_line_is_a_word_for_a_string_key_and_null_for_an_optional_one():
    """--checkpoint.resume none was refused as "must be a string, not null" (it is the documented
    value); an Optional key still reads none/null as null."""
    cfg = load_config(None, [("checkpoint.resume", "none"), ("train.epochs", "none"), ("logging.wandb.entity", "null")])
    assert cfg.checkpoint.resume == "none" and cfg.train.epochs is None and cfg.logging.wandb.entity is None
    with pytest.raises(ConfigError, match="train.max_steps must be an integer, not null"):
        load_config(None, [("train.max_steps", "none")])


def test_help_shows_required_keys_as_required_not_a_dataclasses_sentinel(capsys):
    """data.sources entries need path and weight: --help said `(<dataclasses._MISSING_TYPE object at 0x...>)`."""
    from zerotrain.train.args import options_help
    text = options_help()
    assert "_MISSING_TYPE" not in text
    assert "--data.sources.path (required)" in text and "--data.sources.weight (required)" in text
