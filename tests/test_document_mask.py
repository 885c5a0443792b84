"""Document-masked pre-training windows (data.document_mask, issue 27).

What is promised: a window of token data that spans several EOS-separated documents computes,
for each document, exactly what that document computes alone in a window of its own (per-token
losses within 1e-5, fp32), for the built-in GPT and a Hugging Face Llama; without the mask a
later document's losses differ. Every token source (a token file, a shard directory, a mixture,
a stream) gives the same fields, a pure function of the window. A missing or absent EOS id, a
kind that cannot mask and a model that cannot isolate documents are refused in one line each.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import save_tiny, write_shard_dir, write_token_file
from zerotrain.models import build_workload, resolve
from zerotrain.train.config import DataConfig, ModelConfig, SourceConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.document_mask import document_fields
from zerotrain.train.errors import ConfigError, DataError

os.environ["HF_HUB_OFFLINE"] = "1"

SEQ, EOS, VOCAB = 48, 1, 64


def corpus_tokens(n: int = 4000, seed: int = 0) -> np.ndarray:
    """Documents of 3..30 tokens (ids 2..VOCAB-1), each followed by EOS."""
    g, out = np.random.default_rng(seed), []
    while len(out) < n:
        out += g.integers(2, VOCAB, size=int(g.integers(3, 30))).tolist() + [EOS]
    return np.asarray(out[:n])


def token_file(path: Path, tokens, separator=(EOS,), tokenizer: str = "/tokenizers/tiny") -> Path:
    """A token file with the sidecar `zerotrain prepare --tokenizer` writes (separator recorded)."""
    write_token_file(path, tokens, tokenizer=tokenizer, vocab_size=VOCAB)
    if separator is not None:
        side = path.with_suffix(".json")
        side.write_text(json.dumps({**json.loads(side.read_text()), "separator": list(separator)}))
    return path


def masked(path, **kw):
    return build_data(DataConfig(kind="tokens", path=str(path), seq_len=SEQ, document_mask=True, **kw), SEQ, 0)


def test_fields_restart_after_each_eos():
    pos, doc = document_fields(torch.tensor([5, 6, EOS, 7, EOS, EOS, 8, 9]), EOS)
    assert pos.tolist() == [0, 1, 2, 0, 1, 0, 0, 1]     # an EOS ends its document; the next starts at 0
    assert doc.tolist() == [0, 0, 0, 1, 1, 2, 3, 3]
    pos, doc = document_fields(torch.tensor([4, 5, 6]), EOS)  # no EOS: one causal sequence
    assert pos.tolist() == [0, 1, 2] and doc.tolist() == [0, 0, 0]


# ----------------------------------------------------------------------------- exactness

def workloads(tmp_path: Path, family: str, data):
    torch.manual_seed(0)
    name = "gpt-tiny" if family == "gpt" else f"hf:{save_tiny('llama', tmp_path / 'llama', vocab=VOCAB)}"
    wl = build_workload(resolve(ModelConfig(name=name, **({"seq_len": 64} if family == "gpt" else {}))), data)
    wl.model.eval()
    return wl


def token_losses(wl, batch: dict) -> torch.Tensor:
    out = wl.logits(wl.model, batch).float()
    per = F.cross_entropy(out.reshape(-1, out.size(-1)), batch["labels"].reshape(-1), reduction="none")
    return per.view(batch["labels"].shape)


def documents(sample: dict) -> list[tuple[int, int]]:
    """(start, end) of each document of a window's inputs."""
    doc = sample["doc_ids"]
    cuts = [0] + (torch.nonzero(doc[1:] != doc[:-1]).flatten() + 1).tolist() + [len(doc)]
    return list(zip(cuts[:-1], cuts[1:]))


@pytest.mark.parametrize("family", ["gpt", "hf"])
def test_a_masked_window_computes_each_document_as_if_alone(tmp_path, family):
    data = masked(token_file(tmp_path / "c.bin", corpus_tokens()))
    wl = workloads(tmp_path, family, data)
    windows = [data.train[i] for i in range(4)]
    batch = {k: torch.stack([w[k] for w in windows]) for k in windows[0]}
    on = token_losses(wl, batch)
    off = token_losses(wl, {"input_ids": batch["input_ids"], "labels": batch["labels"]})
    worst_off = 0.0
    for b, w in enumerate(windows):
        spans = documents(w)
        assert len(spans) >= 3
        for s, e in spans:
            alone = token_losses(wl, {"input_ids": w["input_ids"][None, s:e], "labels": w["labels"][None, s:e]})[0]
            torch.testing.assert_close(on[b, s:e], alone, atol=1e-5, rtol=0)
            if s > 0:
                worst_off = max(worst_off, float((off[b, s:e] - alone).abs().max()))
    # The mask is what makes it exact: unmasked, a later document reads the ones before it.
    assert worst_off > 1e-3


def test_the_model_sees_the_document_mask_through_the_packing_check(tmp_path):
    """A model whose attention cannot isolate documents is refused naming data.document_mask."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM
    from zerotrain.models.errors import ConfigError as ModelConfigError
    from zerotrain.models.hf import check_packing
    data = masked(token_file(tmp_path / "c.bin", corpus_tokens()))
    assert data.extra["packed"] == "data.document_mask"
    mamba = FalconMambaForCausalLM(FalconMambaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                                     state_size=4))
    with pytest.raises(ModelConfigError, match=r"^data.document_mask: FalconMambaForCausalLM \(hf:m\) does not build "
                                               r"its attention mask .* set data.document_mask false$"):
        check_packing(mamba, "hf:m", data.extra["packed"])


# ----------------------------------------------------------------------------- every token source

def assert_fields(sample: dict, eos: int = EOS):
    pos, doc = document_fields(sample["input_ids"], eos)
    assert torch.equal(sample["position_ids"], pos) and torch.equal(sample["doc_ids"], doc)


def test_a_token_file_keeps_its_windows_and_order_and_adds_the_fields(tmp_path):
    path = token_file(tmp_path / "c.bin", corpus_tokens())
    on, off = masked(path), build_data(DataConfig(kind="tokens", path=str(path), seq_len=SEQ), SEQ, 0)
    assert len(on.train) == len(off.train) and len(on.val) == len(off.val)
    for split in ("train", "val"):
        for i in range(len(getattr(off, split))):
            a, b = getattr(on, split)[i], getattr(off, split)[i]
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])
            assert_fields(a)
    assert "document-masked at EOS id 1" in on.describe


def test_shards_mixtures_and_streams_are_document_masked(tmp_path):
    shards = write_shard_dir(tmp_path / "shards", corpus_tokens(seed=1), shard_tokens=1000, vocab_size=VOCAB)
    man = shards / "manifest.json"
    man.write_text(json.dumps({**json.loads(man.read_text()), "tokenizer": "/tokenizers/tiny", "separator": [EOS]}))
    one = token_file(tmp_path / "a.bin", corpus_tokens(seed=2))
    mix = build_data(DataConfig(kind="tokens", seq_len=SEQ, document_mask=True,
                                sources=[SourceConfig(path=str(shards), weight=1), SourceConfig(path=str(one), weight=2)]),
                     SEQ, 0)
    assert mix.extra["packed"] == "data.document_mask" and "document-masked at EOS id 1" in mix.describe
    for i in range(0, len(mix.train), 7):
        assert_fields(mix.train[i])
    assert_fields(masked(shards).train[3])
    # a stream (bytes: its separator is a newline, so data.eos_id names it; the texts have none inside)
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": "word " * (3 + i % 9)}) + "\n" for i in range(200)))
    stream = build_data(DataConfig(kind="stream", path=str(docs), seq_len=SEQ, document_mask=True, eos_id=10,
                                   num_workers=0), SEQ, 0)
    w = stream.train[2]
    assert_fields(w, 10) and len(documents(w)) >= 2
    assert stream.stream is not None and stream.extra["eos_id"] == 10


# ----------------------------------------------------------------------------- bad input: one line each

@pytest.mark.parametrize("kind", ["sft", "text", "regression"])
def test_document_mask_with_a_kind_that_cannot_mask_is_refused(kind):
    with pytest.raises(ConfigError, match=f"^data.document_mask is not a key of data.kind {kind}; its keys: kind, "):
        DataConfig(kind=kind, document_mask=True)


def test_eos_id_without_document_mask_is_refused():
    with pytest.raises(ConfigError, match=r"^data.eos_id is read only with data.document_mask true"):
        DataConfig(kind="tokens", eos_id=3)


def test_an_unknown_or_absent_eos_is_refused_naming_the_file_and_the_fix(tmp_path):
    toks = corpus_tokens()
    old = token_file(tmp_path / "old.bin", toks, separator=None)   # a sidecar from before prepare recorded it
    with pytest.raises(DataError, match=rf"^data.document_mask: {old} does not record its tokenizer's EOS id .*set "
                                        r"data.eos_id to the id that ends each document, or re-run `zerotrain prepare`$"):
        masked(old)
    assert masked(old, eos_id=EOS).extra["eos_id"] == EOS          # data.eos_id is the fix
    none = token_file(tmp_path / "noeos.bin", toks, separator=())  # a tokenizer without EOS: nothing separates
    with pytest.raises(DataError, match=r"which has no EOS token, so its documents are not separated"):
        masked(none)
    byte = token_file(tmp_path / "bytes.bin", toks, separator=(10,), tokenizer="bytes")
    with pytest.raises(DataError, match=r"is byte-level: its document separator is a newline, which also ends every "
                                        r"line; prepare the text with --tokenizer DIR"):
        masked(byte)
    with pytest.raises(DataError, match=rf"^data.document_mask: EOS id 99 never occurs in {old} \(its largest id is "
                                        rf"{toks.max()}\); set data.eos_id"):
        masked(old, eos_id=99)
    shifted = token_file(tmp_path / "shifted.bin", toks + 1, separator=(0,))  # ids 2..: 0 never written
    with pytest.raises(DataError, match=rf"^data.document_mask: EOS id 0 does not occur in the first 16,777,216 "
                                        rf"tokens of {shifted}; set data.eos_id"):
        masked(shifted)


def test_mixture_sources_must_end_documents_with_the_same_id(tmp_path):
    a = token_file(tmp_path / "a.bin", corpus_tokens(seed=1))
    b = token_file(tmp_path / "b.bin", corpus_tokens(seed=2) + 1, separator=(EOS + 1,))  # another tokenizer's EOS
    with pytest.raises(DataError, match=rf"^data.document_mask: data.sources {a} ends documents with EOS id 1 but "
                                        rf"{b} with 2"):
        build_data(DataConfig(kind="tokens", seq_len=SEQ, document_mask=True,
                              sources=[SourceConfig(path=str(a), weight=1), SourceConfig(path=str(b), weight=1)]),
                   SEQ, 0)


def test_prepare_records_the_separator_that_ends_each_document(tmp_path):
    from zerotrain.train.commands.prepare import write_tokens
    from zerotrain.train.data.prep_sources import ByteTokenizer
    (tmp_path / "a.txt").write_text("one\n")
    meta = write_tokens([tmp_path / "a.txt"], ByteTokenizer(), tmp_path / "out.bin")
    assert meta["separator"] == [10]
    assert json.loads((tmp_path / "out.json").read_text())["separator"] == [10]
