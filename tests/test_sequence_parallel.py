"""Ulysses sequence parallelism (distributed.sequence_parallel, issue 29), launched: exact against
one rank, resumable both ways, exported as a plain run. (Refusals and the planner, in-process:
tests/test_sequence_parallel_checks.py.)

The launches are real (tests/helpers.py run_train): SP=2 runs of 2 processes (ZeRO-3, fp32, every
matrix partitioned) and one of 4 (2 SP groups x 2 data-parallel ranks), each against a 1-process
run without SP on the same samples, at 4096 tokens per row with a tiny width so that it runs on
this CPU. Module-scoped fixtures share them: the 6-step pair also saves at step 3 and each side
resumes the other's checkpoint; the accumulation pair runs with activation checkpointing (the
all-to-alls run again in the recomputation) and its 1-rank side is the 4-rank run's reference;
the 1-rank 6-step run is the unmasked reference of the document-masked pair (the same rows).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import TINY, data_trace, fp32, rank_infos, run_train, train_losses, write_token_file

SEQ_LEN = 4096
# The tiny GPT (4 heads, 2 KV heads: GQA) at a long row; 300 kB of text = 73 rows of 4096.
LONG = [*TINY, "--model.seq_len", str(SEQ_LEN), "--data.seq_len", str(SEQ_LEN), "--train.micro_batch_size", "1",
        "--train.eval_every", "0", "--model.d_model", "128"]
SP2 = ["--distributed.sequence_parallel", "2"]
TOL = 1e-5


def _steps(d: Path) -> dict[int, float]:
    return train_losses(d)


def _rows(d: Path, rank: int = 0) -> list[list[int]]:
    """The crc of every row the rank trained on, one sorted list per step (debug.trace_data)."""
    by_step: dict[int, list[int]] = {}
    for r in data_trace(d, rank):
        by_step.setdefault(r["step"], []).extend(r["crc"])
    return [sorted(by_step[k]) for k in sorted(by_step)]


def _without(args: list[str], *flags: str) -> list[str]:
    """args less each flag in `flags` and its value."""
    out, skip = [], False
    for a in args:
        if skip or a in flags:
            skip = not skip
            continue
        out.append(a)
    return out


def _max_diff(a: dict, b: dict, steps) -> float:
    return max(abs(a[s] - b[s]) for s in steps)


# ---------------------------------------------------------------------------- launches (shared)

@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("sp")
    return {"dir": d, "zero3": fp32(d, "zero3")}


def _launch(work, name: str, nproc: int, *args, common: list[str] = LONG) -> Path:
    run_dir = work["dir"] / name
    launcher = "python" if nproc == 1 else "torchrun"
    proc = run_train(launcher, nproc, [*common, "--ds-config", work["zero3"], *args, "--train.run_dir", str(run_dir)])
    (run_dir / "launcher.out").write_text(proc.stdout)
    return run_dir


SIX = ["--train.max_steps", "6", "--checkpoint.every_steps", "3"]
TRACE = ["--debug.trace_data", "true"]  # ranks/rank<R>.data.jsonl: a crc of every row each rank trains on


@pytest.fixture(scope="module")
def base6(work):
    """1 process, no SP: 6 steps, checkpoints at steps 3 and 6 (its rows traced)."""
    return _launch(work, "base6", 1, *SIX, *TRACE)


@pytest.fixture(scope="module")
def sp6(work):
    """2 processes, SP=2 (one group): the same 6 steps and checkpoints."""
    return _launch(work, "sp6", 2, *SIX, *SP2)


# Activation checkpointing on: backward recomputes every block, the all-to-alls included.
ACCUM = ["--train.micro_batch_size", "2", "--train.grad_accum_steps", "2", "--train.max_steps", "3",
         "--model.activation_checkpointing", "true"]


@pytest.fixture(scope="module")
def base_accum(work):
    """1 process, no SP: micro-batches of 2 rows, accumulation 2 (4 rows per step), checkpointing."""
    return _launch(work, "base_accum", 1, *ACCUM, *TRACE)


@pytest.fixture(scope="module")
def sp_accum(work):
    return _launch(work, "sp_accum", 2, *ACCUM, *SP2)


# SP=2 in a world of 4: 2 groups x 2 data-parallel ranks of micro 2, no accumulation = base_accum's
# 4 rows per step (the sampler's order does not depend on micro, accumulation or world).
WORLD4 = [*ACCUM, "--train.grad_accum_steps", "1", *SP2, *TRACE]


@pytest.fixture(scope="module")
def sp4(work):
    return _launch(work, "sp4", 4, *WORLD4)


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
def test_sp2_with_accumulation_two_rows_per_micro_batch_and_checkpointing_matches_one_rank(base_accum, sp_accum):
    """Activation checkpointing recomputes each block in backward, so the SP run does its
    all-to-alls again there: the gradients (hence steps 2 and 3) are still the 1-rank run's."""
    base, sp = _steps(base_accum), _steps(sp_accum)
    assert sorted(sp) == sorted(base) == [1, 2, 3]
    assert _max_diff(base, sp, [1, 2, 3]) < TOL, (base, sp)
    for d in (base_accum, sp_accum):
        model = json.loads((d / "config.json").read_text())["model"]
        assert model["activation_checkpointing"] is True and model["resolved"]["activation_checkpointing"] is True


@pytest.mark.multiproc
def test_sp2_in_a_world_of_4_matches_one_rank_on_the_same_rows(base_accum, sp4):
    """2 SP groups (ranks 0-1, 2-3) x 2 data-parallel ranks, ZeRO-3 over all 4: each step trains
    on the rows of the 1-rank run's step (the order of a run without SP) with its losses."""
    base, sp = _steps(base_accum), _steps(sp4)
    assert sorted(sp) == sorted(base) == [1, 2, 3]
    assert _max_diff(base, sp, [1, 2, 3]) < TOL, (base, sp)
    rows = [_rows(sp4, r) for r in range(4)]
    assert rows[0] == rows[1] and rows[2] == rows[3], rows  # a group reads the same rows
    assert [sorted(a + b) for a, b in zip(rows[0], rows[2])] == _rows(base_accum), (rows, _rows(base_accum))
    infos = rank_infos(sp4)
    assert [i["sequence_parallel"]["ranks"] for i in infos] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert all(i["zero3"]["held_elements"] * 3 < i["zero3"]["elements"] for i in infos), infos  # ~1/4 each
    cfg = json.loads((sp4 / "config.json").read_text())
    assert cfg["resolved"]["tokens_per_step"] == 4 * SEQ_LEN
    assert cfg["resolved"]["deepspeed_config"]["train_batch_size"] == 8  # DeepSpeed: 4 ranks x 2 rows


# ---------------------------------------------------------------------------- document masks

EOS = 10  # a newline: each line of the corpus is a document, dozens of them in every row


@pytest.fixture(scope="module")
def doc_runs(work):
    """base6's 300 kB of text written as a byte-level token file, so the rows are base6's, with
    data.document_mask at EOS: 3 steps on 1 rank without SP and on 2 ranks with SP=2."""
    from zerotrain.train.data.text import read_bytes
    tok = write_token_file(work["dir"] / "doc_tokens" / "train.bin", read_bytes(None, 300000)[0])
    common = [*_without(LONG, "--data.max_bytes"), "--data.kind", "tokens", "--data.path", str(tok),
              "--data.document_mask", "true", "--data.eos_id", str(EOS)]
    args = ["--train.max_steps", "3", *TRACE]
    return (_launch(work, "doc_base", 1, *args, common=common),
            _launch(work, "doc_sp", 2, *args, *SP2, common=common))


@pytest.mark.multiproc
def test_sp2_with_document_masks_matches_one_rank_and_the_mask_counts(base6, doc_runs):
    """Packed documents under SP: attention sees the whole row's doc_ids and positions on every
    rank, so the masked losses are the 1-rank masked run's; and on the same rows (base6's, by
    their crcs) the mask changes the losses by far more than that tolerance, so an SP path that
    dropped it could not pass."""
    doc_base, doc_sp = doc_runs
    base, sp, unmasked = _steps(doc_base), _steps(doc_sp), _steps(base6)
    assert sorted(sp) == sorted(base) == [1, 2, 3]
    assert _max_diff(base, sp, [1, 2, 3]) < TOL, (base, sp)
    assert _rows(doc_base) == _rows(doc_sp, 0) == _rows(doc_sp, 1) == _rows(base6)[:3]
    assert _max_diff(base, unmasked, [1, 2, 3]) > 100 * TOL, (base, unmasked)
    for d in doc_runs:
        assert json.loads((d / "config.json").read_text())["data"]["document_mask"] is True


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
    from zerotrain.train.data.sampler import GlobalBatchSampler
    from zerotrain.train.launch.sequence_parallel import ReplicatedBatches
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

    from zerotrain.train.launch.sequence_parallel import SPRun
    ids = torch.arange(16).view(2, 8)
    b = {"input_ids": ids, "labels": ids + 1, "position_ids": ids % 8, "doc_ids": ids // 4}
    out = SPRun(size=2, rank=1, group=None).slice_batch(b)
    assert out["input_ids"].tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert out["labels"].tolist() == [[5, 6, 7, 8], [13, 14, 15, 16]]  # pre-shifted: token 7's target is 8
    assert out["position_ids"] is b["position_ids"] and out["doc_ids"] is b["doc_ids"]


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
    tiny = _without(TINY, "--data.max_bytes", "--checkpoint.export")  # (text-only; the export is under test)
    argv = [*tiny, *hf_llama, "--data.seq_len", str(SEQ_LEN), "--train.micro_batch_size", "1",
            "--train.grad_accum_steps", "2", "--train.max_steps", "3", "--train.eval_every", "0",
            "--checkpoint.export", "true", "--checkpoint.export_dtype", "fp32",
            "--ds-config", work["zero3"], *args, "--train.run_dir", str(run_dir)]
    run_train(launcher, nproc, argv)
    return run_dir


@pytest.fixture(scope="module")
def hf_runs(work, hf_llama):
    """The tiny Llama for 3 steps of 2 rows, on 1 rank and with SP=2; each exports fp32 weights."""
    return _hf_launch(work, hf_llama, "hf_base", 1), _hf_launch(work, hf_llama, "hf_sp", 2, *SP2)


@pytest.mark.multiproc
def test_hf_llama_sp2_matches_one_rank_with_accumulation(hf_runs):
    """transformers' Llama under SP=2 (the "zerotrain_ulysses" attention around its sdpa, the
    slice's own positions for its RoPE) has the 1-rank losses of the same rows."""
    base_dir, sp_dir = hf_runs
    base, sp = _steps(base_dir), _steps(sp_dir)
    assert sorted(sp) == sorted(base) == [1, 2, 3]
    assert _max_diff(base, sp, [1, 2, 3]) < TOL, (base, sp)
    assert rank_infos(sp_dir)[1]["sequence_parallel"]["rank"] == 1


def _hf_loss(model_dir: Path, row) -> tuple[float, object]:
    """transformers' own load of `model_dir` and its mean next-token loss on one row."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=row[None, :-1]).logits[0]
    return torch.nn.functional.cross_entropy(logits.float(), row[1:]).item(), model


@pytest.mark.multiproc
def test_hf_llama_sp_export_loads_in_transformers_as_the_one_rank_export(work, hf_llama, hf_runs):
    """checkpoint.export of the SP run is a plain transformers checkpoint: the same files, tensor
    names and config as the 1-rank run's export (no SP attention or layout in it), loaded by
    AutoModelForCausalLM.from_pretrained with the same loss on a fixed row; that loss is the
    trained weights', not the initial ones'."""
    import numpy as np
    import torch
    base_exp, sp_exp = (d / "export" for d in hf_runs)
    tokens = np.fromfile(hf_llama[-1], dtype=np.uint16)[: SEQ_LEN + 1].astype(np.int64)
    row = torch.from_numpy(tokens)
    (base_loss, _), (sp_loss, sp_model) = _hf_loss(base_exp, row), _hf_loss(sp_exp, row)
    init_loss, _ = _hf_loss(work["dir"] / "llama", row)
    assert abs(base_loss - sp_loss) < TOL, (base_loss, sp_loss)
    assert abs(init_loss - sp_loss) > 100 * TOL, (init_loss, sp_loss)
    assert sp_model.config._attn_implementation == "sdpa"
    assert sorted(p.name for p in sp_exp.iterdir()) == sorted(p.name for p in base_exp.iterdir())
    cfg_sp, cfg_base = (json.loads((e / "config.json").read_text()) for e in (sp_exp, base_exp))
    assert cfg_sp == cfg_base and "zerotrain_ulysses" not in json.dumps(cfg_sp), cfg_sp
    from safetensors import safe_open
    shapes = [{k: f.get_slice(k).get_shape() for k in f.keys()}
              for f in (safe_open(str(e / "model.safetensors"), framework="pt") for e in (sp_exp, base_exp))]
    assert shapes[0] == shapes[1], shapes


# ---------------------------------------------------------------------------- sliding windows (hf:)

W_SEQ, WINDOW = 256, 40  # a window far shorter than the row and than each rank's 128-token slice
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]  # per layer, as config.layer_types


def _qwen_window(layer_types, window=WINDOW):
    """The tiny Qwen2 of hf_window with these layer types (window None: no sliding window at all)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=W_SEQ,
                      use_sliding_window=window is not None, sliding_window=window, layer_types=layer_types,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, initializer_range=0.2)
    return Qwen2ForCausalLM(cfg)


@pytest.mark.parametrize("T,window,block", [(300, 40, 64), (300, 40, None), (97, 200, 32), (256, 1, 50)])
def test_windowed_sdpa_is_the_dense_banded_attention_without_a_t_by_t_mask(T, window, block):
    """The SP sliding-window attention in query blocks (models/ulysses.py windowed_sdpa) against
    sdpa with the dense (T, T) banded mask, through transformers' own sdpa function with GQA
    (4 query heads on 2 kv heads): the same outputs and gradients (fp32, 1e-5), and no call sees
    more than block x (block + window) positions."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from zerotrain.models.ulysses import windowed_sdpa
    torch.manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    q = torch.randn(2, 4, T, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, T, 8, requires_grad=True) for _ in range(2))
    pos = torch.arange(T)
    dense = ((pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window))[None, None]
    want = sdpa_attention_forward(module, q, k, v, dense, is_causal=False)[0]
    sizes = []

    def attend(qb, kb, vb, mask):
        sizes.append(mask.shape[-2] * mask.shape[-1])
        return sdpa_attention_forward(module, qb, kb, vb, mask, is_causal=False)[0]
    got = windowed_sdpa(attend, q, k, v, window, block)
    assert got.shape == want.shape == (2, T, 4, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(want)
    grads = [torch.autograd.grad((out * g).sum(), (q, k, v)) for out in (want, got)]
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    step = block or max(window, 128)
    assert max(sizes) <= step * (step + window - 1) and (T <= step or max(sizes) < T * T), sizes


@pytest.fixture(scope="module")
def hf_window(work):
    """A tiny random Qwen2 (sdpa) whose layers 0 and 2 attend over a 40-token sliding window and
    layer 1 over the whole causal row, and random byte tokens for it: 256-token rows."""
    import numpy as np
    d = work["dir"] / "qwen_window"
    _qwen_window(MIXED).save_pretrained(str(d))
    tokens = np.random.default_rng(1).integers(0, 256, size=12 * (W_SEQ + 1))
    tok = write_token_file(work["dir"] / "window_tokens" / "train.bin", tokens)
    return d, tok


@pytest.fixture(scope="module")
def window_runs(work, hf_window):
    """3 steps of 2 rows on 1 rank and with SP=2 (ZeRO-3, fp32)."""
    d, tok = hf_window
    tiny = _without(TINY, "--data.max_bytes", "--data.seq_len")
    common = [*tiny, "--model.name", f"hf:{d}", "--data.kind", "tokens", "--data.path", str(tok),
              "--data.seq_len", str(W_SEQ), "--train.micro_batch_size", "2", "--train.max_steps", "3",
              "--train.eval_every", "0"]
    return (_launch(work, "window_base", 1, common=common),
            _launch(work, "window_sp", 2, *SP2, common=common))


@pytest.mark.multiproc
def test_hf_sliding_window_with_mixed_layer_types_under_sp2_matches_one_rank(hf_window, window_runs):
    """The SP attention sees the whole row, so it must make the layer's own mask over it: banded
    on the sliding layers, plain causal on the full one. The SP=2 losses are the 1-rank ones; and
    on this model the window (and which layers have it) moves a row's loss by far more than that
    tolerance, so an SP path that dropped the window, or put it on every layer, could not pass."""
    import numpy as np
    import torch
    base, sp = _steps(window_runs[0]), _steps(window_runs[1])
    assert sorted(sp) == sorted(base) == [1, 2, 3]
    assert _max_diff(base, sp, [1, 2, 3]) < TOL, (base, sp)
    assert base[3] < base[1], base  # it trains
    row = torch.from_numpy(np.fromfile(hf_window[1], dtype=np.uint16)[: W_SEQ + 1].astype(np.int64))
    losses = {}
    for name, model in (("mixed", _qwen_window(MIXED)), ("every layer", _qwen_window(["sliding_attention"] * 3)),
                        ("none", _qwen_window(["full_attention"] * 3, window=None))):
        with torch.no_grad():
            logits = model.eval()(input_ids=row[None, :-1]).logits[0]
        losses[name] = torch.nn.functional.cross_entropy(logits, row[1:]).item()
    assert abs(losses["mixed"] - losses["none"]) > 100 * TOL, losses
    assert abs(losses["mixed"] - losses["every layer"]) > 100 * TOL, losses
    cfg = json.loads((window_runs[1] / "config.json").read_text())
    assert cfg["model"]["resolved"]["attn_implementation"] == "sdpa"
