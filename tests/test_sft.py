"""Instruction data (data.kind sft) and token-count normalisation (issue 14, items 1-2).

What is promised: only response tokens carry loss (prompts, template markup around user turns
and padding are ignored), chat templates are honoured turn by turn, bad records stop the run
with one line naming file:line (exit 2), and an optimizer step's loss is the mean over every
labelled token of the global batch, so the number of micro-batches, accumulation steps,
processes and the ZeRO stage do not change the trained weights.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from helpers import BAD_SFT_RECORDS, fp32, make_tokenizer, metrics, random_text, run_main, run_train, save_tiny
from zerotrain.models import build_workload, resolve
from zerotrain.models.losses import IGNORE_INDEX, cross_entropy
from zerotrain.train.config import DataConfig, ModelConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.sft import BYTE_EOS
from zerotrain.train.errors import DataError

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing here may touch the network

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def sft(path: Path, seq_len: int, tokenizer: str | None = None, **kw):
    return build_data(DataConfig(kind="sft", path=str(path), seq_len=seq_len, **kw), seq_len, 0, tokenizer)


def trained_labels(sample: dict) -> list[int]:
    return [int(t) for t in sample["labels"] if t != IGNORE_INDEX]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A small local BPE tokenizer (no chat template), as a Hugging Face directory."""
    d = tmp_path_factory.mktemp("sft_tok")
    make_tokenizer(d / "tok", [random_text(3000, s) for s in range(3)] + ["user assistant system: hello"],
                   vocab_size=320)
    return d / "tok"


# ----------------------------------------------------------------------------- records -> samples

def test_prompt_and_padding_take_no_loss_only_the_response_and_its_eos_do(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "Q: 2+2?", "response": " 4"},
                                              {"prompt": "ab", "response": "cdefghijklmnop"}])
    data = sft(path, 8, val_fraction=0.0)
    assert (data.task, data.vocab_size, data.masked_labels, len(data.train), data.val) == ("lm", 256, True, 2, None)
    s = data.train[0]
    ids = list(b"Q: 2+2? 4") + [BYTE_EOS]                     # 10 tokens, cut to seq_len + 1 = 9
    assert s["input_ids"].tolist() == ids[:8]
    # labels = next tokens, only where the next token belongs to the response (+ EOS)
    assert s["labels"].tolist() == [IGNORE_INDEX] * 6 + [ord(" "), ord("4")]
    short = data.train[1]                                      # 2 + 14 + EOS = 17 tokens: truncated too
    assert trained_labels(short) == list(b"cdefghi")
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "response": "yo"}])
    s = sft(path, 8, val_fraction=0.0).train[0]                # "hiyo" + EOS: 5 tokens, padded to 8
    assert s["input_ids"].tolist() == list(b"hiyo") + [BYTE_EOS] * 4
    assert s["labels"].tolist() == [IGNORE_INDEX, ord("y"), ord("o"), BYTE_EOS] + [IGNORE_INDEX] * 4
    # the byte-level GPT trains on it: the loss is the mean over the 3 labelled tokens
    wl = build_workload(resolve(ModelConfig(name="gpt-tiny")), sft(path, 8, val_fraction=0.0))
    batch = {k: v[None] for k, v in s.items()}
    logits = wl.logits(wl.model, batch)[0]
    ref = torch.nn.functional.cross_entropy(logits, s["labels"])  # ignore_index -100
    assert torch.allclose(wl.loss(wl.model, batch), ref, atol=1e-6)


def test_chat_template_trains_every_assistant_turn_and_nothing_else(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    tok.save_pretrained(str(tmp_path / "chat"))
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "alpha beta"},
            {"role": "assistant", "content": "gamma"}, {"role": "user", "content": "delta"},
            {"role": "assistant", "content": "zeta theta"}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": msgs}])
    data = sft(path, 64, str(tmp_path / "chat"), val_fraction=0.0)
    s = data.train[0]
    full = tok.apply_chat_template(msgs, tokenize=False)  # ends "<|im_end|>\n": the input lacks the last "\n"
    assert tok.decode(s["input_ids"].tolist()).startswith(full[:-1])
    # the trained tokens are exactly the two assistant turns with their end-of-turn markup
    trained = tok.decode(trained_labels(s))
    assert trained == "gamma<|im_end|>\nzeta theta<|im_end|>\n", trained
    # without the template (data.chat_template false): "role: content" turns, assistant content + EOS trained
    plain = sft(path, 64, str(tmp_path / "chat"), val_fraction=0.0, chat_template=False).train[0]
    assert tok.decode(trained_labels(plain)) == f"gamma{tok.eos_token}zeta theta{tok.eos_token}"
    assert "plain format" in sft(path, 64, str(tokenizer_dir), val_fraction=0.0).describe  # no template there


def test_validation_is_the_sibling_val_file_else_the_last_records(tmp_path):
    recs = [{"prompt": f"p{i}", "response": f"r{i}"} for i in range(10)]
    path = write_jsonl(tmp_path / "train.jsonl", recs)
    data = sft(path, 16, val_fraction=0.2)
    assert (len(data.train), len(data.val)) == (8, 2)
    assert trained_labels(data.val[1])[:2] == list(b"r9") and trained_labels(data.train[0])[:2] == list(b"r0")
    write_jsonl(tmp_path / "train.val.jsonl", recs[:3])
    data = sft(path, 16, val_fraction=0.2)
    assert (len(data.train), len(data.val)) == (10, 3) and "train.val.jsonl" in data.describe


def test_a_given_denominator_divides_the_summed_token_loss():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    targets = torch.tensor([1, IGNORE_INDEX, 3, 4, IGNORE_INDEX, 9])
    summed = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
    (g_ref,) = torch.autograd.grad(summed / 0.25, logits)
    loss = cross_entropy(logits, targets, denominator=torch.tensor(0.25))  # below 1: not clamped
    (g,) = torch.autograd.grad(loss, logits)
    torch.testing.assert_close(loss, summed.detach() / 0.25)
    torch.testing.assert_close(g, g_ref)
    with torch.no_grad():
        torch.testing.assert_close(cross_entropy(logits, targets, denominator=torch.tensor(3.0)), summed / 3.0)


# ----------------------------------------------------------------------------- normalisation, end to end

def _records(n: int, seed: int) -> list[dict]:
    """Prompts and responses of very different lengths: micro-batches differ in labelled tokens."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "zeta", "theta", "kappa", "sigma", "omega", "lambda"]
    say = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    return [{"prompt": say(rng.randint(1, 18)), "response": say(rng.choice([1, 2, 3, 8, 14]))} for _ in range(n)]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    out = {}
    for f in sorted((run_dir / "export").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.multiproc
def test_step_loss_and_weights_do_not_depend_on_accumulation_processes_or_stage(tmp_path, tokenizer_dir):
    """fp32, 3 steps of 8 variable-length masked records each: micro 8 x accum 1 (DDP, 1 process)
    is the reference; micro 1 x accum 8 (ZeRO-1, 1 process: DeepSpeed's own accumulation
    scaling) and 2 processes x micro 1 x accum 4 (DDP, ZeRO-0, ZeRO-2, ZeRO-3) give the same
    step losses and the same trained weights: DDP and every ZeRO stage. Averaging each
    micro-batch's mean (the old loss) does not: micro-batches hold 2 to 15 labelled tokens."""
    from transformers import AutoTokenizer
    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True))
    model = save_tiny("llama", tmp_path / "llama", vocab, tokenizer_dir=tokenizer_dir)
    path = write_jsonl(tmp_path / "sft.jsonl", _records(40, 0))
    base = ["--model.name", f"hf:{model}", "--data.kind", "sft", "--data.path", str(path), "--data.seq_len", "32",
            "--data.val_fraction", "0.1", "--train.max_steps", "3", "--train.eval_every", "0",
            "--optim.lr", "5e-4", "--optim.schedule", "constant", "--optim.warmup_steps", "0",
            "--logging.progress", "false", "--logging.every_steps", "1", "--checkpoint.save_at_end", "false",
            "--checkpoint.export", "true", "--checkpoint.export_dtype", "fp32"]
    runs = {"ddp 1x micro8 accum1": ("python", 1, "ddp", 8, 1),
            "zero1 1x micro1 accum8": ("python", 1, "zero1", 1, 8),
            "ddp 2x micro1 accum4": ("torchrun", 2, "ddp", 1, 4),
            "zero0 2x micro1 accum4": ("torchrun", 2, "zero0", 1, 4),
            "zero2 2x micro1 accum4": ("torchrun", 2, "zero2", 1, 4),
            "zero3 2x micro1 accum4": ("torchrun", 2, "zero3", 1, 4)}
    losses, weights, vals = {}, {}, {}
    for name, (launcher, nproc, stage, micro, accum) in runs.items():
        run_dir = tmp_path / name.replace(" ", "_")
        run_train(launcher, nproc, [*base, "--ds-config", fp32(tmp_path, stage), "--train.micro_batch_size",
                                    str(micro), "--train.grad_accum_steps", str(accum), "--train.run_dir",
                                    str(run_dir)], env={"HF_HUB_OFFLINE": "1"})
        rows = metrics(run_dir)
        losses[name] = [r["loss"] for r in rows if "loss" in r]
        vals[name] = [r["val/loss"] for r in rows if "val/loss" in r]
        weights[name] = _weights(run_dir)
    ref = "ddp 1x micro8 accum1"
    assert len(losses[ref]) == 3 and len(weights[ref]) > 0
    report = {}
    for name in runs:
        d_loss = max(abs(a - b) for a, b in zip(losses[name], losses[ref]))
        d_w = max(float((weights[name][k] - w).abs().max()) for k, w in weights[ref].items())
        report[name] = (d_loss, d_w)
        assert weights[name].keys() == weights[ref].keys()
    print("max |loss - ref|, max |weight - ref|:", report)
    for name, (d_loss, d_w) in report.items():
        assert d_loss <= 1e-6 and d_w <= 1e-6, (name, report, losses)
    # the validation loss (token-weighted) agrees too, and the weights really moved
    assert all(abs(v[-1] - vals[ref][-1]) <= 1e-5 for v in vals.values()), vals
    from safetensors.torch import load_file
    init = load_file(str(model / "model.safetensors"))
    assert max(float((weights[ref][k] - init[k]).abs().max()) for k in init) > 1e-4


# ----------------------------------------------------------------------------- prepared sets (prepare --sft)

def prepare_sft(argv: list) -> int:
    from zerotrain.train.commands.prepare import main as prepare
    return prepare(["--sft", *map(str, argv)])


@pytest.fixture(scope="module")
def chat_tokenizer_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """tokenizer_dir plus ChatML markup tokens and a ChatML chat template."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    out = tmp_path_factory.mktemp("sft_chat") / "chat"
    tok.save_pretrained(str(out))
    return out


def _mixed_records(n: int, seed: int) -> list[dict]:
    """Prompt/response and conversation records, some longer than the seq_len used (truncated)."""
    out = []
    for i, r in enumerate(_records(n, seed)):
        r["prompt"] = " ".join(r["prompt"].split()[:2])  # short prompts: truncation cuts responses, not all of them
        if i % 3 == 2:
            r = {"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": r["response"]},
                              {"role": "user", "content": "more"}, {"role": "assistant", "content": r["prompt"]}]}
        out.append(r)
    return out


def _same_samples(a, b):
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b) > 0
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (i, k)


@pytest.mark.parametrize("tok", ["bytes", "bpe plain", "bpe chat template"])
def test_prepared_set_gives_exactly_the_jsonl_samples(tok, tmp_path, tokenizer_dir, chat_tokenizer_dir):
    tokenizer = {"bytes": None, "bpe plain": tokenizer_dir, "bpe chat template": chat_tokenizer_dir}[tok]
    src = write_jsonl(tmp_path / "r.jsonl", _mixed_records(30, 1))
    out = tmp_path / "prep" / "r.bin"
    assert prepare_sft([src, "--out", out] + (["--tokenizer", tokenizer] if tokenizer else [])) == 0
    assert not list(out.parent.glob("*.tmp"))
    meta = json.loads(out.with_suffix(".json").read_text())
    assert (meta["records"], meta["chat_template"]) == (30, tok == "bpe chat template")
    seq_len = 32 if tok == "bytes" else 24  # short enough that many records are cut
    for val_fraction in (0.0, 0.2):
        kw = dict(val_fraction=val_fraction, tokenizer=str(tokenizer) if tokenizer else None)
        jsonl, prep = sft(src, seq_len, **kw), sft(out, seq_len, **kw)
        _same_samples(jsonl.train, prep.train)
        _same_samples(jsonl.val, prep.val)
        assert (prep.vocab_size, prep.extra["max_token"]) == (jsonl.vocab_size, jsonl.extra["max_token"])
        assert "prepared instruction data" in prep.describe
    assert any(int(jsonl.train.offsets[i + 1] - jsonl.train.offsets[i]) == seq_len + 1 for i in range(20))
    # the sibling validation file becomes <out>.val.bin and is picked up like <name>.val.jsonl
    write_jsonl(tmp_path / "r.val.jsonl", _mixed_records(5, 2))
    assert prepare_sft([src, "--out", out] + (["--tokenizer", tokenizer] if tokenizer else [])) == 0
    kw = dict(val_fraction=0.2, tokenizer=str(tokenizer) if tokenizer else None)
    jsonl, prep = sft(src, seq_len, **kw), sft(out, seq_len, **kw)
    assert len(prep.val) == 5 and "r.val.bin" in prep.describe
    _same_samples(jsonl.train, prep.train)
    _same_samples(jsonl.val, prep.val)


def test_prepared_set_made_differently_or_from_a_changed_source_is_refused(tmp_path, capsys, clean_env,
                                                                             tokenizer_dir, chat_tokenizer_dir):
    src = write_jsonl(tmp_path / "r.jsonl", _mixed_records(9, 3))
    out = tmp_path / "r.bin"
    assert prepare_sft([src, "--out", out, "--tokenizer", chat_tokenizer_dir]) == 0
    capsys.readouterr()
    cases = {  # what the run does differently -> what the one line says
        "another tokenizer": (dict(tokenizer=str(tokenizer_dir)), "was prepared with tokenizer"),
        "bytes": (dict(tokenizer=None), "was prepared with tokenizer"),
        "no template": (dict(tokenizer=str(chat_tokenizer_dir), chat_template=False),
                        "was prepared with the chat template, this run renders records without it"),
        "seq_len too short": (dict(tokenizer=str(chat_tokenizer_dir), seq_len=4),
                              f"{src.resolve()}:1: the response is empty after truncation to data.seq_len 4"),
    }
    for name, (kw, needle) in cases.items():
        with pytest.raises(DataError) as e:
            sft(out, kw.pop("seq_len", 32), val_fraction=0.0, **kw)
        assert needle in str(e.value), (name, str(e.value))
    # the same tokenizer copied elsewhere (e.g. into a model directory) is the same tokenizer
    import shutil
    shutil.copytree(chat_tokenizer_dir, tmp_path / "copy")
    assert len(sft(out, 32, tokenizer=str(tmp_path / "copy"), val_fraction=0.0).train) == 9
    # the source changed after prepare (same size, new content): stale, through the CLI (one line, exit 2)
    text = src.read_text()
    src.write_text(text.replace("alpha", "omega", 1) if "alpha" in text else text.replace("beta", "gamma", 1))
    code, err = run_main(capsys, ["--model.name", "gpt-tiny", "--data.kind", "sft", "--data.path", str(out),
                                  "--data.tokenizer", str(chat_tokenizer_dir), "--data.seq_len", "32",
                                  "--train.run_dir", str(tmp_path / "run")])
    assert code == 2 and "is stale: its source" in err and len(err.strip().splitlines()) == 1, err
    # a truncated ids file is caught by its size
    assert prepare_sft([src, "--out", out, "--tokenizer", chat_tokenizer_dir]) == 0
    out.write_bytes(out.read_bytes()[:-2])
    with pytest.raises(DataError, match="the set was changed after"):
        sft(out, 32, tokenizer=str(chat_tokenizer_dir), val_fraction=0.0)


@pytest.mark.parametrize("case", sorted(set(BAD_SFT_RECORDS) - {"empty after truncation"}))  # seq_len: training's
def test_prepare_names_a_bad_record_by_file_and_line_and_leaves_no_output(case, tmp_path, capsys):
    line, needle = BAD_SFT_RECORDS[case]
    src = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine", "response": "ok"}, line])
    out = tmp_path / "out" / "d.bin"
    with pytest.raises(SystemExit) as e:
        prepare_sft([src, "--out", out])
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    assert list(out.parent.iterdir()) == []  # not even a temporary file
