"""Streaming tokenization (data.kind stream): local parquet / arrow / jsonl files tokenized while
training by a worker pool. The windows are exactly the documents tokenized and concatenated
(as train/data/stream.py defines the order), whatever the number of workers; the global batches
are the same for any world size and accumulation; a resume (three in a row) continues exactly
from the cursor saved with the data position, re-reading one chunk instead of the stream; bad
input fails in one line naming the file. The launch test trains from a jsonl file on 2
processes and resumes its checkpoint on 1 process with another accumulation."""

from __future__ import annotations

import itertools
import json
import math
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers import data_trace, fp32, make_tokenizer, metrics, random_text, run_train
from zerotrain.train.config import DataConfig, load_config
from zerotrain.train.data import build_data
from zerotrain.train.data.stream import StreamCorpus, StreamSampler, StreamWindows
from zerotrain.train.errors import ConfigError, DataError

T = 16


def documents(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    text = random_text(40 * n, seed)
    cuts = np.sort(rng.choice(len(text), n - 1, replace=False))
    return [d.strip() or "x" for d in np.split(np.frombuffer(text.encode(), np.uint8), cuts) for d in [bytes(d).decode()]]


def write_corpus(d: Path, docs: list[str]) -> Path:
    """Three files of one corpus: a.jsonl, b.parquet (2 row groups), c/d.arrow (`datasets`' IPC stream)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    d.mkdir(parents=True, exist_ok=True)
    k = len(docs) // 3
    with open(d / "a.jsonl", "w") as f:
        for i, t in enumerate(docs[:k]):
            f.write(json.dumps({"id": i, "text": t}) + ("\n\n" if i == 3 else "\n"))  # a blank line is skipped
    pq.write_table(pa.table({"text": docs[k:2 * k], "n": list(range(k))}), d / "b.parquet", row_group_size=k // 2 + 1)
    (d / "c").mkdir(exist_ok=True)
    table = pa.table({"text": docs[2 * k:]})
    with pa.OSFile(str(d / "c" / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return d


def file_docs(d: Path) -> dict[str, list[tuple[int, str]]]:
    """Every file's (record id, text), read independently of the code under test."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    out, off = {"a.jsonl": []}, 0
    for line in (d / "a.jsonl").read_bytes().split(b"\n"):
        if line.strip():
            out["a.jsonl"].append((off, json.loads(line)["text"]))
        off += len(line) + 1
    out["b.parquet"] = list(enumerate(pq.read_table(d / "b.parquet")["text"].to_pylist()))
    out["c/d.arrow"] = list(enumerate(pa.ipc.open_stream(pa.memory_map(str(d / "c" / "d.arrow"))).read_all()
                                      ["text"].to_pylist()))
    return out


def reference(d: Path, encode, sep: list[int], seed: int, passes: int, val_fraction: float) -> np.ndarray:
    """The stream as the design defines it: pass p visits the files (sorted) in the permutation
    rng([seed, p]), each file's training documents in order, each tokenized + the separator."""
    docs = file_docs(d)
    names = sorted(docs)
    toks = []
    for p in range(passes):
        for i in np.random.default_rng([seed, p]).permutation(len(names)):
            for r, text in docs[names[i]]:
                held = zlib.crc32(f"{names[i]}\0{r}".encode()) < val_fraction * (1 << 32)
                if not held:
                    toks += list(encode(text)) + sep
    return np.asarray(toks, dtype=np.int64)


def stream(d, seq=T, workers=0, group=1, seed=0, val_fraction=0.0, tokenizer=None, rows=7, nbytes=300):
    corpus = StreamCorpus(str(d), "text", seed, chunk_rows=rows, chunk_bytes=nbytes)
    return StreamWindows(corpus, seq, tokenizer, workers, group, val_fraction)


def windows(ds, n: int) -> np.ndarray:
    return np.stack([np.concatenate([ds[w]["input_ids"].numpy(), ds[w]["labels"].numpy()[-1:]]) for w in range(n)])


# ----------------------------------------------------------------------------- what is trained on

def test_windows_are_the_documents_tokenized_and_concatenated_across_files_chunks_and_passes(tmp_path):
    d = write_corpus(tmp_path / "corpus", documents(120, seed=1))
    ref = reference(d, lambda t: t.encode(), [10], seed=0, passes=3, val_fraction=0.2)
    ds = stream(d, val_fraction=0.2)
    assert ds.corpus.per_pass > 10  # many chunks: jsonl byte ranges, parquet row slices over 2 row groups, arrow
    n = (len(ref) - 1) // T
    got = windows(ds, n)
    assert np.array_equal(got[:, :-1].reshape(-1), ref[:n * T])            # every token, in order
    assert np.array_equal(got[:-1, -1], got[1:, 0])                          # label of a window's end = next start
    pass_tokens = len(reference(d, lambda t: t.encode(), [10], seed=0, passes=1, val_fraction=0.2))
    assert n * T > 2 * pass_tokens  # read into the third pass, in a new file order
    # The held-out documents are the validation set, and never trained on.
    bundle = build_data(DataConfig(kind="stream", path=str(d), val_fraction=0.2), T, 0)
    held = [t for name, docs in file_docs(d).items() for r, t in docs
            if zlib.crc32(f"{name}\0{r}".encode()) < 0.2 * (1 << 32)]
    val_ref = np.frombuffer("".join(t + "\n" for t in held).encode(), np.uint8).astype(np.int64)
    assert len(bundle.val) == (len(val_ref) - 1) // T > 0
    assert bundle.val[1]["input_ids"].tolist() == val_ref[T:2 * T].tolist()
    assert bundle.vocab_size == 256 and "streamed 3 file(s)" in bundle.describe


def test_hf_tokenizer_and_two_workers_give_the_same_windows_as_in_process(tmp_path):
    docs = documents(90, seed=2)
    d = write_corpus(tmp_path / "corpus", docs)
    tok = make_tokenizer(tmp_path / "tok", docs, vocab_size=300)
    ref = reference(d, lambda t: tok(t, add_special_tokens=False)["input_ids"], [tok.eos_token_id], seed=0,
                    passes=2, val_fraction=0.0)
    n = (len(ref) - 1) // T
    inproc, pool = stream(d, tokenizer=str(tmp_path / "tok")), stream(d, workers=2, tokenizer=str(tmp_path / "tok"))
    try:
        a, b = windows(inproc, n), windows(pool, n)
        assert pool._pool is not None and inproc._pool is None  # really two processes tokenizing
    finally:
        pool.close()
    assert np.array_equal(a[:, :-1].reshape(-1), ref[:n * T])
    assert np.array_equal(a, b)
    assert int(ref.max()) < 300 and (ref == tok.eos_token_id).sum() >= 2 * 90 - 1


# ----------------------------------------------------------------------------- order, world size, resume

def _global_batches(ds, sampler, world: int, accum: int, steps: int) -> list[list[int]]:
    """Each step's global batch through Accelerate's real sharding (split_batches=True), crc32 per
    sample (as tests/test_mixture.py), ranks' slices concatenated micro-batch by micro-batch."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    per_rank = []
    for rank in range(world):
        dl = prepare_data_loader(DataLoader(ds, batch_sampler=sampler), num_processes=world, process_index=rank,
                                 split_batches=True, even_batches=True, rng_types=[])
        per_rank.append([[zlib.crc32(row.numpy().tobytes()) for row in b["input_ids"]]
                         for b in itertools.islice(dl, steps * accum)])
    return [[c for m in range(accum) for r in range(world) for c in per_rank[r][s * accum + m]] for s in range(steps)]


def test_same_global_batches_for_any_world_size_and_accumulation(tmp_path):
    d = write_corpus(tmp_path / "corpus", documents(120, seed=3))
    seen = {}
    for name, (world, accum, micro) in {"world 1, accum 4": (1, 4, 1), "world 2, accum 1": (2, 1, 2),
                                        "world 4, accum 1": (4, 1, 1)}.items():
        sampler = StreamSampler(group=8, micro=micro, world=world, accum=accum, seed=5)
        assert sampler.global_batch == 4
        seen[name] = _global_batches(stream(d, group=8, seed=5), sampler, world, accum, steps=30)
    first, *others = seen.values()
    assert all(o == first for o in others)
    # The order is the stream shuffled inside groups of 8 windows: each group's windows exactly once.
    ds = stream(d, group=8, seed=5)
    crc = [zlib.crc32(ds[w]["input_ids"].numpy().tobytes()) for w in range(120)]
    flat = [c for step in first for c in step]
    assert flat != crc and [sorted(flat[g:g + 8]) for g in range(0, 120, 8)] == \
           [sorted(crc[g:g + 8]) for g in range(0, 120, 8)]


@pytest.mark.parametrize("rows,nbytes,chunks", [(5, 200, [2, 8, 15]), (1000, 1 << 20, [0, 0, 1])],
                         ids=["small chunks", "one chunk per file"])
def test_three_resumes_in_a_row_continue_exactly_from_the_saved_cursor(tmp_path, rows, nbytes, chunks):
    """Each resume is a new process: a new dataset and sampler, positioned by the checkpoint's
    (epoch, offset) and the cursor the previous one saved (TrainState.data_cursor, as the trainer
    does after every step); it re-reads at most two chunks, not the stream up to there."""
    d = write_corpus(tmp_path / "corpus", documents(150, seed=4))
    micro, accum, steps = 2, 3, 40
    g = micro * accum

    def run(start_step, cursor, stop):
        ds = stream(d, group=4, seed=9, rows=rows, nbytes=nbytes)
        ds.resume_from(cursor)
        sampler = StreamSampler(group=4, micro=micro, world=1, accum=accum, seed=9)
        sampler.set_position(0, start_step * g)
        it, out, first_read = iter(sampler), [], None
        for step in range(start_step, stop):
            out.append([ds[i]["input_ids"].tolist() for _ in range(accum) for i in next(it)])
            first_read = ds.chunks_tokenized if first_read is None else first_read
            cursor = ds.cursor_at((step + 1) * g)  # the trainer's DataPosition.advance (train/data/position.py)
        return out, cursor, first_read

    full, _, _ = run(0, None, steps)
    got, cursor, start, cursors = [], None, 0, []
    for stop in (9, 17, 26, steps):  # stopped and resumed three times, at steps 9, 17 and 26
        part, cursor_next, first_read = run(start, cursor, stop)
        if start:  # the resumed step read the cursor's chunk and at most one more
            assert cursor["window"] <= start * g < cursor["window"] + 4 and first_read <= 2, (cursor, first_read)
            cursors.append(cursor)
        got += part
        cursor, start = json.loads(json.dumps(cursor_next)), stop  # saved as JSON with the train state
    assert got == full
    assert [c["chunk"] for c in cursors] == chunks  # small chunks: 37 per pass, resumes deep in the first pass
    if rows == 5:  # without the cursor, resuming at step 26 means reading the stream from its start
        ds = stream(d, group=4, seed=9, rows=rows, nbytes=nbytes)
        ds[26 * g]
        assert ds.chunks_tokenized == 16


def test_a_cursor_from_other_files_is_refused(tmp_path):
    d = write_corpus(tmp_path / "corpus", documents(60, seed=5))
    ds = stream(d, group=4)
    cursor = ds.cursor_at(8)
    with pytest.raises(DataError, match="does not fit these files"):
        stream(d, group=4, rows=3).resume_from(cursor)


# ----------------------------------------------------------------------------- bad input

def _fails(path, needle, **kw):
    with pytest.raises(DataError) as e:
        build_data(DataConfig(kind="stream", path=str(path), **kw), T, 0)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg, msg
    return msg


def test_bad_files_fail_in_one_line_naming_the_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "p.parquet")
    msg = _fails(tmp_path / "p.parquet", "has no field 'text' (fields: body)")
    assert str(tmp_path / "p.parquet") in msg and "set data.text_field" in msg
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "x.jsonl").write_text('{"body": "a"}\n')
    _fails(tmp_path / "j", f"{tmp_path / 'j' / 'x.jsonl'}: record at byte 0 has no field 'text' (fields: body)")
    (tmp_path / "j" / "x.jsonl").write_text('{"text": "a"}\n{"text": 3}\n')
    _fails(tmp_path / "j", "record at byte 14: field 'text' is int, not text")
    (tmp_path / "j" / "x.jsonl").write_text("not json\n")
    _fails(tmp_path / "j", f"{tmp_path / 'j' / 'x.jsonl'}: byte 0: not a JSON record")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    msg = _fails(tmp_path / "bad.parquet", f"{tmp_path / 'bad.parquet'}: cannot read it as parquet")
    _fails(tmp_path / "missing.jsonl", "does not exist")
    (tmp_path / "e").mkdir()
    (tmp_path / "e" / "notes.txt").write_text("x")
    _fails(tmp_path / "e", "no dataset files")
    _fails(tmp_path / "p.parquet", "has no field 'body2'", text_field="body2")
    (tmp_path / "j" / "x.jsonl").write_text('{"text": "abc"}\n' * 3)  # records at bytes 0, 16, 32: all held out
    assert all(zlib.crc32(f"x.jsonl\0{r}".encode()) < 0.9 * (1 << 32) for r in (0, 16, 32))
    with pytest.raises(DataError, match="no training text in a whole pass over its files"):
        build_data(DataConfig(kind="stream", path=str(tmp_path / "j"), val_fraction=0.9), T, 0).train[0]


def test_a_bad_record_deep_in_the_stream_is_named_by_a_pool_worker(tmp_path):
    d = tmp_path / "j"
    d.mkdir()
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(200)] + ['{"txt": 1}']
    (d / "x.jsonl").write_text("\n".join(lines) + "\n")
    ds = stream(d, workers=1, nbytes=256)
    try:
        with pytest.raises(DataError, match=r"x.jsonl: record at byte \d+ has no field 'text' \(fields: txt\)"):
            for w in range(1000):
                ds[w]
    finally:
        ds.close()



def _running(pid: int) -> bool:
    """By pid, not Process.is_alive(): the pool's manager thread may reap the worker first."""
    import psutil
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_close_ends_the_tokenizer_workers_at_once(tmp_path):
    """The trainer's close ends the pool before the interpreter's exit hooks run: left to them
    (a shutdown that does not wait), 1 finished run in 5-8 hung at exit joining a worker still
    waiting on its queue (CI, tests/test_stream.py's resume launch)."""
    ds = stream(write_corpus(tmp_path / "corpus", documents(60, seed=3)), workers=1)
    windows(ds, 4)
    pids = [w.pid for w in ds._pool._processes.values()]
    assert pids and all(_running(pid) for pid in pids)
    ds.close()
    assert not any(_running(pid) for pid in pids) and ds._pool is None
    ds.close()  # twice is harmless (close, then garbage collection or exit)

@pytest.mark.parametrize("overrides,needle", [
    ([("data.text_field", "body")], "--data.text_field is not a key of data.kind text (its keys: kind, path, "),
    ([("data.kind", "tokens"), ("data.shuffle_windows", "8")],
     "--data.shuffle_windows is not a key of data.kind tokens (its keys: "),
    ([("data.kind", "stream"), ("data.shuffle_windows", "0")], "data.shuffle_windows must be >= 1"),
    ([("data.kind", "stream"), ("data.text_field", "")], "data.text_field is empty"),
    ([("data.kind", "stream"), ("train.epochs", "2")], "train.epochs: a stream (data.kind stream) has no known length"),
    ([("data.kind", "stream"), ("data.sources", "[{path: a.jsonl, weight: 1}]")],
     "--data.sources is not a key of data.kind stream (its keys: "),
])
def test_bad_stream_configs_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_defaults_and_files_where_token_files_are_expected(tmp_path):
    cfg = load_config(None, [("data.kind", "stream"), ("data.path", "x.jsonl")]).data
    assert (cfg.text_field, cfg.shuffle_windows) == ("text", 1024)
    example = load_config(str(Path(__file__).parent.parent / "examples" / "stream.yaml"))
    assert (example.data.kind, example.data.text_field, example.train.epochs) == ("stream", "text", None)
    (tmp_path / "x.jsonl").write_text('{"text": "a"}\n')
    with pytest.raises(DataError, match="is a parquet/arrow/jsonl file, not tokens: set data.kind stream"):
        build_data(DataConfig(kind="tokens", path=str(tmp_path / "x.jsonl")), T, 0)
    sources = load_config(None, [("data.kind", "tokens"),
                                 ("data.sources", f"[{{path: '{tmp_path / 'x.jsonl'}', weight: 1}}]")]).data.sources
    with pytest.raises(DataError, match=r"data.sources\[0\] \(x.jsonl\): .* cannot take part in a mixture; "
                                        r"`zerotrain prepare"):
        build_data(DataConfig(kind="tokens", sources=sources), T, 0)


# ----------------------------------------------------------------------------- the real program

@pytest.mark.multiproc
def test_two_processes_train_from_jsonl_and_one_process_resumes_the_stream(tmp_path):
    """A: torchrun 2 processes, micro 2, accum 1, 6 steps from a jsonl file, checkpoint at step 3.
    B: python 1 process, micro 1, accum 4, resumed from A's step-3 checkpoint (its stream cursor)
    to step 6. Same global batches at steps 3-5; the losses are finite and fall."""
    d = tmp_path / "data"
    d.mkdir()
    text = random_text(120_000, seed=7)
    with open(d / "train.jsonl", "w") as f:
        for i, para in enumerate(text.split(".\n")):
            f.write(json.dumps({"text": para, "i": i}) + "\n")
    common = ["--ds-config", fp32(tmp_path, "ddp"), "--model.name", "gpt-tiny", "--data.kind", "stream",
              "--data.path", str(d / "train.jsonl"), "--data.seq_len", "32", "--data.shuffle_windows", "4",
              "--data.num_workers", "1", "--train.eval_every", "0", "--train.eval_batches", "1",
              "--debug.trace_data", "true", "--logging.progress", "false", "--train.sample_tokens", "0",
              "--logging.every_steps", "1", "--optim.warmup_steps", "1", "--optim.lr", "3e-3",
              "--checkpoint.export", "false", "--train.max_steps", "6"]
    a, b = tmp_path / "a", tmp_path / "b"
    run_train("torchrun", 2, [*common, "--train.micro_batch_size", "2", "--checkpoint.every_steps", "3",
                              "--checkpoint.save_at_end", "false", "--train.run_dir", str(a)])
    proc = run_train("python", 1, [*common, "--train.micro_batch_size", "1", "--train.grad_accum_steps", "4",
                                   "--checkpoint.save_at_end", "false", "--train.run_dir", str(b),
                                   "--resume", str(a / "checkpoints" / "step_00000003")])
    assert "step 3, epoch 0 (+12 samples)" in proc.stdout
    state = json.loads((a / "checkpoints" / "step_00000003" / "meta.json").read_text())["train_state"]
    # Step 3 starts at window 12, a shuffle group's start: 12 x 32 tokens into the file's one chunk.
    assert {k: state["data_cursor"][k] for k in ("window", "chunk", "token")} == {"window": 12, "chunk": 0,
                                                                                  "token": 384}

    def steps(run_dir, world, accum):
        rows = [data_trace(run_dir, r) for r in range(world)]
        return {rows[0][i]["step"]: [c for m in range(accum) for r in range(world) for c in rows[r][i + m]["crc"]]
                for i in range(0, len(rows[0]), accum)}
    steps_a, steps_b = steps(a, 2, 1), steps(b, 1, 4)
    assert sorted(steps_a) == list(range(6)) and sorted(steps_b) == [3, 4, 5]
    assert all(steps_b[s] == steps_a[s] for s in (3, 4, 5))
    losses = [r["loss"] for r in metrics(a) if "loss" in r]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert json.loads((a / "config.json").read_text())["resolved"]["hardware"]["stream_workers"] == 1
