"""Token files: `zerotrain prepare`, the memory-mapped dataset and its checks, and the
deterministic distributed sampler over it (each sequence once per epoch across ranks)."""

from __future__ import annotations

import json
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from helpers import data_trace, fp32, make_tokenizer, metrics, random_text, run_train, write_texts
from zerotrain.models import build_workload, resolve
from zerotrain.train.config import DataConfig, ModelConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.sampler import GlobalBatchSampler
from zerotrain.train.errors import ConfigError, DataError
from zerotrain.train.commands.prepare import main as prepare


def tokens_data(path, seq_len=16, **kw):
    return build_data(DataConfig(kind="tokens", path=str(path), **kw), seq_len, 0)


# ----------------------------------------------------------------------------- prepare

def test_prepare_bytes_writes_documents_separated_and_a_sidecar(tmp_path, capsys):
    src = write_texts(tmp_path / "src", {"b.txt": "second doc", "a.md": "first doc", "sub/c.py": "x = 1",
                                         ".hidden/d.txt": "ignored", "e.bin": "not text"})
    out = tmp_path / "out" / "corpus.bin"
    out.with_suffix(".val.bin").parent.mkdir(parents=True)
    out.with_suffix(".val.bin").write_bytes(b"stale")  # an earlier corpus's split must not leak in
    assert prepare([str(src), "--out", str(out)]) == 0
    assert not out.with_suffix(".val.bin").exists()
    expected = b"first doc\nsecond doc\nx = 1\n"  # sorted paths, one newline between documents
    assert np.fromfile(out, dtype=np.uint16).tobytes() == np.frombuffer(expected, np.uint8).astype(np.uint16).tobytes()
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta == {**meta, "format": "zerotrain-tokens", "dtype": "uint16", "vocab_size": 256,
                    "num_tokens": len(expected), "max_token": max(expected), "tokenizer": "bytes", "files": 3}
    assert f"{len(expected)} uint16 tokens from 3 files" in capsys.readouterr().out


def test_prepare_with_local_hf_tokenizer_and_val_split(tmp_path):
    docs = {"one.txt": random_text(3000, 1), "two.txt": random_text(2000, 2)}
    src = write_texts(tmp_path / "src", docs)
    val = write_texts(tmp_path / "val", {"v.txt": random_text(1500, 3)})
    tok = make_tokenizer(tmp_path / "tok", list(docs.values()))
    out = tmp_path / "corpus.bin"
    assert prepare([str(src), "--val", str(val), "--out", str(out), "--tokenizer", str(tmp_path / "tok")]) == 0
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["vocab_size"] == len(tok) <= 384 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == str((tmp_path / "tok").resolve())
    ids = np.fromfile(out, dtype=np.uint16).astype(np.int64)
    eos = tok.eos_token_id
    # Each document tokenized on its own, followed by EOS.
    expected = []
    for name in sorted(docs):
        expected += tok(docs[name], add_special_tokens=False)["input_ids"] + [eos]
    assert ids.tolist() == expected
    assert meta["num_tokens"] == len(ids) and meta["max_token"] == int(ids.max()) < len(tok)
    val_meta = json.loads(out.with_suffix(".val.json").read_text())
    assert val_meta["num_tokens"] == len(np.fromfile(out.with_suffix(".val.bin"), dtype=np.uint16))
    data = tokens_data(out, seq_len=16)
    assert "corpus.val.bin" in data.describe and data.vocab_size == len(tok)
    assert len(data.val) == (val_meta["num_tokens"] - 1) // 16


@pytest.mark.parametrize("argv,message", [
    (["{tmp}/missing", "--out", "{tmp}/c.bin"], "missing does not exist"),
    (["{tmp}", "--out", "{tmp}/c.bin"], "no text files"),
    (["{tmp}", "--out", "{tmp}/c.tokens"], "use a .bin name"),
    (["{tmp}", "--out", "{tmp}/c.bin", "--tokenizer", "{tmp}/no_tok"], "not a directory"),
])
def test_prepare_errors_name_the_problem_and_exit_2(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        prepare([a.format(tmp=tmp_path) for a in argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


# ----------------------------------------------------------------------------- the dataset and its checks

@pytest.fixture
def byte_file(tmp_path) -> Path:
    src = write_texts(tmp_path / "src", {"a.txt": random_text(4000, 5)})
    out = tmp_path / "bytes.bin"
    prepare([str(src), "--out", str(out)])
    return out


def test_sequences_are_memory_mapped_windows_and_tail_is_validation(byte_file):
    raw = np.fromfile(byte_file, dtype=np.uint16)
    data = tokens_data(byte_file, seq_len=16, val_fraction=0.1)
    assert isinstance(data.train.tokens, np.memmap)  # never loaded whole
    n_val = int(len(raw) * 0.1)
    assert len(data.train) == (len(raw) - n_val - 1) // 16
    s = data.train[3]
    assert s["input_ids"].tolist() == raw[48:64].tolist() and s["labels"].tolist() == raw[49:65].tolist()
    assert data.val[0]["input_ids"].tolist() == raw[len(raw) - n_val:][:16].tolist()
    assert data.task == "lm" and data.vocab_size == 256 and data.items_per_sample == 16
    assert data.decode(s["input_ids"].tolist()) == bytes(raw[48:64].astype(np.uint8)).decode()


def test_token_file_errors_are_caught_before_training(tmp_path, byte_file):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(byte_file.read_bytes() + b"\x01")
    with pytest.raises(DataError, match="not a multiple of the uint16 token width"):
        tokens_data(odd, token_dtype="uint16")
    with pytest.raises(DataError, match="no sidecar.*data.token_dtype"):
        tokens_data(odd.rename(tmp_path / "plain.bin"))
    grown = tmp_path / "grown.bin"
    grown.write_bytes(byte_file.read_bytes() + b"\x01\x00")
    grown.with_suffix(".json").write_text(byte_file.with_suffix(".json").read_text())
    with pytest.raises(DataError, match="changed after `zerotrain prepare`"):
        tokens_data(grown)
    with pytest.raises(DataError, match="contradicts"):
        tokens_data(byte_file, token_dtype="uint32")
    with pytest.raises(DataError, match="does not exist"):
        tokens_data(tmp_path / "nope.bin")


def test_ids_beyond_the_model_vocabulary_are_refused(tmp_path):
    # A raw uint32 file from elsewhere (no sidecar): the largest id is found by a chunked scan.
    ids = np.arange(2000, dtype=np.uint32) % 250
    ids[1234] = 300
    path = tmp_path / "raw.bin"
    ids.tofile(path)
    data = tokens_data(path, token_dtype="uint32")
    assert data.extra["max_token"] == 300 and data.vocab_size == 301
    with pytest.raises(ConfigError, match="vocab_size 256 is smaller than the data's vocabulary 301"):
        build_workload(resolve(ModelConfig(name="gpt-tiny", vocab_size=256)), data)
    from zerotrain.train.data.tokens import max_token
    assert max_token(np.memmap(path, dtype=np.uint32, mode="r"), chunk=7) == 300


# ----------------------------------------------------------------------------- the sampler across ranks

def _rank_batches(dataset, sampler, world: int, rank: int) -> list[list[int]]:
    """What rank `rank` of `world` receives through Accelerate's real sharding (split_batches=True,
    as train/launch/distributed.py configures it), as sequence indices."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    index = {zlib.crc32(dataset[i]["input_ids"].numpy().tobytes()): i for i in range(len(dataset))}
    assert len(index) == len(dataset)  # every sequence distinguishable by content
    dl = prepare_data_loader(DataLoader(dataset, batch_sampler=sampler), num_processes=world, process_index=rank,
                             split_batches=True, even_batches=True, rng_types=[])
    return [[index[zlib.crc32(row.numpy().tobytes())] for row in b["input_ids"]] for b in dl]


def test_sampler_gives_each_sequence_once_per_epoch_across_ranks_and_resumes(tmp_path):
    src = write_texts(tmp_path / "src", {"a.txt": random_text(16 * 40 + 1, 9)})  # 40 sequences of 16
    prepare([str(src), "--out", str(tmp_path / "c.bin")])
    data = tokens_data(tmp_path / "c.bin", seq_len=16, val_fraction=0.0)
    n, world, micro, accum = len(data.train), 2, 2, 2
    assert n == 40  # 40 = 5 steps of a global batch of 8: nothing dropped
    sampler = GlobalBatchSampler(n, micro, world, accum, seed=7)
    epochs = []
    for epoch in range(2):
        sampler.set_position(epoch, 0)
        per_rank = [_rank_batches(data.train, sampler, world, r) for r in range(world)]
        assert all(len(b) == micro for r in per_rank for b in r)
        seen = [i for r in per_rank for b in r for i in b]
        assert Counter(seen) == Counter(range(n))  # each sequence exactly once, across both ranks
        assert not set(i for b in per_rank[0] for i in b) & set(i for b in per_rank[1] for i in b)
        epochs.append(per_rank)
    assert epochs[0] != epochs[1]  # reshuffled every epoch
    # Resume mid-epoch at a step boundary: exactly the rest of the uninterrupted epoch.
    sampler.set_position(1, 2 * sampler.global_batch)
    rest = [_rank_batches(data.train, sampler, world, r) for r in range(world)]
    assert rest == [r[2 * accum:] for r in epochs[1]]
    # The same global step sees the same samples with 1 process (world-size independent order).
    one = GlobalBatchSampler(n, micro * world, 1, accum, seed=7)
    one.set_position(1, 0)
    single = _rank_batches(data.train, one, 1, 0)
    assert [sorted(b) for b in single] == [sorted(a + b) for a, b in zip(*epochs[1])]


def test_sampler_drops_the_incomplete_tail_of_each_epoch(tmp_path):
    sampler = GlobalBatchSampler(43, 2, 2, 2, seed=1)  # 43 = 5 full steps of 8 + 3 dropped
    assert sampler.steps_per_epoch == 5
    used = [i for b in sampler for i in b]
    assert len(used) == 40 and len(set(used)) == 40
    assert set(used) | set(sampler.order(0)[40:].tolist()) == set(range(43))


# ----------------------------------------------------------------------------- prepare -> train on 2 processes

@pytest.mark.multiproc
def test_prepare_then_train_covers_every_sequence_once_per_epoch(tmp_path):
    """The real run: `zerotrain prepare`, then 2 epochs on 2 processes; the per-rank data trace
    (debug.trace_data) shows every training sequence exactly once per epoch, and loss falls."""
    seq, micro, world = 32, 4, 2
    src = write_texts(tmp_path / "src", {"a.txt": random_text(seq * 48 + 1, 11)})  # 48 sequences = 6 steps of 8
    val = write_texts(tmp_path / "val", {"v.txt": random_text(seq * 8 + 1, 12)})
    corpus = tmp_path / "corpus.bin"
    prepare([str(src), "--val", str(val), "--out", str(corpus)])
    run_dir = tmp_path / "run"
    run_train("torchrun", world, [
        "--ds-config", fp32(tmp_path, "zero2"), "--model.name", "gpt-tiny", "--data.kind", "tokens",
        "--data.path", str(corpus), "--data.seq_len", str(seq), "--train.micro_batch_size", str(micro),
        "--train.epochs", "2", "--train.eval_every", "0", "--debug.trace_data", "true", "--optim.lr", "3e-3",
        "--optim.warmup_steps", "2", "--logging.progress", "false", "--train.sample_tokens", "0",
        "--logging.every_steps", "1", "--checkpoint.export", "false", "--checkpoint.save_at_end", "false",
        "--train.run_dir", str(run_dir)])
    data = tokens_data(corpus, seq_len=seq)
    assert len(data.train) == 48
    crcs = Counter(zlib.crc32(data.train[i]["input_ids"].numpy().tobytes()) for i in range(48))
    assert len(crcs) == 48
    trace = [row for r in range(world) for row in data_trace(run_dir, r)]
    for epoch in (0, 1):
        seen = Counter(c for row in trace if row["epoch"] == epoch for c in row["crc"])
        assert seen == crcs, f"epoch {epoch}: sequences missing or repeated across ranks"
    by_rank = [{c for row in data_trace(run_dir, r) if row["epoch"] == 0 for c in row["crc"]} for r in range(world)]
    assert not by_rank[0] & by_rank[1] and len(by_rank[0]) == len(by_rank[1]) == 24
    rows = metrics(run_dir)
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert [r for r in rows if "val/loss" in r][-1]["val/samples"] == 8  # the sibling corpus.val.bin
