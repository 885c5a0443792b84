"""Streaming tokenization (data.kind stream): how fast does the worker pool tokenize, and does
the default GPT wait for it?

Generates a local corpus (not committed; --dir, default bench/results/tmp-stream_corpus/): this
Python's standard-library sources, one document per file, repeated (each copy with its index
appended, so no two documents are equal) to --mb MB of text, written as JSON lines and as
parquet (row groups of 1,000 rows). A byte-level BPE tokenizer (--vocab ids) is trained on the
first 4 MB with `tokenizers` and saved as a local Hugging Face tokenizer directory.

1. Throughput: for each format x tokenizer (bytes, BPE) x data.num_workers in --workers, one
   StreamWindows (train/data/stream/dataset.py) in this process reads windows of --seq-len in stream
   order for --seconds (after the first window: pool start-up and the first chunk excluded) and
   reports tokens/s: what one rank gets.
2. Data wait: trains the default GPT (examples/default.yaml, byte-level, zero2_fp32 on a CPU)
   on --nproc processes (torchrun, bench/data_scale.py's launcher) from the parquet corpus with
   each worker count for --steps steps and reports the median step time, data_wait_s and the
   data-wait share (intervals after the first), plus the run's tokens/s: with world size W each
   rank tokenizes W x that (every rank reads the whole stream), to compare with (1).

    python bench/stream_tokenize.py                     # the BENCHMARKS.md tables (~8 min here)
    python bench/stream_tokenize.py --no-throughput --train-tokenizer bpe --workers 0,1 --steps 150  # BPE runs
    python bench/stream_tokenize.py --mb 32 --steps 40 --workers 0,2 --no-train

Writes bench/results/stream_tokenize-<timestamp>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stages import REPO, machine  # noqa: E402

sys.path.insert(0, str(REPO))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=64, help="corpus size, MB of text")
    p.add_argument("--dir", default=str(REPO / "bench" / "results" / "tmp-stream_corpus"))
    p.add_argument("--workers", default="0,1,2", help="data.num_workers settings")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--seconds", type=float, default=8.0, help="reading time per throughput measurement")
    p.add_argument("--throughput", action=argparse.BooleanOptionalAction, default=True, help="the tokens/s table")
    p.add_argument("--train", action=argparse.BooleanOptionalAction, default=True, help="the data-wait runs")
    p.add_argument("--train-tokenizer", default="bytes", choices=["bytes", "bpe"],
                   help="the data-wait runs' tokenizer (bpe: the GPT takes the BPE vocabulary)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--config", default="examples/default.yaml")
    p.add_argument("--ds-config", default=None)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--out", default=str(REPO / "bench" / "results"))
    a = p.parse_args(argv)
    a.worker_settings = [int(w) for w in a.workers.split(",")]
    return a


def documents():
    from zerotrain.train.data.text import default_corpus_files
    for f in default_corpus_files():
        try:
            yield f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def generate(d: Path, mb: float, vocab: int) -> dict:
    """jsonl + parquet of the same documents, and a BPE tokenizer; reused when already there."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    meta_path = d / "meta.json"
    want = {"mb": mb, "vocab": vocab, "version": 1}
    if meta_path.is_file() and json.loads(meta_path.read_text()).get("want") == want:
        return json.loads(meta_path.read_text())
    d.mkdir(parents=True, exist_ok=True)
    base = list(documents())
    docs, size, copy = [], 0, 0
    while size < mb * 1e6:
        for t in base:
            t = f"{t}\n# copy {copy}\n"
            docs.append(t)
            size += len(t.encode())
            if size >= mb * 1e6:
                break
        copy += 1
    with open(d / "corpus.jsonl", "w") as f:
        for t in docs:
            f.write(json.dumps({"text": t}) + "\n")
    pq.write_table(pa.table({"text": docs}), d / "corpus.parquet", row_group_size=1000)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    sample, n = [], 0
    for t in docs:
        sample.append(t)
        n += len(t)
        if n > 4e6:
            break
    tok.train_from_iterator(sample, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(d / "bpe"))
    meta = {"want": want, "documents": len(docs), "bytes": size,
            "files": {p.name: p.stat().st_size for p in (d / "corpus.jsonl", d / "corpus.parquet")}}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def throughput(path: Path, tokenizer, workers: int, seq_len: int, seconds: float) -> dict:
    from zerotrain.train.data.stream import StreamCorpus, StreamWindows
    corpus = StreamCorpus(str(path), "text", seed=0)
    ds = StreamWindows(corpus, seq_len, tokenizer, workers, group=1024, val_fraction=0.0)
    ds[0]  # pool started and the first chunk tokenized: measure the steady state from here
    t0 = time.perf_counter()
    w = 1
    try:
        while time.perf_counter() - t0 < seconds:
            for _ in range(256):
                ds[w]
                w += 1
    finally:
        elapsed = time.perf_counter() - t0
        ds.close()
    w -= 1
    return {"windows": w, "tokens": w * seq_len, "seconds": round(elapsed, 2), "tokens_per_s": w * seq_len / elapsed,
            "chunks": ds.chunks_tokenized}


def train_run(a, path: Path, workers: int, tmp: Path) -> dict:
    from data_scale import launch
    tok = ["--data.tokenizer", str(Path(a.dir) / "bpe")] if a.train_tokenizer == "bpe" else []
    name = f"stream-{a.train_tokenizer}-w{workers}"
    r = launch(a, name, ["--data.kind", "stream", "--data.path", str(path), "--data.num_workers", str(workers),
                         "--data.val_fraction", "0.01", *tok], tmp)
    r["tokenizer"] = a.train_tokenizer
    resolved = json.loads((tmp / name / "config.json").read_text())["resolved"]
    r["data_workers"] = resolved["hardware"]["stream_workers"]
    return r


def markdown(meta: dict, tput: list[dict], runs: list[dict]) -> str:
    m = meta["machine"]
    lines = [f"Streaming tokenization, {m['cpu']} ({m['cpu_cores']} cores); corpus {meta['corpus']['bytes'] / 1e6:.0f} MB "
             f"of text ({meta['corpus']['documents']} documents); started {meta['started']}", "",
             f"    {meta['command']}", "",
             "| format | tokenizer | workers | tokens/s (one rank) | chunks read |", "|---|---|---|---|---|"]
    for r in tput:
        lines.append(f"| {r['format']} | {r['tokenizer']} | {r['workers']} | {r['tokens_per_s']:,.0f} | {r['chunks']} |")
    if runs:
        lines += ["", f"{meta['model']}, {meta['nproc']} processes, {meta['steps']} steps from corpus.parquet "
                      f"(medians over logging intervals 2..):", "",
                  "| tokenizer | workers/rank | median step_time_s | median data_wait_s | data wait share | worst interval | "
                  "tokens/s (run) |", "|---|---|---|---|---|---|---|"]
        for r in runs:
            lines.append(f"| {r['tokenizer']} | {r['data_workers']} | {r['median_step_time_s']:.3f} | {r['median_data_wait_s'] * 1e3:.2f} ms"
                         f" | {r['data_wait_share']:.2%} | {r['worst_interval_share']:.2%} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    a = parse(sys.argv[1:] if argv is None else argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    d = Path(a.dir)
    t0 = time.perf_counter()
    corpus = generate(d, a.mb, a.vocab)
    print(f"[stream] corpus in {d} ({time.perf_counter() - t0:.0f} s): {corpus}", flush=True)
    meta = {"command": shlex.join(["python", "bench/stream_tokenize.py", *(sys.argv[1:] if argv is None else argv)]),
            "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "corpus": corpus,
            "python_stdlib": sysconfig.get_paths()["stdlib"], "model": f"{a.config} (zero2_fp32 on CPU)",
            "nproc": a.nproc, "steps": a.steps}
    tput = []
    for fmt in ("corpus.jsonl", "corpus.parquet") if a.throughput else ():
        for name, spec in (("bytes", None), (f"BPE {a.vocab}", str(d / "bpe"))):
            for w in a.worker_settings:
                r = {"format": fmt.split(".")[1], "tokenizer": name, "workers": w,
                     **throughput(d / fmt, spec, w, a.seq_len, a.seconds)}
                tput.append(r)
                print(f"[stream] {r}", flush=True)
    runs = []
    if a.train:
        tmp = out / f"tmp-stream_tokenize-{stamp}"
        tmp.mkdir(parents=True, exist_ok=True)
        for w in a.worker_settings:
            r = train_run(a, d / "corpus.parquet", w, tmp)
            runs.append(r)
            print(f"[stream] train workers {w}: step {r['median_step_time_s']:.3f} s, data wait "
                  f"{r['data_wait_share']:.2%}", flush=True)
    md = markdown(meta, tput, runs)
    (out / f"stream_tokenize-{stamp}.json").write_text(json.dumps({"meta": meta, "throughput": tput, "runs": runs},
                                                                  indent=1) + "\n")
    (out / f"stream_tokenize-{stamp}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
