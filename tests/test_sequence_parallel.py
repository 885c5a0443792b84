"""Ulysses sequence parallelism (distributed.sequence_parallel, issue 29): exact against one rank,
resumable both ways, refused up front where it cannot run.

The launches are real (tests/helpers.py run_train): an SP=2 run of 2 processes (ZeRO-3, fp32,
every matrix partitioned) against a 1-process run without SP on the same samples, at 4096 tokens
per row with a tiny width so that it runs on this CPU. Module-scoped fixtures share them: the
6-step pair also saves at step 3, and each side resumes the other's checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import TINY, fp32, rank_infos, run_main, run_train, train_losses

SEQ_LEN = 4096
# The tiny GPT (4 heads, 2 KV heads: GQA) at a long row; 300 kB of text = 73 rows of 4096.
LONG = [*TINY, "--model.seq_len", str(SEQ_LEN), "--data.seq_len", str(SEQ_LEN), "--train.micro_batch_size", "1",
        "--train.eval_every", "0", "--model.d_model", "128"]
SP2 = ["--distributed.sequence_parallel", "2"]
TOL = 1e-5


def _steps(d: Path) -> dict[int, float]:
    return train_losses(d)


def _max_diff(a: dict, b: dict, steps) -> float:
    return max(abs(a[s] - b[s]) for s in steps)


# ---------------------------------------------------------------------------- launches (shared)

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    return {"dir": d, "zero3": fp32(d, "zero3")}


def _launch(work, name: str, nproc: int, *args) -> Path:
    run_dir = work["dir"] / name
    launcher = "python" if nproc == 1 else "torchrun"
    proc = run_train(launcher, nproc, [*LONG, "--ds-config", work["zero3"], *args, "--train.run_dir", str(run_dir)])
    (run_dir / "launcher.out").write_text(proc.stdout)
    return run_dir


SIX = ["--train.max_steps", "6", "--checkpoint.every_steps", "3"]


@pytest.fixture(scope="module")
def base6(work):
    """1 process, no SP: 6 steps, checkpoints at steps 3 and 6."""
    return _launch(work, "base6", 1, *SIX)


@pytest.fixture(scope="module")
def sp6(work):
    """2 processes, SP=2 (one group): the same 6 steps and checkpoints."""
    return _launch(work, "sp6", 2, *SIX, *SP2)


ACCUM = ["--train.micro_batch_size", "2", "--train.grad_accum_steps", "2", "--train.max_steps", "3"]


@pytest.fixture(scope="module")
def base_accum(work):
    """1 process, no SP: micro-batches of 2 rows, accumulation 2 (4 rows per step)."""
    return _launch(work, "base_accum", 1, *ACCUM)


@pytest.fixture(scope="module")
def sp_accum(work):
    return _launch(work, "sp_accum", 2, *ACCUM, *SP2)


def _ckpt(run_dir: Path, step: int) -> str:
    return str(run_dir / "checkpoints" / f"step_{step:08d}")


# ---------------------------------------------------------------------------- exactness

@pytest.mark.multiproc
def test_sp2_zero3_matches_one_rank_step_by_step(base6, sp6):
    """The loss of every step of the SP=2 run is the 1-rank loss of the same rows (1e-5, fp32)."""
    base, sp = _steps(base6), _steps(sp6)
    assert sorted(sp) == sorted(base) == list(range(1, 7))
    assert _max_diff(base, sp, range(1, 7)) < TOL, (base, sp)
    assert base[6] < base[1] - 0.3, base  # it trains: the comparison is not of two constant numbers
    infos = rank_infos(sp6)
    # One group of both ranks, each holding its half of every row; ZeRO-3 partitioned over both.
    assert [i["sequence_parallel"] for i in infos] == [{"size": 2, "rank": 0, "ranks": [0, 1]},
                                                       {"size": 2, "rank": 1, "ranks": [0, 1]}]
    assert all(i["zero3"]["held_elements"] < i["zero3"]["elements"] for i in infos), infos
    cfg = json.loads((sp6 / "config.json").read_text())
    assert cfg["resolved"]["tokens_per_step"] == SEQ_LEN  # one row per step, as without SP
    assert cfg["resolved"]["deepspeed_config"]["train_batch_size"] == 2  # DeepSpeed: 2 ranks x 1 row


@pytest.mark.multiproc
def test_sp2_with_accumulation_and_two_rows_per_micro_batch_matches_one_rank(base_accum, sp_accum):
    base, sp = _steps(base_accum), _steps(sp_accum)
    assert sorted(sp) == sorted(base) == [1, 2, 3]
    assert _max_diff(base, sp, [1, 2, 3]) < TOL, (base, sp)


# ---------------------------------------------------------------------------- checkpoints

@pytest.mark.multiproc
def test_sp_checkpoint_resumes_without_sp_and_the_reverse(work, base6, sp6):
    """SP (2 ranks) -> no SP (1 rank), and no SP -> SP: the continuation is the uninterrupted
    1-rank run's. The checkpoint has no SP layout: its data position and batch are a plain run's."""
    base = _steps(base6)
    plain = _launch(work, "plain_from_sp", 1, *SIX, "--resume", _ckpt(sp6, 3))
    into_sp = _launch(work, "sp_from_plain", 2, *SIX, *SP2, "--resume", _ckpt(base6, 3))
    for d in (plain, into_sp):
        got = _steps(d)
        assert sorted(got) == [4, 5, 6], got
        assert _max_diff(base, got, [4, 5, 6]) < TOL, (d.name, base, got)
    meta_sp = json.loads((Path(_ckpt(sp6, 3)) / "meta.json").read_text())
    meta_base = json.loads((Path(_ckpt(base6, 3)) / "meta.json").read_text())
    assert meta_sp["data"] == meta_base["data"] and meta_sp["train_state"]["offset"] == 3
    assert meta_sp["world_size"] == 2 and meta_base["world_size"] == 1


# ---------------------------------------------------------------------------- data (no processes)

def test_replicated_batches_give_a_group_one_data_parallel_slice_in_the_plain_order():
    """SP=2 in a world of 4 (2 data-parallel ranks, micro 2): ranks 0,1 get data-parallel rank 0's
    rows, ranks 2,3 rank 1's, and a step's rows are those of a 1-process run without SP."""
    from train.data.sampler import GlobalBatchSampler
    from train.launch.sequence_parallel import ReplicatedBatches
    inner = GlobalBatchSampler(40, micro=2, world=2, accum=2, seed=3)
    rep = ReplicatedBatches(inner, n=2, micro=2)
    assert rep.batch_size == 8 and len(rep) == len(inner)
    one_rank = GlobalBatchSampler(40, micro=2, world=1, accum=4, seed=3)
    got = list(rep)
    plain = [i for b in one_rank for i in b]
    dp_rows = []
    for b in got:
        per_rank = [b[2 * r:2 * r + 2] for r in range(4)]
        assert per_rank[0] == per_rank[1] and per_rank[2] == per_rank[3] and per_rank[0] != per_rank[2]
        dp_rows += per_rank[0] + per_rank[2]
    assert dp_rows == plain


def test_slice_batch_keeps_positions_and_documents_whole():
    import torch

    from train.launch.sequence_parallel import SPRun
    ids = torch.arange(16).view(2, 8)
    b = {"input_ids": ids, "labels": ids + 1, "position_ids": ids % 8, "doc_ids": ids // 4}
    out = SPRun(size=2, rank=1, group=None).slice_batch(b)
    assert out["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert out["labels"].tolist() == [[5, 6, 7, 8], [13, 14, 15, 16]]  # pre-shifted: token 7's target is 8
    assert out["position_ids"] is b["position_ids"] and out["doc_ids"] is b["doc_ids"]


# ---------------------------------------------------------------------------- up-front errors

def test_sequence_parallel_must_be_a_whole_number_at_least_one():
    from train.config import load_config
    from train.errors import ConfigError
    for bad in ("0", "-2"):
        with pytest.raises(ConfigError, match="distributed.sequence_parallel must be a whole number >= 1"):
            load_config(None, [("distributed.sequence_parallel", bad)])
    with pytest.raises(ConfigError, match="distributed.sequence_parallel must be an integer"):
        load_config(None, [("distributed.sequence_parallel", "two")])


def _sp_check(tmp_path, n: int, *overrides, ds_json: str = "ds_configs/zero3.json"):
    """train/launch/sequence_parallel.check on a real config, model spec and DeepSpeed setup."""
    from models import resolve as resolve_model
    from train.config import load_config
    from train.dsconfig import load_ds_setup
    from train.launch import sequence_parallel as sp_
    pairs = [("model.name", "gpt-tiny"), ("data.seq_len", "64"), ("distributed.sequence_parallel", str(n)),
             *[tuple(o.split("=", 1)) for o in overrides]]
    cfg = load_config(None, pairs)
    spec = resolve_model(cfg.model)
    batch = cfg.train.batch(1)
    ds = load_ds_setup(ds_json, cfg, sp_.engine_batch(batch, n), 10, cuda=False, hidden_size=spec.hidden_size or 64)
    sp_.check(cfg, spec, cfg.data.seq_len, ds)


@pytest.mark.parametrize("n, overrides, ds_json, message", [
    (3, ["data.seq_len=48"], "ds_configs/zero3.json",
     "distributed.sequence_parallel 3 does not divide the model's 4 attention heads (gpt-tiny)"),
    (4, [], "ds_configs/zero3.json",
     "distributed.sequence_parallel 4 does not divide the model's 2 key/value heads (gpt-tiny)"),
    (2, ["data.seq_len=63"], "ds_configs/zero3.json",
     "distributed.sequence_parallel 2 does not divide data.seq_len 63"),
    (2, [], "ds_configs/ddp.json", "distributed.sequence_parallel 2 needs a ZeRO DeepSpeed JSON, not plain DDP"),
    (2, ["train.compile=true"], "ds_configs/zero3.json", "with train.compile true is not supported"),
], ids=["heads", "kv-heads", "seq-len", "ddp", "compile"])
def test_combinations_sp_cannot_run_are_refused_in_one_line(tmp_path, n, overrides, ds_json, message):
    from train.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        _sp_check(tmp_path, n, *overrides, ds_json=ds_json)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_sp_of_a_model_that_is_not_a_language_model_is_refused(tmp_path):
    from train.errors import ConfigError
    with pytest.raises(ConfigError, match='sequence parallelism splits a language model.s sequence; model.name "resnet18"'):
        _sp_check(tmp_path, 2, "model.name=resnet18", "data.kind=imagefolder")


def test_hf_attention_sp_cannot_wrap_is_refused(tmp_path):
    from models.spec import ModelSpec
    from train.config import load_config
    from train.errors import ConfigError
    from train.launch import sequence_parallel as sp_
    cfg = load_config(None, [("model.name", "hf:/x"), ("distributed.sequence_parallel", "2")])
    spec = ModelSpec(config=cfg.model, family="hf", hf_config={"num_attention_heads": 4, "num_key_value_heads": 2,
                                                               "_attn_implementation": "flash_attention_2"})

    class Zero3:
        is_deepspeed, path = True, "zero3.json"
    with pytest.raises(ConfigError, match='uses attn_implementation "flash_attention_2", which the Ulysses'):
        sp_.check(cfg, spec, 64, Zero3())


@pytest.mark.parametrize("pairs, flag", [
    ([("data.kind", "sft"), ("data.packing", "true")], "data.packing"),
    ([("data.kind", "tokens"), ("data.document_mask", "true")], "data.document_mask"),
], ids=["packing", "document-mask"])
def test_hf_packed_rows_under_sp_are_refused(pairs, flag):
    """The hf: attention under SP is plain causal over the whole row (the model's own mask is made
    per slice): rows of several documents would attend across them, so both flags are refused."""
    from models.spec import ModelSpec
    from train.config import load_config
    from train.errors import ConfigError
    from train.launch import sequence_parallel as sp_
    cfg = load_config(None, [("model.name", "hf:/x"), ("distributed.sequence_parallel", "2"), *pairs])
    spec = ModelSpec(config=cfg.model, family="hf", hf_config={"num_attention_heads": 4, "num_key_value_heads": 2})

    class Zero3:
        is_deepspeed, path = True, "zero3.json"
    with pytest.raises(ConfigError, match=f"distributed.sequence_parallel 2 with {flag} on an hf: model is not "
                                          f"supported .*; set {flag} false, or use the built-in GPT"):
        sp_.check(cfg, spec, 64, Zero3())


def test_world_size_not_divisible_exits_2_in_one_line(capsys):
    code, err = run_main(capsys, [*TINY, "--distributed.sequence_parallel", "2", "--train.max_steps", "1"])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert "distributed.sequence_parallel 2 does not divide the world size 1" in lines[0], err


# ---------------------------------------------------------------------------- hf: models

@pytest.fixture(scope="module")
def hf_llama(work):
    """A tiny random Llama (4 heads, 2 KV heads, a 4096-token context) saved with save_pretrained,
    and random byte tokens for it: nothing downloads. (At transformers' default init, 0.02, its
    attention is so close to uniform that rank 1 using positions 0.. instead of its own changed
    the losses by < 1e-5: this test then passed with that bug. At 0.2 it fails.)"""
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from helpers import write_token_file
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ_LEN,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
                      initializer_range=0.2)  # not ~uniform attention: a wrong position or slice shows
    d = work["dir"] / "llama"
    LlamaForCausalLM(cfg).save_pretrained(str(d))
    tokens = np.random.default_rng(0).integers(0, 256, size=12 * (SEQ_LEN + 1))
    tok = write_token_file(work["dir"] / "llama_tokens" / "train.bin", tokens)
    return ["--model.name", f"hf:{d}", "--data.kind", "tokens", "--data.path", str(tok)]


def _hf_launch(work, hf_llama, name: str, nproc: int, *args) -> Path:
    run_dir = work["dir"] / name
    launcher = "python" if nproc == 1 else "torchrun"
    tiny = [a for a in TINY if a not in ("--data.max_bytes", "300000")]  # (text-only)
    argv = [*tiny, *hf_llama, "--data.seq_len", str(SEQ_LEN), "--train.micro_batch_size", "1",
            "--train.grad_accum_steps", "2", "--train.max_steps", "3", "--train.eval_every", "0",
            "--ds-config", work["zero3"], *args, "--train.run_dir", str(run_dir)]
    run_train(launcher, nproc, argv)
    return run_dir


@pytest.mark.multiproc
def test_hf_llama_sp2_matches_one_rank_with_accumulation(work, hf_llama):
    """transformers' Llama under SP=2 (the "zerotrain_ulysses" attention around its sdpa, the
    slice's own positions for its RoPE) has the 1-rank losses of the same rows."""
    base = _steps(_hf_launch(work, hf_llama, "hf_base", 1))
    sp_dir = _hf_launch(work, hf_llama, "hf_sp", 2, *SP2)
    sp = _steps(sp_dir)
    assert sorted(sp) == sorted(base) == [1, 2, 3]
    assert _max_diff(base, sp, [1, 2, 3]) < TOL, (base, sp)
    assert rank_infos(sp_dir)[1]["sequence_parallel"]["rank"] == 1


# ---------------------------------------------------------------------------- planner

def test_planner_divides_activations_by_n_and_counts_the_all_to_all_buffers():
    """Per rank: every saved activation is per token, so 1/N of them; the exchange buffers are
    q, k, v of one layer (send copy + receive buffer) on the local tokens."""
    from models.gpt import preset
    from train.plan.activations import activation_bytes, sp_exchange_bytes
    from train.plan.shapes import BatchShape
    g = preset("gpt-tiny", seq_len=SEQ_LEN)
    for ckpt in (False, True):
        one = BatchShape(1, SEQ_LEN, 1, ckpt, 1)
        two = BatchShape(1, SEQ_LEN, 1, ckpt, 2)
        assert activation_bytes(g, two, 4) * 2 == activation_bytes(g, one, 4)
        assert sp_exchange_bytes(g, one, 4) == 0
        kv = g.n_kv_head * g.head_dim
        assert sp_exchange_bytes(g, two, 4) == 2 * 4 * (SEQ_LEN // 2) * (g.d_model + 2 * kv)


def test_zerotrain_plan_sequence_parallel_flag(capsys):
    from train.commands.plan import main as plan
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
