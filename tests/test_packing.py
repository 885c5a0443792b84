"""Packed instruction data (data.packing) and document masking (issue 27).

What is promised: packing several records into a row changes nothing a record computes. With the
block-diagonal causal mask and per-document positions, each record's loss and gradient in a
packed row equal those of the record alone in a row of its own (fp32, 1e-5), for the built-in GPT
and a Hugging Face Llama; without the mask they differ (the mask is what makes it exact). The
plan is deterministic, puts every record in exactly one row, and packs rows tightly.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import save_tiny
from zerotrain.models import build_workload, resolve
from zerotrain.models.losses import IGNORE_INDEX
from zerotrain.models.workload import Workload
from zerotrain.train.config import DataConfig, ModelConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.packing import PackedSFT, best_fit_decreasing, pack_plan, packed_lengths
from zerotrain.train.data.sft import SFTSequences

os.environ["HF_HUB_OFFLINE"] = "1"

SEQ = 48


def records(n: int, seq_len: int = SEQ, seed: int = 0, vocab: int = 256, longest: int = SEQ + 8) -> SFTSequences:
    """n random records of 3..longest tokens (longer than seq_len + 1: truncated), the first
    third of each a prompt."""
    g = np.random.default_rng(seed)
    lengths = g.integers(3, longest, size=n)
    ids, trained, offsets = [], [], [0]
    for n_tok in lengths:
        ids += g.integers(1, vocab, size=n_tok).tolist()
        trained += [False] * (n_tok // 3) + [True] * (n_tok - n_tok // 3)
        offsets.append(len(ids))
    return SFTSequences(np.asarray(ids, np.int32), np.asarray(trained), np.asarray(offsets), seq_len, 0)


def record_losses(wl: Workload, batch: dict) -> torch.Tensor:
    """Per-token losses (B, T) of a batch through the workload's forward (0 where ignored), with
    gradients (tiny fp32 logits: F.cross_entropy is fine here)."""
    out = wl.logits(wl.model, batch).float()
    per = F.cross_entropy(out.reshape(-1, out.size(-1)), batch["labels"].reshape(-1), reduction="none")
    return per.view(batch["labels"].shape)


def stack(samples: list[dict]) -> dict:
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}


# ----------------------------------------------------------------------------- the plan

def test_plan_is_deterministic_complete_and_within_rows():
    recs = records(300)
    lengths = packed_lengths(recs.offsets, SEQ)
    a, b = pack_plan(lengths, SEQ, seed=3, window=64), pack_plan(lengths, SEQ, seed=3, window=64)
    assert [r.tolist() for r in a] == [r.tolist() for r in b]
    assert sorted(np.concatenate(a).tolist()) == list(range(300))      # every record exactly once
    assert all(lengths[r].sum() <= SEQ for r in a)
    assert [r.tolist() for r in pack_plan(lengths, SEQ, seed=4, window=64)] != [r.tolist() for r in a]
    # best-fit-decreasing is tight: at most one row per window is at most half full
    # (the records of two such rows would have fitted into one)
    assert sum(int(lengths[r].sum()) <= SEQ // 2 for r in a) <= -(-300 // 64)
    assert len(a) < 300 * 0.7


def test_best_fit_decreasing_takes_the_tightest_row():
    assert best_fit_decreasing(np.array([6, 5, 4, 3, 2]), 8) == [[0, 4], [1, 3], [2]]


def test_packed_rows_carry_the_unpacked_samples_positions_and_documents():
    recs = records(40)
    packed = PackedSFT(recs, seed=0, window=16)
    for i in range(len(packed)):
        row = packed[i]
        members = packed.members[packed.row_starts[i]:packed.row_starts[i + 1]]
        at = 0
        for d, rec in enumerate(members):
            one, n = recs[int(rec)], int(packed.lengths[rec])
            assert torch.equal(row["input_ids"][at:at + n], one["input_ids"][:n])
            assert torch.equal(row["labels"][at:at + n], one["labels"][:n])
            assert row["position_ids"][at:at + n].tolist() == list(range(n))
            assert (row["doc_ids"][at:at + n] == d).all()
            assert (one["labels"][n:] == IGNORE_INDEX).all()   # nothing of the record is left out
            at += n
        assert (row["labels"][at:] == IGNORE_INDEX).all() and (row["doc_ids"][at:] == len(members)).all()
    # every labelled token is in exactly one row
    assert sum(int((packed[i]["labels"] != IGNORE_INDEX).sum()) for i in range(len(packed))) == \
        sum(int((recs[i]["labels"] != IGNORE_INDEX).sum()) for i in range(len(recs)))


# ----------------------------------------------------------------------------- exactness

def gpt_workload():
    from zerotrain.train.data.bundle import DataBundle
    torch.manual_seed(0)
    data = DataBundle(train=None, val=None, task="lm", describe="", vocab_size=256, seq_len=SEQ)
    return build_workload(resolve(ModelConfig(name="gpt-tiny", seq_len=64)), data)


def hf_llama_workload(tmp_path: Path):
    from transformers import AutoModelForCausalLM
    d = save_tiny("llama", tmp_path / "llama", vocab=256)
    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32, local_files_only=True)
    model.config.use_cache = False  # as build_hf: transformers skips packed-sequence detection with a cache
    return Workload(model=model, task="lm", family="hf", model_config={})


def per_record(wl: Workload, packed: PackedSFT, rows: list[int], mask: bool = True) -> list[torch.Tensor]:
    """Each record's per-token losses (its n labels) from the packed rows, in plan order."""
    batch = stack([packed[i] for i in rows])
    if not mask:  # the same tokens as one causal sequence per row: no document mask, no restarts
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    per = record_losses(wl, batch)
    out = []
    for b, i in enumerate(rows):
        at = 0
        for rec in packed.members[packed.row_starts[i]:packed.row_starts[i + 1]]:
            n = int(packed.lengths[rec])
            out.append(per[b, at:at + n])
            at += n
    return out


def alone(wl: Workload, recs: SFTSequences, packed: PackedSFT, rows: list[int]) -> list[torch.Tensor]:
    """The same records one per row (the unpacked samples), per-token losses of their n labels."""
    ids = [int(r) for i in rows for r in packed.members[packed.row_starts[i]:packed.row_starts[i + 1]]]
    per = record_losses(wl, stack([recs[r] for r in ids]))
    return [per[k, :int(packed.lengths[r])] for k, r in enumerate(ids)]


def grads(wl: Workload, loss: torch.Tensor) -> list[torch.Tensor]:
    wl.model.zero_grad()
    loss.backward()
    return [p.grad.clone() for p in wl.model.parameters() if p.grad is not None]


def check_exact(wl: Workload):
    recs = records(24, longest=24)
    packed = PackedSFT(recs, seed=1, window=24)
    rows = list(range(len(packed)))
    assert max(len(packed.members[packed.row_starts[i]:packed.row_starts[i + 1]]) for i in rows) >= 3
    p, a = per_record(wl, packed, rows), alone(wl, recs, packed, rows)
    for x, y in zip(p, a):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
        torch.testing.assert_close(x.sum(), y.sum(), atol=1e-5, rtol=0)
    # the gradient of every record's loss together, and of one record that shares its row
    for pick in (slice(None), slice(len(p) // 2, len(p) // 2 + 1)):
        gp = grads(wl, torch.stack([t.sum() for t in per_record(wl, packed, rows)[pick]]).sum())
        ga = grads(wl, torch.stack([t.sum() for t in alone(wl, recs, packed, rows)[pick]]).sum())
        for x, y in zip(gp, ga):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
    return recs, packed, rows


def test_gpt_packed_records_compute_exactly_what_they_compute_alone():
    check_exact(gpt_workload())


def test_hf_llama_packed_records_compute_exactly_what_they_compute_alone(tmp_path):
    check_exact(hf_llama_workload(tmp_path))


@pytest.mark.parametrize("family", ["gpt", "hf"])
def test_the_mask_matters(tmp_path, family):
    """The second record's answer is the first record's text: a model that reads across the
    boundary predicts it differently. Without the document mask (and position restarts) the
    packed losses are not the records' own; with them they are."""
    wl = gpt_workload() if family == "gpt" else hf_llama_workload(tmp_path)
    secret = list(b"XQZJ-7781-secret")
    first = list(b"key: ") + secret + [0]
    second = list(b"what key? ") + secret + [0]
    ids = np.asarray(first + second, np.int32)
    trained = np.asarray([False] * 5 + [True] * (len(first) - 5) + [False] * 10 + [True] * (len(second) - 10))
    recs = SFTSequences(ids, trained, np.asarray([0, len(first), len(ids)]), SEQ, 0)
    packed = PackedSFT(recs, seed=0)
    assert len(packed) == 1                                 # both records share the one row
    on, off, ref = per_record(wl, packed, [0]), per_record(wl, packed, [0], mask=False), alone(wl, recs, packed, [0])
    for x, y in zip(on, ref):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
    # the record placed second in the row reads the first one's copy of the secret when unmasked
    assert (off[1] - ref[1]).abs().max() > 1e-3, "attending across the boundary should change the loss"
    torch.testing.assert_close(off[0], ref[0], atol=1e-5, rtol=0)  # the first is unaffected either way


# ----------------------------------------------------------------------------- the data path

def test_data_packing_builds_rows_from_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": "q" * (i % 7), "response": "r" * (3 + i % 11)}) + "\n"
                            for i in range(200)))
    cfg = DataConfig(kind="sft", path=str(path), seq_len=64, val_fraction=0.1, packing=True)
    data = build_data(cfg, 64, 5, None)
    plain = build_data(DataConfig(kind="sft", path=str(path), seq_len=64, val_fraction=0.1), 64, 5, None)
    assert len(data.train.records) == len(plain.train) == 180 and len(data.val.records) == 20
    assert len(data.train) * 3 <= len(plain.train)           # >= 3x fewer rows
    assert "packed into" in data.describe
    # the same labelled tokens, the same ids
    lab = sorted(int(t) for i in range(len(data.train)) for t in data.train[i]["labels"] if t != IGNORE_INDEX)
    ref = sorted(int(t) for i in range(len(plain.train)) for t in plain.train[i]["labels"] if t != IGNORE_INDEX)
    assert lab == ref
    assert data.train.real_tokens(list(range(len(data.train)))) == plain.train.real_tokens(list(range(180)))


# ----------------------------------------------------------------------------- bad input: one line each

def test_packing_with_a_kind_that_cannot_pack_is_refused():
    from zerotrain.train.errors import ConfigError
    with pytest.raises(ConfigError, match=r"^data.packing is not a key of data.kind tokens; its keys: "):
        DataConfig(kind="tokens", packing=True)


def test_an_attention_that_cannot_isolate_documents_is_refused(tmp_path):
    """A state-space model (no attention mask at all: its state carries one record into the
    next) and an attention implementation outside the packed-sequence path are refused."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM
    from zerotrain.models.errors import ConfigError
    from zerotrain.models.hf import check_packing
    torch.manual_seed(0)
    mamba = FalconMambaForCausalLM(FalconMambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1,
                                                     state_size=4))
    with pytest.raises(ConfigError, match=r"does not build its attention mask with transformers' masking_utils.*"
                                          r"set data.packing false$"):
        check_packing(mamba, "hf:mamba")
    llama = hf_llama_workload(tmp_path).model
    check_packing(llama, "hf:llama")  # sdpa: fine
    llama.config._attn_implementation_internal = "paged|sdpa"
    with pytest.raises(ConfigError, match=r"uses attention implementation 'paged\|sdpa', which cannot keep packed "
                                          r"records apart; set model.attn_implementation to one of eager, sdpa, "
                                          r".*, or set data.packing false$"):
        check_packing(llama, "hf:llama")


# ----------------------------------------------------------------------------- packed vs unpacked launches

@pytest.mark.multiproc
def test_packed_ddp_run_and_unpacked_zero3_run_give_the_same_step_losses(tmp_path):
    """8 records whose packed lengths pair up into exactly 4 full rows of 32: the packed run
    (DDP, 1 process, micro 1 x accum 4 rows) and the unpacked run (ZeRO-3, 2 processes, micro 2
    x accum 2 records) both train on all 8 records every step (one step per epoch), in different
    groupings. With the document mask and the token-count normalisation the step losses agree
    within 1e-5 at every step (fp32)."""
    from helpers import fp32, metrics, run_train
    lengths = [24, 20, 18, 16, 16, 14, 12, 8]   # best-fit-decreasing: (24, 8) (20, 12) (18, 14) (16, 16)
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}:", "response": chr(97 + i) * (n - 3)}) + "\n"
                            for i, n in enumerate(lengths)))
    packed = build_data(DataConfig(kind="sft", path=str(path), seq_len=32, val_fraction=0.0, packing=True), 32, 0)
    assert len(packed.train) == 4 and packed.train.row_tokens.tolist() == [32] * 4
    base = ["--model.name", "gpt-tiny", "--data.kind", "sft", "--data.path", str(path), "--data.seq_len", "32",
            "--data.val_fraction", "0", "--train.max_steps", "4", "--train.eval_every", "0", "--optim.lr", "3e-3",
            "--optim.schedule", "constant", "--optim.warmup_steps", "0", "--logging.progress", "false",
            "--train.sample_tokens", "0", "--logging.every_steps", "1", "--checkpoint.save_at_end", "false",
            "--checkpoint.export", "false"]
    runs = {"packed": ("python", 1, "ddp", 1, 4, ["--data.packing", "true"]),
            "unpacked": ("torchrun", 2, "zero3", 2, 2, [])}
    losses, pads = {}, {}
    for name, (launcher, nproc, stage, micro, accum, extra) in runs.items():
        run_dir = tmp_path / name
        run_train(launcher, nproc, [*base, *extra, "--ds-config", fp32(tmp_path, stage), "--train.micro_batch_size",
                                    str(micro), "--train.grad_accum_steps", str(accum), "--train.run_dir",
                                    str(run_dir)])
        rows = [r for r in metrics(run_dir) if "loss" in r]
        losses[name], pads[name] = [r["loss"] for r in rows], [r["data/pad_fraction"] for r in rows]
    assert len(losses["packed"]) == 4
    assert max(abs(a - b) for a, b in zip(losses["packed"], losses["unpacked"])) < 1e-5, losses
    assert losses["packed"][-1] < losses["packed"][0]   # it trains
    assert pads["packed"] == [0.0] * 4 and all(p > 0.4 for p in pads["unpacked"])  # 128 of 256 tokens real: half padding


def test_a_prepared_sft_set_packs_without_retokenising_and_trains(tmp_path, monkeypatch, clean_env):
    """`zerotrain prepare --sft` output packs into exactly the rows the JSONL packs into, without
    tokenising a record again, and a run with data.packing trains on it (in this process)."""
    from zerotrain.train.commands.prepare import main as prepare
    import zerotrain.train.data.sft as sft
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"q{i}:", "response": "r" * (3 + i % 11)}) + "\n" for i in range(64)))
    out = tmp_path / "r.bin"
    assert prepare(["--sft", str(src), "--out", str(out)]) == 0
    cfg = dict(kind="sft", seq_len=32, val_fraction=0.0, packing=True)
    ref = build_data(DataConfig(path=str(src), **cfg), 32, 5)

    def no_tokenising(*a, **k):
        raise AssertionError("a prepared set was tokenised again")
    monkeypatch.setattr(sft, "tokenize", no_tokenising)
    prepared = build_data(DataConfig(path=str(out), **cfg), 32, 5)
    assert "prepared instruction data" in prepared.describe and len(prepared.train) == len(ref.train) < 64 // 2
    for i in range(len(ref.train)):
        a, b = prepared.train[i], ref.train[i]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    from helpers import fp32, metrics
    from zerotrain.train.main import main
    run = tmp_path / "run"
    assert main(["--model.name", "gpt-tiny", "--data.kind", "sft", "--data.path", str(out), "--data.seq_len", "32",
                 "--data.packing", "true", "--data.val_fraction", "0", "--train.max_steps", "3",
                 "--train.micro_batch_size", "2", "--train.eval_every", "0", "--logging.progress", "false",
                 "--train.sample_tokens", "0", "--logging.every_steps", "1", "--checkpoint.save_at_end", "false",
                 "--checkpoint.export", "false", "--train.run_dir", str(run), "--ds-config", fp32(tmp_path, "ddp")]) == 0
    rows = [r for r in metrics(run) if "loss" in r]
    assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
    assert all(r["data/pad_fraction"] < 0.5 for r in rows)      # packed: unpacked rows here are mostly padding


@pytest.mark.multiproc
def test_hf_packed_runs_with_eager_and_sdpa_give_the_unpacked_step_losses(tmp_path, corpus):
    """A tiny Llama whose config.json asks for eager attention, trained on packed rows as it asks
    (eager) and with model.attn_implementation sdpa, and unpacked: the 8 records of the launch
    test above, all of them every step. Each packed run keeps the records apart with the attention
    it runs (recorded in the banner and the run's config.json), so its step losses are the
    unpacked run's (fp32, 1e-5). Every step is one epoch: all rows, all records."""
    from helpers import fp32, metrics, run_train
    d = save_tiny("llama", tmp_path / "llama", corpus["vocab"], tokenizer_dir=corpus["tok_dir"])
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "attn_implementation": "eager"}))
    lengths = [24, 20, 18, 16, 16, 14, 12, 8]   # best-fit-decreasing: (24, 8) (20, 12) (18, 14) (16, 16)
    src = tmp_path / "sft.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"q{i}:", "response": chr(97 + i) * (n - 3)}) + "\n"
                           for i, n in enumerate(lengths)))
    path = src
    rows = len(build_data(DataConfig(kind="sft", path=str(src), seq_len=32, val_fraction=0.0, packing=True,
                                     tokenizer=str(d)), 32, 0).train)
    assert rows < len(lengths)  # records share rows
    base = ["--model.name", f"hf:{d}", "--data.kind", "sft", "--data.path", str(path), "--data.seq_len", "32",
            "--data.val_fraction", "0", "--train.max_steps", "4", "--train.eval_every", "0", "--optim.lr", "3e-3",
            "--optim.schedule", "constant", "--optim.warmup_steps", "0", "--logging.progress", "false",
            "--train.sample_tokens", "0", "--logging.every_steps", "1", "--checkpoint.save_at_end", "false",
            "--checkpoint.export", "false", "--ds-config", fp32(tmp_path, "ddp")]
    packed = ["--data.packing", "true", "--train.micro_batch_size", "1", "--train.grad_accum_steps", str(rows)]
    runs = {"eager": [*packed], "sdpa": [*packed, "--model.attn_implementation", "sdpa"],
            "unpacked": ["--train.micro_batch_size", "2", "--train.grad_accum_steps", "4"]}
    losses = {}
    for name, extra in runs.items():
        run_dir = tmp_path / name
        proc = run_train("python", 1, [*base, *extra, "--train.run_dir", str(run_dir)], env={"HF_HUB_OFFLINE": "1"})
        losses[name] = [r["loss"] for r in metrics(run_dir) if "loss" in r]
        used = "sdpa" if name == "sdpa" else "eager"
        assert f"attention {used}" in proc.stdout, proc.stdout
        record = json.loads((run_dir / "config.json").read_text())["model"]
        assert record["resolved"]["attn_implementation"] == used, record
    assert len(losses["unpacked"]) == 4 and losses["unpacked"][-1] < losses["unpacked"][0], losses
    for name in ("eager", "sdpa"):
        assert max(abs(a - b) for a, b in zip(losses[name], losses["unpacked"])) < 1e-5, losses
