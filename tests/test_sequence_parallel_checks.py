"""Ulysses sequence parallelism (distributed.sequence_parallel, issue 29) without launching:
every combination it cannot run refused up front in one line, and the planner's arithmetic for
it (activations / N, the all-to-all buffers). The launches: tests/test_sequence_parallel.py."""

from __future__ import annotations

import json

import pytest

from helpers import TINY, run_main

SEQ_LEN = 4096


# ---------------------------------------------------------------------------- up-front errors

def test_sequence_parallel_must_be_a_whole_number_at_least_one():
    from zerotrain.train.config import load_config
    from zerotrain.train.errors import ConfigError
    for bad in ("0", "-2"):
        with pytest.raises(ConfigError, match="distributed.sequence_parallel must be a whole number >= 1"):
            load_config(None, [("distributed.sequence_parallel", bad)])
    with pytest.raises(ConfigError, match="distributed.sequence_parallel must be an integer"):
        load_config(None, [("distributed.sequence_parallel", "two")])


def _sp_check(tmp_path, n: int, *overrides, ds_json: str = "ds_configs/zero3.json"):
    """train/launch/sequence_parallel.refuse_unsupported on a real config, model spec and strategy."""
    from zerotrain.models import resolve as resolve_model
    from zerotrain.train.config import load_config
    from zerotrain.train.launch import sequence_parallel as sp_
    from zerotrain.train.strategy import for_setup
    from zerotrain.train.strategy.ds_config import load_ds_setup
    more = [tuple(o.split("=", 1)) for o in overrides]
    seq = [] if ("data.kind", "imagefolder") in more else [("data.seq_len", "64")]  # a key of LM data only
    pairs = [("model.name", "gpt-tiny"), *seq, ("distributed.sequence_parallel", str(n)), *more]
    cfg = load_config(None, pairs)
    spec = resolve_model(cfg.model)
    batch = cfg.train.batch(1)
    ds = load_ds_setup(ds_json, cfg, sp_.engine_batch(batch, n), 10, cuda=False, hidden_size=spec.hidden_size or 64)
    sp_.refuse_unsupported(cfg, spec, cfg.data.seq_len, for_setup(ds))


@pytest.mark.parametrize("n, overrides, ds_json, message", [
    (3, ["data.seq_len=48"], "ds_configs/zero3.json",
     "distributed.sequence_parallel 3 does not divide the model's 4 attention heads (gpt-tiny)"),
    (4, [], "ds_configs/zero3.json",
     "distributed.sequence_parallel 4 does not divide the model's 2 key/value heads (gpt-tiny)"),
    (2, ["data.seq_len=63"], "ds_configs/zero3.json",
     "distributed.sequence_parallel 2 does not divide data.seq_len 63"),
    (2, [], "ds_configs/ddp.json", "distributed.sequence_parallel 2 needs a ZeRO DeepSpeed JSON, not plain DDP"),
    (2, ["hardware.compile=true"], "ds_configs/zero3.json", "with hardware.compile true is not supported"),
], ids=["heads", "kv-heads", "seq-len", "ddp", "compile"])
def test_combinations_sp_cannot_run_are_refused_in_one_line(tmp_path, n, overrides, ds_json, message):
    from zerotrain.train.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        _sp_check(tmp_path, n, *overrides, ds_json=ds_json)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sp_of_a_model_that_is_not_a_language_model_is_refused(tmp_path):
    from zerotrain.train.errors import ConfigError
    with pytest.raises(ConfigError, match='sequence parallelism splits a language model.s sequence; model.name "resnet18"'):
        _sp_check(tmp_path, 2, "model.name=resnet18", "data.kind=imagefolder")


def test_hf_attention_sp_cannot_wrap_is_refused(tmp_path):
    from zerotrain.models.spec import ModelSpec
    from zerotrain.train.config import load_config
    from zerotrain.train.errors import ConfigError
    from zerotrain.train.launch import sequence_parallel as sp_
    cfg = load_config(None, [("model.name", "hf:/x"), ("distributed.sequence_parallel", "2")])
    spec = ModelSpec(config=cfg.model, family="hf", hf_config={"num_attention_heads": 4, "num_key_value_heads": 2,
                                                               "attn_implementation": "flash_attention_2"})

    class Zero3:  # a ZeRO strategy accepts sequence parallelism (train/strategy/zero.py)
        path = "zero3.json"

        def check_sequence_parallel(self, flag):
            pass
    with pytest.raises(ConfigError, match='uses attn_implementation "flash_attention_2", which the Ulysses'):
        sp_.refuse_unsupported(cfg, spec, 64, Zero3())


@pytest.mark.parametrize("hf, message", [
    ({"layer_types": ["full_attention", "chunked_attention"]}, "has layer types chunked_attention, which the SP"),
    ({"attention_chunk_size": 64}, "has chunked attention (attention_chunk_size), which the SP"),
    ({"attn_implementation": "eager"}, 'uses attn_implementation "eager", which the Ulysses all-to-all cannot '
                                       "wrap; set model.attn_implementation sdpa"),
], ids=["layer-types", "chunked", "eager"])
def test_hf_attention_the_sp_attention_does_not_reproduce_is_refused(hf, message):
    """Full and sliding-window causal layers are made exactly over the whole row (the launches:
    tests/test_sequence_parallel.py); any other kind of layer is refused in one line."""
    from zerotrain.models.spec import ModelSpec
    from zerotrain.train.config import load_config
    from zerotrain.train.errors import ConfigError
    from zerotrain.train.launch import sequence_parallel as sp_
    cfg = load_config(None, [("model.name", "hf:/x"), ("distributed.sequence_parallel", "2")])
    spec = ModelSpec(config=cfg.model, family="hf", hf_config={"num_attention_heads": 4, "num_key_value_heads": 2,
                                                               **hf})

    class Zero3:
        path = "zero3.json"

        def check_sequence_parallel(self, flag):
            pass
    with pytest.raises(ConfigError) as e:
        sp_.refuse_unsupported(cfg, spec, 64, Zero3())
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    ok = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 16}
    sp_.refuse_unsupported(cfg, ModelSpec(config=cfg.model, family="hf", hf_config={
        "num_attention_heads": 4, "num_key_value_heads": 2, **ok}), 64, Zero3())


@pytest.mark.parametrize("pairs, flag", [
    ([("data.kind", "sft"), ("data.packing", "true")], "data.packing"),
    ([("data.kind", "tokens"), ("data.document_mask", "true")], "data.document_mask"),
], ids=["packing", "document-mask"])
def test_hf_packed_rows_under_sp_are_refused(pairs, flag):
    """The hf: attention under SP is plain causal over the whole row (the model's own mask is made
    per slice): rows of several documents would attend across them, so both flags are refused."""
    from zerotrain.models.spec import ModelSpec
    from zerotrain.train.config import load_config
    from zerotrain.train.errors import ConfigError
    from zerotrain.train.launch import sequence_parallel as sp_
    cfg = load_config(None, [("model.name", "hf:/x"), ("distributed.sequence_parallel", "2"), *pairs])
    spec = ModelSpec(config=cfg.model, family="hf", hf_config={"num_attention_heads": 4, "num_key_value_heads": 2})

    class Zero3:  # a ZeRO strategy accepts sequence parallelism (train/strategy/zero.py)
        path = "zero3.json"

        def check_sequence_parallel(self, flag):
            pass
    with pytest.raises(ConfigError, match=f"distributed.sequence_parallel 2 with {flag} on an hf: model is not "
                                          f"supported .*; set {flag} false, or use the built-in GPT"):
        sp_.refuse_unsupported(cfg, spec, 64, Zero3())


def test_world_size_not_divisible_exits_2_in_one_line(capsys):
    code, err = run_main(capsys, [*TINY, "--distributed.sequence_parallel", "2", "--train.max_steps", "1"])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "distributed.sequence_parallel 2 does not divide the world size 1" in lines[0], err


# ---------------------------------------------------------------------------- planner

def test_planner_divides_activations_by_n_and_counts_the_all_to_all_buffers():
    """Per rank: every saved activation is per token, so 1/N of them; the exchange buffers are
    q, k, v of one layer (send copy + receive buffer) on the local tokens."""
    from zerotrain.models.gpt import preset
    from zerotrain.train.plan.activations import activation_bytes, sp_exchange_bytes
    from zerotrain.train.plan.shapes import BatchShape
    g = preset("gpt-tiny", seq_len=SEQ_LEN)
    for ckpt in (False, True):
        one = BatchShape(1, SEQ_LEN, 1, ckpt, 1)
        two = BatchShape(1, SEQ_LEN, 1, ckpt, 2)
        assert activation_bytes(g, two, 4) * 2 == activation_bytes(g, one, 4)
        assert sp_exchange_bytes(g, one, 4) == 0
        kv = g.n_kv_head * g.head_dim
        assert sp_exchange_bytes(g, two, 4) == 2 * 4 * (SEQ_LEN // 2) * (g.d_model + 2 * kv)


def test_zerotrain_plan_sequence_parallel_flag(capsys):
    from zerotrain.train.commands.plan import main as plan
    rows = {}
    for n in (1, 2):
        assert plan(["gpt-tiny", "--seq-len", "64", "--micro-batch", "1", "--json", "--sequence-parallel", str(n)]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["batch"]["sequence_parallel"] == n
        rows[n] = {o["option"]: o["device_bytes"] for o in out["options"]}
    z3 = [k for k in rows[1] if k.startswith("ZeRO-3")][0]
    assert rows[2][z3]["activations"] * 2 == rows[1][z3]["activations"]
    assert rows[2][z3]["params"] == rows[1][z3]["params"]  # ZeRO still partitions over the whole world
    with pytest.raises(SystemExit) as e:
        plan(["gpt-tiny", "--seq-len", "64", "--sequence-parallel", "3"])
    assert e.value.code == 2
    assert "--sequence-parallel 3 does not divide the sequence length 64" in capsys.readouterr().err
