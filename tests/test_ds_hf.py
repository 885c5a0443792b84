"""DeepSpeed JSONs shared with Hugging Face's Trainer (docs/strategies.md, "Using the same JSON in
HF Trainer"): the shipped ds_configs/*.json say "auto" only where the Trainer fills it, and the
Trainer's documented JSONs load in zerotrain unchanged.

tests/data/hf_deepspeed/ds_config_zero{2,3}.json are the "ZeRO-2 Example" and "ZeRO-3 Example"
auto-configuration files of transformers' DeepSpeed guide
(https://huggingface.co/docs/transformers/deepspeed; docs/source/en/main_classes/deepspeed.md),
written out key by key, with "bf16": {"enabled": "auto"} (as transformers'
tests/deepspeed/ds_config_zero2.json has) and the ZeRO-2 "reduce_bucket_size": "auto" as issue 37
quotes them. The guide's own ZeRO-2 text has no bf16 block and 2e8 there:
test_hf_docs_older_variants loads that form too.
"""

from __future__ import annotations

import copy
import json
import math
import re

import pytest

from helpers import REPO, TINY, run_train, train_losses
from zerotrain.train.config import load_config
from zerotrain.train.errors import ConfigError
from zerotrain.train.strategy.ds_config import COMPANION_SIZES, load_ds_setup
from zerotrain.train.strategy.precision import resolve_precision

HF_DIR = REPO / "tests" / "data" / "hf_deepspeed"
SHIPPED = sorted((REPO / "ds_configs").glob("*.json"))

# Every key Hugging Face's Trainer replaces when it is "auto": transformers
# src/transformers/integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process
# (batch, clipping, optimizer, scheduler, precision) and trainer_config_finalize (the three ZeRO
# sizes from the model's hidden_size, and the scheduler's step counts). Any other "auto" reaches
# DeepSpeed as the string "auto", which DeepSpeed refuses.
HF_FILLS = {
    "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size", "gradient_clipping",
    "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr", "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
    "scheduler.params.total_num_steps",
    "fp16.enabled", "bf16.enabled", "amp.enabled", "amp.opt_level",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
}


def _autos(d: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _autos(v, f"{prefix}{k}.")
        elif isinstance(v, str) and v.lower() == "auto":
            out.add(prefix + k)
    return out


def _cfg(*over):
    return load_config(None, [("optim.schedule", "constant"), *over])


def _setup(path, cfg=None, cuda=False, hidden_size=64, **kw):
    cfg = cfg or _cfg()
    return load_ds_setup(str(path), cfg, cfg.train.batch(2), 10, cuda=cuda, hidden_size=hidden_size, **kw)


# ------------------------------------------------------------------ the shipped JSONs in HF Trainer

@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_jsons_use_auto_only_where_hf_trainer_fills_it(path):
    extra = _autos(json.loads(path.read_text())) - HF_FILLS
    assert not extra, f"{path.name}: HF Trainer leaves {sorted(extra)} as \"auto\" (DeepSpeed refuses it)"


def test_hf_fills_matches_the_installed_transformers():
    """HF_FILLS is what the installed transformers really fills (its source, read here)."""
    pytest.importorskip("deepspeed")
    import inspect
    deepspeed_integration = pytest.importorskip("transformers.integrations.deepspeed")
    src = inspect.getsource(deepspeed_integration.HfTrainerDeepSpeedConfig)
    found = set(re.findall(r'fill_(?:match|only)\(\s*"([^"]+)"', src))
    assert found and found <= HF_FILLS, found - HF_FILLS
    assert HF_FILLS - found <= {"amp.enabled", "amp.opt_level"}, HF_FILLS - found  # apex: gone in transformers 5


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.name != "ddp.json"], ids=lambda p: p.name)
def test_shipped_jsons_resolve_in_hf_trainer(path):
    """The Trainer's own "auto" filling leaves nothing unfilled, and DeepSpeed accepts the ZeRO block."""
    pytest.importorskip("deepspeed")
    deepspeed_integration = pytest.importorskip("transformers.integrations.deepspeed")
    from types import SimpleNamespace

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    hf = deepspeed_integration.HfTrainerDeepSpeedConfig(str(path))
    precision = _setup(path, cuda=True).precision  # the Trainer's --bf16 / --fp16 must agree with the file
    args = SimpleNamespace(world_size=2, per_device_train_batch_size=8, gradient_accumulation_steps=1,
                           max_grad_norm=1.0, learning_rate=3e-4, adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8,
                           weight_decay=0.1, fp16=precision == "fp16", fp16_full_eval=False, fp16_backend="auto",
                           fp16_opt_level="O1", bf16=precision == "bf16", bf16_full_eval=False, save_on_each_node=False,
                           get_warmup_steps=lambda n: 2)
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=64)), 10)
    assert not _autos(hf.config), (path.name, _autos(hf.config))
    DeepSpeedZeroConfig(**hf.config.get("zero_optimization", {}))


@pytest.mark.parametrize("path", [p for p in SHIPPED if p.name != "ddp.json"], ids=lambda p: p.name)
def test_shipped_resolution_is_unchanged(tmp_path, path):
    """The shipped JSONs no longer spell zerotrain's other sizes "auto" (allgather_bucket_size;
    ZeRO-3's live parameters, reuse distance, sub-groups): the file as it was, with them, resolves
    to the same DeepSpeed dict as the file now, for any model width."""
    data = json.loads(path.read_text())
    zero = data.get("zero_optimization", {})
    before = copy.deepcopy(data)
    if any(zero.get(k) == "auto" for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size")):
        for k in COMPANION_SIZES.get(zero["stage"], ()):
            before["zero_optimization"][k] = "auto"
    old = tmp_path / path.name
    old.write_text(json.dumps(before))
    cuda = "fp16" in path.name
    for h in (64, 1000, 4096):
        now, then = _setup(path, cuda=cuda, hidden_size=h), _setup(old, cuda=cuda, hidden_size=h)
        assert now.resolved == then.resolved and now.precision == then.precision, (path.name, h)
    if zero.get("stage", 0) >= 1:
        z = _setup(path, cuda=cuda, hidden_size=128).resolved["zero_optimization"]
        sized = {"allgather_bucket_size"} if zero["stage"] < 3 else {
            "stage3_max_live_parameters", "stage3_max_reuse_distance", "sub_group_size"}
        assert all(z[k] == (128 * 128 if k == "allgather_bucket_size" else 24 * 128 * 128) for k in sized), z


def test_sizes_a_json_sets_are_kept_and_absent_ones_without_auto_stay_deepspeeds(tmp_path):
    p = tmp_path / "z2.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                                   "allgather_bucket_size": 2e8}}))
    z = _setup(p, hidden_size=64).resolved["zero_optimization"]
    assert z["reduce_bucket_size"] == 64 * 64 and z["allgather_bucket_size"] == 2e8
    p.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8}}))
    assert "allgather_bucket_size" not in _setup(p).resolved["zero_optimization"]  # no "auto": untouched


# ------------------------------------------------------------------ HF's JSONs in zerotrain

def test_hf_docs_zero2_json_loads_unchanged():
    ds = _setup(HF_DIR / "ds_config_zero2.json", hidden_size=64)
    r = ds.resolved
    zs = ds.settings  # ZeroSettings
    assert (zs.stage, zs.offload_optimizer, zs.offload_param, ds.precision) == (2, "cpu", None, "fp32")
    assert ds.precision_why == ('bf16.enabled and fp16.enabled "auto": no GPU here, and CPUs emulate bf16 '
                                '~7x slower')
    assert r["bf16"] == {"enabled": False} and r["fp16"]["enabled"] is False and r["fp16"]["hysteresis"] == 2
    assert "optimizer" not in r and "scheduler" not in r  # zerotrain's AdamW and LR, with the run's values
    assert (r["train_micro_batch_size_per_gpu"], r["gradient_accumulation_steps"], r["train_batch_size"],
            r["gradient_clipping"]) == (8, 1, 16, 1.0)
    assert r["steps_per_print"] == 2000 and r["wall_clock_breakdown"] is False  # passed to DeepSpeed
    z = r["zero_optimization"]
    assert z["reduce_bucket_size"] == 64 * 64 and z["allgather_bucket_size"] == 2e8  # the file's own value kept
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True} and z["allgather_partitions"] is True
    assert not _autos(r) and "data_types" not in r  # fp32: no accumulation dtype to add


def test_hf_docs_zero3_json_loads_unchanged():
    ds = _setup(HF_DIR / "ds_config_zero3.json", hidden_size=64)
    zs = ds.settings  # ZeroSettings
    assert (zs.stage, zs.offload_optimizer, zs.offload_param, ds.precision) == (3, "cpu", "cpu", "fp32")
    z = ds.resolved["zero_optimization"]
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * 64 * 64) and z["stage3_param_persistence_threshold"] == 640
    assert z["sub_group_size"] == z["stage3_max_live_parameters"] == z["stage3_max_reuse_distance"] == 1e9
    assert z["stage3_gather_16bit_weights_on_model_save"] is True and not _autos(ds.resolved)


@pytest.mark.parametrize("launcher,want", [("bf16", "bf16"), ("fp16", "fp16"), ("no", "bf16"), (None, "bf16")])
def test_hf_docs_json_on_a_gpu(monkeypatch, launcher, want):
    """On a bf16 GPU "auto" is accelerate's mixed_precision when it names one, else bf16."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    ds = _setup(HF_DIR / "ds_config_zero2.json", cuda=True, launcher_precision=launcher)
    assert ds.precision == want
    assert ds.resolved["bf16"]["enabled"] is (want == "bf16") and ds.resolved["fp16"]["enabled"] is (want == "fp16")
    assert ("accelerate's mixed_precision" in ds.precision_why) is (launcher in ("bf16", "fp16"))
    if want == "bf16":
        assert ds.resolved["data_types"] == {"grad_accum_dtype": "fp32"}


def test_hf_docs_older_variants(tmp_path, monkeypatch):
    """The guide's ZeRO-2 example as its text has it: no bf16 block (fp16 "auto" only), 2e8 buckets."""
    data = json.loads((HF_DIR / "ds_config_zero2.json").read_text())
    del data["bf16"]
    data["zero_optimization"]["reduce_bucket_size"] = 2e8
    p = tmp_path / "old.json"
    p.write_text(json.dumps(data))
    ds = _setup(p)
    assert ds.precision == "fp32" and ds.resolved["zero_optimization"]["reduce_bucket_size"] == 2e8
    assert "allgather_bucket_size" in ds.resolved["zero_optimization"]
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    ds = _setup(p, cuda=True, launcher_precision="")
    assert ds.precision == "fp16" and "bf16 is disabled in the JSON" in ds.precision_why


def test_hf_docs_scheduler_must_match_the_run_schedule():
    with pytest.raises(ConfigError, match='"scheduler.type" WarmupLR means schedule "constant".*optim.schedule'):
        _setup(HF_DIR / "ds_config_zero3.json", cfg=load_config(None))


@pytest.mark.parametrize("blocks,cuda,bf16_gpu,launcher,want", [
    ({"bf16": "auto", "fp16": "auto"}, False, False, None, "fp32"),
    ({"bf16": "auto", "fp16": "auto"}, False, False, "bf16", "bf16"),      # accelerate says bf16: bf16 on a CPU
    ({"bf16": "auto", "fp16": "auto"}, True, False, None, "fp16"),         # a V100: fp16 with loss scaling
    ({"bf16": "auto", "fp16": False}, True, False, None, "fp32"),          # ... unless fp16 is off
    ({"bf16": True, "fp16": "auto"}, True, True, "fp16", "bf16"),          # the JSON's true wins (then check_run)
    ({"bf16": False, "fp16": False}, True, True, None, "fp32"),
])
def test_precision_auto_rule(monkeypatch, blocks, cuda, bf16_gpu, launcher, want):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_gpu)
    ds = {k: {"enabled": v} for k, v in blocks.items()}
    prec, why = resolve_precision("x.json", ds, cuda, launcher or "")
    assert prec == want
    assert (why is None) is ("auto" not in blocks.values() or True in blocks.values())


def test_precision_auto_refusals():
    with pytest.raises(ConfigError, match="accelerate's mixed_precision is fp16 but \"fp16.enabled\" is false"):
        resolve_precision("x.json", {"bf16": {"enabled": "auto"}}, True, "fp16")
    with pytest.raises(ConfigError, match='"bf16.enabled" must be true, false or "auto"'):
        resolve_precision("x.json", {"bf16": {"enabled": 1}}, True, "")


def test_scheduler_warmup_type(tmp_path):
    sched = {"type": "WarmupLR", "params": {"warmup_num_steps": "auto", "warmup_type": "linear"}}
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"scheduler": sched, "zero_optimization": {"stage": 1}}))
    assert "scheduler" not in _setup(p).resolved
    sched["params"]["warmup_type"] = "log"
    p.write_text(json.dumps({"scheduler": sched, "zero_optimization": {"stage": 1}}))
    with pytest.raises(ConfigError, match='"scheduler.params.warmup_type": \'log\': zerotrain warms up linearly'):
        _setup(p)


# ------------------------------------------------------------------ a real launch

@pytest.mark.multiproc
def test_hf_docs_zero3_json_trains_on_two_processes(tmp_path):
    """HF's ZeRO-3 example, unchanged: ZeRO-3 with parameters and optimizer offloaded to the CPU,
    fp32 here ("auto" on a CPU), 2 steps on 2 processes."""
    run_dir = tmp_path / "run"
    proc = run_train("torchrun", 2, [*TINY, "--ds-config", str(HF_DIR / "ds_config_zero3.json"),
                                     "--optim.schedule", "constant", "--train.max_steps", "2",
                                     "--train.eval_every", "0", "--train.run_dir", str(run_dir)], timeout=600)
    assert "ZeRO-3 + optimizer offload (cpu) + param offload (cpu) (fp32)" in proc.stdout
    assert ('precision    fp32 (bf16.enabled and fp16.enabled "auto": no GPU here, and CPUs emulate bf16 '
            '~7x slower)') in proc.stdout
    losses = train_losses(run_dir)
    assert sorted(losses) == [1, 2] and all(math.isfinite(v) for v in losses.values()), losses
    resolved = json.loads((run_dir / "config.json").read_text())["resolved"]
    assert resolved["precision_auto"].startswith('bf16.enabled and fp16.enabled "auto"')
    z = resolved["deepspeed_config"]["zero_optimization"]
    assert z["stage3_max_live_parameters"] == 1e9 and z["offload_param"]["device"] == "cpu"
    assert resolved["deepspeed_config"]["bf16"] == {"enabled": False}
