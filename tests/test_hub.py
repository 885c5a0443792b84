"""Hub model ids: model.name hf:<org>/<name>[@<revision>], data.tokenizer and model.init_from as
ids, resolved through huggingface_hub's cache (issue 48, "Hub model ids").

What is promised: an id trains like a local directory, under ZeRO-3 on 2 processes, with every
file downloaded exactly once per node (counted at a Hub served on 127.0.0.1 through HF_ENDPOINT,
which speaks the Hub's HTTP API to huggingface_hub's own client); the commit the revision resolved
to is in the banner and config.json; an id not in the cache while offline, a revision or a
repository that does not exist stop the run in one line naming the id, the revision (and the
cache), exit 2, before the model is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import FakeHub, fp32, make_tokenizer, metrics, random_text, run_train, save_tiny
from zerotrain.models import hub


def test_an_id_is_told_from_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.parse("Qwen/Qwen2.5-0.5B") == hub.HubId("Qwen/Qwen2.5-0.5B", None)
    assert hub.parse("org/tiny-llama@v1.0") == hub.HubId("org/tiny-llama", "v1.0")
    assert str(hub.parse("org/m@refs/pr/3")) == "org/m@refs/pr/3"
    for path in ("models/my-llama/", "./org/m", "/abs/org/m", "~/org/m", "runs/a/b", "single", "org/m@"):
        assert hub.parse(path) is None, path
    (tmp_path / "org" / "local").mkdir(parents=True)
    assert hub.parse("org/local") is None  # a directory that exists is a path, never an id


@pytest.fixture(scope="module")
def fake_hub(tmp_path_factory):
    """A Hub holding org/tiny-llama (a random tiny Llama with its BPE tokenizer) on main and tag v1."""
    d = tmp_path_factory.mktemp("hub")
    make_tokenizer(d / "tok", [random_text(3000, s) for s in range(3)], vocab_size=300)
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(str(d / "tok"), local_files_only=True))
    model = save_tiny("llama", d / "tiny-llama", vocab, tokenizer_dir=d / "tok")
    h = FakeHub()
    commit = h.add("org/tiny-llama", model, tags=("v1",))
    # a dataset as the Hub keeps TRL's: parquet files named by split under data/
    import pyarrow as pa
    import pyarrow.parquet as pq
    (d / "sft-data" / "data").mkdir(parents=True)
    for split, n, seed in (("train", 24, 0), ("test", 6, 100)):
        recs = [{"prompt": random_text(40, seed + i), "completion": random_text(30, seed + i + 50)} for i in range(n)]
        pq.write_table(pa.Table.from_pylist(recs), str(d / "sft-data" / "data" / f"{split}-00000-of-00001.parquet"))
    h.add("org/sft-data", d / "sft-data", repo_type="dataset")
    return h, h.serve(), commit, d


def _env(url: str, cache: Path, **extra) -> dict:
    return {"HF_ENDPOINT": url, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1", **extra}


ARGS = ["--data.kind", "sft", "--data.seq_len", "32", "--train.micro_batch_size", "2", "--train.max_steps", "2",
        "--train.eval_every", "0", "--logging.every_steps", "1", "--logging.progress", "false",
        "--checkpoint.save_at_end", "false", "--checkpoint.export", "false", "--train.sample_tokens", "0"]


@pytest.mark.multiproc
def test_a_hub_id_trains_under_zero3_on_2_processes_downloading_each_file_once(fake_hub, tmp_path):
    h, url, commit, d = fake_hub
    h.downloads.clear()
    cache, run_dir = tmp_path / "hf_cache", tmp_path / "run"
    p = run_train("torchrun", 2, [*ARGS, "--model.name", "hf:org/tiny-llama@v1", "--data.tokenizer",
                                  "org/tiny-llama@v1", "--data.path", "org/sft-data", "--ds-config",
                                  fp32(tmp_path, "zero3"),
                                  "--train.run_dir", str(run_dir)],
                  env=_env(url, cache, HF_DATASETS_CACHE=str(tmp_path / "ds_cache")))
    files = set(h.repos["org/tiny-llama"][commit])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    # one node: every file of the model and of the dataset came over the wire exactly once, for both ranks
    assert {name for (repo, name) in h.downloads if repo == "org/tiny-llama"} == files
    assert {name for (repo, name) in h.downloads if repo == "datasets/org/sft-data"} == \
        {"data/train-00000-of-00001.parquet", "data/test-00000-of-00001.parquet"}
    assert set(h.downloads.values()) == {1}, dict(h.downloads)
    snapshot = cache / "models--org--tiny-llama" / "snapshots" / commit
    assert sorted(f.name for f in snapshot.iterdir()) == sorted(files)
    assert (cache / "models--org--tiny-llama" / "refs" / "v1").read_text() == commit
    assert f"from the Hub org/tiny-llama@v1 = commit {commit}" in p.stdout
    assert "model built partitioned by deepspeed.zero.Init" in p.stdout
    record = json.loads((run_dir / "config.json").read_text())
    assert record["model"]["resolved"]["hub"] == {"id": "org/tiny-llama", "revision": "v1", "commit": commit}
    assert {"key": "data.tokenizer", "id": "org/tiny-llama", "revision": "v1", "commit": commit, "type": "model"} \
        in record["resolved"]["hub"]
    assert {"key", "id", "revision", "commit", "type"} <= set(next(e for e in record["resolved"]["hub"]
                                                                  if e["key"] == "data.path"))
    assert "instruction data org/sft-data (" in p.stdout and "val: split 'test'" in p.stdout  # the Hub's split names
    assert "format prompt-completion (standard)" in p.stdout
    assert [r["step"] for r in metrics(run_dir) if "loss" in r] == [1, 2]
    # a second run finds everything in the cache: nothing is downloaded again
    run_train("python", 1, [*ARGS, "--model.name", "hf:org/tiny-llama@v1", "--data.path", "org/sft-data",
                            "--ds-config", fp32(tmp_path, "ddp"), "--train.run_dir", str(tmp_path / "again")],
              env=_env(url, cache, HF_DATASETS_CACHE=str(tmp_path / "ds_cache")))
    assert set(h.downloads.values()) == {1}, dict(h.downloads)


@pytest.mark.multiproc
@pytest.mark.parametrize("case", ["offline, not cached", "no such revision", "no such repository", "no such split",
                                  "no such dataset"])
def test_an_id_that_cannot_be_had_is_one_line_naming_it_exit_2(case, fake_hub, tmp_path):
    _, url, _, _ = fake_hub
    cache = tmp_path / "hf_cache"
    data = ["--data.path", "x.parquet"]
    if case == "no such split":
        data = ["--data.path", "org/sft-data", "--data.split", "validation"]
    if case == "no such dataset":
        data = ["--data.path", "org/no-data@v2"]
    name, extra, says = {
        "offline, not cached": ("org/tiny-llama@v1", {"HF_HUB_OFFLINE": "1"},
                                f"model.name hf:org/tiny-llama@v1: not a local path, and not in the Hugging Face cache {cache} "
                                f"(revision v1); "
                                f"HF_HUB_OFFLINE is set"),
        "no such revision": ("org/tiny-llama@v9", {},
                             "model.name hf:org/tiny-llama@v9: the revision v9 does not exist in org/tiny-llama"),
        "no such repository": ("org/nothing", {}, "model.name hf:org/nothing@main: no local path org/nothing and no "
                                                  "model repository org/nothing on the Hub"),
        "no such split": ("org/tiny-llama", {}, 'data.path org/sft-data@main has no split "validation" (its splits: '
                                                "train, test); set data.split to one of them"),
        "no such dataset": ("org/tiny-llama", {}, "data.path org/no-data@v2: no local path org/no-data and no dataset "
                                                  "repository org/no-data on the Hub"),
    }[case]
    p = run_train("python", 1, [*ARGS, "--model.name", f"hf:{name}", *data, "--train.run_dir", str(tmp_path / "run")],
                  env=_env(url, cache, HF_DATASETS_CACHE=str(tmp_path / "ds_cache"), **extra), check=False)
    lines = [ln for ln in p.stderr.splitlines() if "error" in ln]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert says in lines[0], lines[0]
