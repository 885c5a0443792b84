"""Sharded token sets: `zerotrain prepare --out DIR` (parallel, resumable, HF dataset files)
and the shard reader behind data.kind tokens. All in-process: no launches."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import make_tokenizer, random_text, write_texts
from zerotrain.train.commands.prepare import main as prepare
from zerotrain.train.config import DataConfig
from zerotrain.train.data import build_data
from zerotrain.train.errors import DataError

DOCS = {f"d{i}.txt": random_text(3000 + 701 * i, i) for i in range(6)}


def data(path, seq_len=16, **kw):
    return build_data(DataConfig(kind="tokens", path=str(path), **kw), seq_len, 0)


def samples(ds):
    return [(ds[i]["input_ids"].tolist(), ds[i]["labels"].tolist()) for i in range(len(ds))]


def shard_bytes(d):
    m = json.loads((d / "manifest.json").read_text())
    return [(d / e["file"]).read_bytes() for e in m["shards"] + m.get("val", [])]


@pytest.fixture
def src(tmp_path):
    return write_texts(tmp_path / "src", DOCS)


def test_shards_concatenate_to_the_single_file_and_one_shard_gives_its_samples(src, tmp_path):
    one, d, big = tmp_path / "one.bin", tmp_path / "d", tmp_path / "big"
    assert prepare([str(src), "--out", str(one)]) == 0
    assert prepare([str(src), "--out", str(d), "--shard-tokens", "5000", "--workers", "1"]) == 0
    m = json.loads((d / "manifest.json").read_text())
    flat = one.read_bytes()
    assert b"".join(shard_bytes(d)) == flat
    assert [e["num_tokens"] for e in m["shards"]] == [5000] * (len(flat) // 2 // 5000) + [len(flat) // 2 % 5000]
    assert m["num_tokens"] == len(flat) // 2 and m["files"] == 6 and m["dtype"] == "uint16"
    assert m["vocab_size"] == 256 and m["tokenizer"] == "bytes" and m["checksum"] == "sha256"
    # One shard holding everything: exactly the single file's samples, train and val.
    assert prepare([str(src), "--out", str(big), "--workers", "1"]) == 0
    for kw in ({"val_fraction": 0.1}, {"val_fraction": 0.0}):
        a, b = data(one, **kw), data(big / "manifest.json", **kw)
        assert samples(a.train) == samples(b.train) and len(a.train) > 100
        assert (a.val is None) == (b.val is None) and (a.val is None or samples(a.val) == samples(b.val))
        assert a.vocab_size == b.vocab_size and a.extra["max_token"] == b.extra["max_token"]


def test_many_shards_windows_stay_inside_a_shard_and_tails_are_counted(src, tmp_path):
    d = tmp_path / "d"
    assert prepare([str(src), "--out", str(d), "--shard-tokens", "1000", "--workers", "1"]) == 0
    flat = np.frombuffer(b"".join(shard_bytes(d)), np.uint16).astype(np.int64)
    bundle = data(d, seq_len=16, val_fraction=0.0)
    expected, dropped = [], 0
    for s in range(0, len(flat), 1000):  # each shard on its own, as TokenSequences would cut it
        shard = flat[s:s + 1000]
        n = (len(shard) - 1) // 16
        expected += [(shard[i * 16:i * 16 + 16].tolist(), shard[i * 16 + 1:i * 16 + 17].tolist()) for i in range(n)]
        dropped += len(shard) - (n * 16 + 1 if n else 0)
    assert samples(bundle.train) == expected
    assert bundle.extra["dropped_tokens"] == dropped and f"{dropped} tokens of shard tails" in bundle.describe
    # Lazy opening: nothing opened at open, only the shard a sample lives in when it is read.
    fresh = data(d, seq_len=16, val_fraction=0.0).train
    assert fresh.corpus._fds == {}
    fresh[len(fresh) - 1]
    assert list(fresh.corpus._fds) == [len(fresh.corpus.shards) - 1]


def test_one_and_two_workers_write_identical_shards_and_val(src, tmp_path):
    val = write_texts(tmp_path / "val", {"v.txt": random_text(4000, 9)})
    outs = []
    for w in (1, 2):
        d = tmp_path / f"w{w}"
        assert prepare([str(src), "--val", str(val), "--out", str(d), "--shard-tokens", "3000", "--workers", str(w)]) == 0
        outs.append(d)
    assert shard_bytes(outs[0]) == shard_bytes(outs[1])
    m = json.loads((outs[0] / "manifest.json").read_text())
    assert [e["file"] for e in m["val"]] == ["val_00000.bin", "val_00001.bin"]
    b = data(outs[1], val_fraction=0.3)  # val shards win over val_fraction, as a .val.bin file does
    assert len(b.val) == sum((e["num_tokens"] - 1) // 16 for e in m["val"]) and "2 val shards" in b.describe
    assert len(b.train) == sum((e["num_tokens"] - 1) // 16 for e in m["shards"])


def test_interrupted_prepare_resumes_to_identical_shards(src, tmp_path, monkeypatch):
    ref = tmp_path / "ref"
    assert prepare([str(src), "--out", str(ref), "--shard-tokens", "2500", "--workers", "1"]) == 0
    d = tmp_path / "d"
    args = [str(src), "--out", str(d), "--shard-tokens", "2500", "--workers", "2"]
    monkeypatch.setenv("ZEROTRAIN_PREPARE_STOP_AFTER", "3")
    assert prepare(args) == 3
    assert sorted(p.name for p in d.iterdir()) == ["progress.json", "shard_00000.bin", "shard_00001.bin",
                                                  "shard_00002.bin"]
    (d / "shard_00001.bin.tmp").write_bytes(b"half")  # a crash mid-shard leaves this behind
    assert prepare(args) == 3  # 3 more
    (d / "shard_00005.bin").unlink()  # lost after it was recorded: redone from shard 4's end
    monkeypatch.delenv("ZEROTRAIN_PREPARE_STOP_AFTER")
    assert prepare(args) == 0
    assert shard_bytes(d) == shard_bytes(ref)
    assert json.loads((d / "manifest.json").read_text()) == json.loads((ref / "manifest.json").read_text())
    assert sorted(p.name for p in d.iterdir()) == sorted(p.name for p in ref.iterdir())
    assert prepare(args) == 0  # complete: nothing to do, nothing rewritten


def test_resume_mid_file_with_a_bpe_tokenizer_matches(tmp_path, monkeypatch):
    docs = {"a.txt": random_text(9000, 1), "b.txt": random_text(7000, 2)}
    src = write_texts(tmp_path / "src", docs)
    make_tokenizer(tmp_path / "tok", list(docs.values()))
    base = [str(src), "--tokenizer", str(tmp_path / "tok"), "--shard-tokens", "700", "--workers", "1"]
    assert prepare(base + ["--out", str(tmp_path / "ref")]) == 0
    monkeypatch.setenv("ZEROTRAIN_PREPARE_STOP_AFTER", "2")
    while prepare(base + ["--out", str(tmp_path / "d")]) == 3:
        pass
    assert shard_bytes(tmp_path / "d") == shard_bytes(tmp_path / "ref")
    ids = np.frombuffer(b"".join(shard_bytes(tmp_path / "ref")), np.uint16)
    assert (tmp_path / "one.bin").exists() is False
    monkeypatch.delenv("ZEROTRAIN_PREPARE_STOP_AFTER")
    assert prepare([str(src), "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "one.bin")]) == 0
    assert ids.tobytes() == (tmp_path / "one.bin").read_bytes()


def test_corrupt_shards_are_named_in_one_line(src, tmp_path, capsys):
    d = tmp_path / "d"
    assert prepare([str(src), "--out", str(d), "--shard-tokens", "4000", "--workers", "1"]) == 0
    shard = d / "shard_00002.bin"
    raw = bytearray(shard.read_bytes())
    raw[10] ^= 1
    shard.write_bytes(bytes(raw))  # same size: training starts, --verify catches it
    data(d)
    with pytest.raises(SystemExit) as e:
        prepare(["--verify", str(d)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err == (f"zerotrain: error: {shard}: checksum mismatch (sha256 differs from "
                                         f"{d / 'manifest.json'}); re-run zerotrain prepare")
    shard.write_bytes(bytes(raw[:-2]))
    with pytest.raises(DataError, match=rf"^{shard}: 7998 bytes, the manifest says 8000 .*re-run zerotrain prepare$"):
        data(d)
    shard.unlink()
    with pytest.raises(DataError, match=rf"^{shard}: missing"):
        data(d)


def test_other_inputs_into_an_existing_set_are_refused(src, tmp_path, capsys):
    d = tmp_path / "d"
    assert prepare([str(src), "--out", str(d), "--workers", "1"]) == 0
    with pytest.raises(SystemExit) as e:
        prepare([str(src), "--out", str(d), "--shard-tokens", "100", "--workers", "1"])
    assert e.value.code == 2 and "already holds a prepared set (manifest.json) of other inputs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare([str(src), "--out", str(tmp_path / "x.bin"), "--shard-tokens", "100"])
    assert "--shard-tokens applies to a sharded set" in capsys.readouterr().err


def test_invalid_utf8_names_file_and_byte_for_a_tokenizer_but_not_for_bytes(tmp_path, capsys):
    src = tmp_path / "src"
    write_texts(src, {"a.txt": "fine text\n"})
    (src / "b.txt").write_bytes(b"ok line\n" * 2000 + b"bad \xff here\n")
    make_tokenizer(tmp_path / "tok", ["fine text ok line bad here"])
    with pytest.raises(SystemExit) as e:
        prepare([str(src), "--out", str(tmp_path / "d"), "--tokenizer", str(tmp_path / "tok"), "--workers", "2"])
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith(f"zerotrain: error: prepare: {src / 'b.txt'}: invalid UTF-8 at byte 16004 ")
    assert prepare([str(src), "--out", str(tmp_path / "bytes"), "--workers", "1"]) == 0
    assert b"\xff" in (tmp_path / "bytes" / "shard_00000.bin").read_bytes()


def test_local_parquet_and_jsonl_datasets(tmp_path, capsys):
    pd = pytest.importorskip("pandas")
    texts = ["first record", "second one", "third, é"]
    d = tmp_path / "ds"
    d.mkdir()
    pd.DataFrame({"text": texts[:2], "n": [1, 2]}).to_parquet(d / "a.parquet")
    (d / "b.jsonl").write_text(json.dumps({"text": texts[2], "other": 1}) + "\n")
    assert prepare([str(d), "--text-field", "text", "--out", str(tmp_path / "out"), "--workers", "2"]) == 0
    m = json.loads((tmp_path / "out" / "manifest.json").read_text())
    expected = b"".join(t.encode() + b"\n" for t in texts)
    assert np.frombuffer(b"".join(shard_bytes(tmp_path / "out")), np.uint16).tolist() == list(expected)
    assert m["files"] == 3 and "from 3 records" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        prepare([str(d), "--text-field", "body", "--out", str(tmp_path / "o2"), "--workers", "1"])
    assert f"{d / 'a.parquet'}: record 0 has no field 'body' (fields: n, text)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        prepare([str(d / "a.parquet"), "--out", str(tmp_path / "o3")])
    assert "pass --text-field NAME" in capsys.readouterr().err
