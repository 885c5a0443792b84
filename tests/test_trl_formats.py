"""TRL's record formats and `datasets` tables as data.path (issue 48, items 1-2).

What is promised: data.kind sft and preference read the eight formats TRL documents by their own
column names (language modeling text / messages, prompt-completion standard / conversational,
preference with an explicit or an implicit prompt, standard / conversational), found from the
columns and named in the banner; data.path may be a parquet or arrow file, a glob of them, or a
save_to_disk directory, and the same records give the same samples (so the same losses) as the
JSONL path; the implicit prompt is the shared prefix TRL's extract_prompt finds; columns that
match no format, and a bad row, are one line naming the file and the row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import REPO, make_tokenizer, metrics, random_text, run_main, run_train
from zerotrain.train.config import DataConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.preference import extract_prompt
from zerotrain.train.errors import DataError

os.environ["HF_HUB_OFFLINE"] = "1"

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def msg(role: str, content: str) -> dict:
    return {"role": role, "content": content}


# The eight formats, two records each (https://huggingface.co/docs/trl/dataset_formats).
SFT_SETS = {
    "text": [{"text": "The sky is blue."}, {"text": "Grass is green, mostly."}],
    "messages": [{"messages": [msg("user", "What color is the sky?"), msg("assistant", "It is blue.")]},
                 {"messages": [msg("system", "Be brief."), msg("user", "Grass?"), msg("assistant", "Green.")]}],
    "prompt-completion standard": [{"prompt": "The sky is", "completion": " blue."},
                                   {"prompt": "Grass is", "completion": " green."}],
    "prompt-completion conversational": [
        {"prompt": [msg("user", "What color is the sky?")], "completion": [msg("assistant", "It is blue.")]},
        {"prompt": [msg("user", "Hi"), msg("assistant", "Hello!"), msg("user", "Grass?")],
         "completion": [msg("assistant", "Green.")]}],
}
PREFERENCE_SETS = {
    "explicit standard": [{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
                          {"prompt": "Grass is", "chosen": " green.", "rejected": " purple."}],
    "explicit conversational": [
        {"prompt": [msg("user", "What color is the sky?")], "chosen": [msg("assistant", "It is blue.")],
         "rejected": [msg("assistant", "It is green.")]},
        {"prompt": [msg("user", "Grass?")], "chosen": [msg("assistant", "Green.")],
         "rejected": [msg("assistant", "Purple.")]}],
    "implicit standard": [{"chosen": "The sky is blue.", "rejected": "The sky is green."},
                          {"chosen": "Grass is green.", "rejected": "Grass is purple."}],
    "implicit conversational": [
        {"chosen": [msg("user", "What color is the sky?"), msg("assistant", "It is blue.")],
         "rejected": [msg("user", "What color is the sky?"), msg("assistant", "It is green.")]},
        {"chosen": [msg("user", "Grass?"), msg("assistant", "Green.")],
         "rejected": [msg("user", "Grass?"), msg("assistant", "Purple.")]}],
}
BANNER = {"text": "language modeling (text)", "messages": "language modeling (messages)",
          "prompt-completion standard": "prompt-completion (standard)",
          "prompt-completion conversational": "prompt-completion (conversational)",
          "explicit standard": "preference, explicit prompt (standard)",
          "explicit conversational": "preference, explicit prompt (conversational)",
          "implicit standard": "preference, implicit prompt (standard)",
          "implicit conversational": "preference, implicit prompt (conversational)"}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_parquet(path: Path, records: list) -> Path:
    import datasets
    datasets.Dataset.from_list(records).to_parquet(str(path))
    return path


def build(kind: str, path, seq_len: int = 128, tokenizer=None, **kw):
    return build_data(DataConfig(kind=kind, path=str(path), seq_len=seq_len, val_fraction=0.0, **kw), seq_len, 0,
                      tokenizer)


def samples(ds) -> list[dict]:
    return [ds[i] for i in range(len(ds))]


def same_samples(a, b):
    assert len(a) == len(b)
    for x, y in zip(samples(a), samples(b)):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
    """parquet is converted into `datasets`' cache: one per test, never the user's."""
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_datasets_cache"))
    import datasets.config
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets_cache")


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("trl_tok") / "tok"
    tok = make_tokenizer(d, [random_text(3000, s) for s in range(3)] +
                         ["user assistant system: What color is the sky? It is blue. Grass green purple Hello"],
                         vocab_size=320)
    tok.chat_template = CHATML
    tok.save_pretrained(str(d))
    return str(d)


# ----------------------------------------------------------------------------- the eight formats

@pytest.mark.parametrize("tok", ["bytes", "chat template"])
@pytest.mark.parametrize("name", sorted(SFT_SETS))
def test_each_sft_format_as_parquet_is_read_and_named_in_the_banner(name, tok, tmp_path, chat_tokenizer):
    path = write_parquet(tmp_path / "d.parquet", SFT_SETS[name])
    data = build("sft", path, tokenizer=chat_tokenizer if tok != "bytes" else None)
    assert len(data.train) == 2
    assert f"format {BANNER[name]}" in data.describe, data.describe
    for s in samples(data.train):  # something is trained in every record
        assert (s["labels"] != -100).any()


@pytest.mark.parametrize("tok", ["bytes", "chat template"])
@pytest.mark.parametrize("name", sorted(PREFERENCE_SETS))
def test_each_preference_format_as_parquet_is_read_and_named_in_the_banner(name, tok, tmp_path, chat_tokenizer):
    path = write_parquet(tmp_path / "d.parquet", PREFERENCE_SETS[name])
    data = build("preference", path, tokenizer=chat_tokenizer if tok != "bytes" else None)
    assert len(data.train) == 2
    assert f"format {BANNER[name]}" in data.describe, data.describe


def test_implicit_prompt_pairs_give_the_explicit_pairs_trl_extracts(tmp_path, chat_tokenizer):
    """The implicit sets above are the explicit ones with the prompt folded in: the samples match
    exactly (standard: the space before the responses goes with them, as TRL moves it)."""
    for tok in (None, chat_tokenizer):
        for flavour in ("standard", "conversational"):
            implicit = build("preference", write_parquet(tmp_path / f"i_{flavour}.parquet",
                                                         PREFERENCE_SETS[f"implicit {flavour}"]), tokenizer=tok)
            explicit = build("preference", write_jsonl(tmp_path / f"e_{flavour}.jsonl",
                                                       PREFERENCE_SETS[f"explicit {flavour}"]), tokenizer=tok)
            if flavour == "standard":  # the explicit standard set has other prompts: compare with its own
                recs = [dict(zip(("prompt", "chosen", "rejected"), extract_prompt(r["chosen"], r["rejected"], "x")))
                        for r in PREFERENCE_SETS["implicit standard"]]
                assert recs[0] == {"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}
                explicit = build("preference", write_jsonl(tmp_path / "e2.jsonl", recs), tokenizer=tok)
            same_samples(implicit.train, explicit.train)


def test_extract_prompt_follows_trl():
    # the common prefix, moved back over a trailing space
    assert extract_prompt("Q: a b", "Q: a c", "w") == ("Q: a", " b", " c")
    assert extract_prompt("Q:x", "Q:y", "w") == ("Q:", "x", "y")
    # one a prefix of the other: TRL's loop ends one element early
    assert extract_prompt("abc", "abcd", "w") == ("ab", "c", "cd")
    u, a, b = msg("user", "q"), msg("assistant", "a"), msg("assistant", "b")
    assert extract_prompt([u, a], [u, b], "w") == ([u], [a], [b])
    with pytest.raises(DataError, match=r"f\.parquet:row 3: \"chosen\" and \"rejected\" share no prefix"):
        extract_prompt("yes", "no", "f.parquet:row 3")


# ----------------------------------------------------------------------------- JSONL vs tables

SFT_MIXED = [{"messages": [msg("user", random_text(24, i)), msg("assistant", random_text(30 + i, i + 9))]}
             for i in range(12)]
PC = [{"prompt": random_text(30, i), "response": random_text(20 + i, i + 5)} for i in range(12)]
PAIRS = [{"prompt": random_text(25, i), "chosen": random_text(15, i + 1), "rejected": random_text(12, i + 2)}
         for i in range(12)]


@pytest.mark.parametrize("tok", ["bytes", "chat template"])
def test_the_same_records_as_parquet_arrow_or_save_to_disk_give_the_jsonl_samples(tok, tmp_path, chat_tokenizer):
    import datasets
    tokenizer = chat_tokenizer if tok != "bytes" else None
    for kind, records in (("sft", SFT_MIXED), ("sft", PC), ("preference", PAIRS)):
        ref = build(kind, write_jsonl(tmp_path / "r.jsonl", records), tokenizer=tokenizer)
        ds = datasets.Dataset.from_list(records)
        ds.to_parquet(str(tmp_path / "r.parquet"))
        ds.save_to_disk(str(tmp_path / "saved"))
        half = [datasets.Dataset.from_list(records[:5]), datasets.Dataset.from_list(records[5:])]
        for i, h in enumerate(half):
            h.to_parquet(str(tmp_path / f"part-{i}.parquet"))
        arrow = next((tmp_path / "saved").glob("*.arrow"))
        for path in ("r.parquet", "saved", str(arrow), "part-*.parquet"):
            got = build(kind, path if Path(path).is_absolute() else tmp_path / path, tokenizer=tokenizer)
            same_samples(got.train, ref.train)
        # TRL's "completion" is zerotrain's "response"
        if records is PC:
            pc = [{"prompt": r["prompt"], "completion": r["response"]} for r in PC]
            same_samples(build(kind, write_parquet(tmp_path / "pc.parquet", pc), tokenizer=tokenizer).train, ref.train)


def test_a_dataset_dict_trains_on_train_and_validates_on_validation(tmp_path):
    import datasets
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(PC[:9]),
                               "validation": datasets.Dataset.from_list(PC[9:])})
    dd.save_to_disk(str(tmp_path / "dd"))
    data = build_data(DataConfig(kind="sft", path=str(tmp_path / "dd"), seq_len=48), 48, 0, None)
    assert (len(data.train), len(data.val)) == (9, 3)
    assert "val: split 'validation'" in data.describe
    ref = build("sft", write_jsonl(tmp_path / "v.jsonl", PC[9:]), seq_len=48)
    same_samples(data.val, ref.train)


# ----------------------------------------------------------------------------- refusals

def test_columns_that_match_no_format_are_one_line_listing_them_and_the_formats(tmp_path):
    path = write_parquet(tmp_path / "odd.parquet", [{"question": "a", "answer": "b"}])
    with pytest.raises(DataError) as e:
        build("sft", path)
    text = str(e.value)
    assert "\n" not in text
    assert f"{path}: the columns answer, question match no record format of data.kind sft" in text
    for f in ("messages", "prompt + completion", "prompt + response", "text"):
        assert f in text
    pref = write_parquet(tmp_path / "pref.parquet", PREFERENCE_SETS["explicit standard"])
    with pytest.raises(DataError, match="a 'chosen' column is data.kind preference's"):
        build("sft", pref)
    with pytest.raises(DataError, match="prompt \\+ chosen \\+ rejected .*chosen \\+ rejected"):
        build("preference", path)


def test_a_bad_row_is_named_by_its_file_and_row(tmp_path):
    import datasets
    good = [{"prompt": "a", "completion": "b"}] * 3
    datasets.Dataset.from_list(good).to_parquet(str(tmp_path / "p-0.parquet"))
    datasets.Dataset.from_list(good[:1] + [{"prompt": "a", "completion": ""}]).to_parquet(str(tmp_path / "p-1.parquet"))
    with pytest.raises(DataError, match=rf'^{tmp_path}/p-1.parquet:row 1: empty "completion"'):
        build("sft", tmp_path / "p-*.parquet")
    long = write_parquet(tmp_path / "long.parquet", [{"prompt": "x" * 100, "completion": "y"}])
    with pytest.raises(DataError, match=rf"^{long}:row 0: the response is empty after truncation"):
        build("sft", long, seq_len=32)
    nul = write_parquet(tmp_path / "nul.parquet", [{"chosen": "same start a", "rejected": "same start b"},
                                                   {"chosen": "yes", "rejected": "no"}])
    with pytest.raises(DataError, match=rf"^{nul}:row 1: \"chosen\" and \"rejected\" share no prefix"):
        build("preference", nul)


def test_train_main_refuses_columns_matching_no_format_with_exit_2(tmp_path, capsys):
    path = write_parquet(tmp_path / "odd.parquet", [{"question": "a", "answer": "b"}])
    code, err = run_main(capsys, ["--model.name", "gpt-tiny", "--data.kind", "sft", "--data.path", str(path),
                                  "--data.seq_len", "32", "--train.run_dir", str(tmp_path / "run")])
    assert code == 2
    lines = [line for line in err.splitlines() if "match no record format" in line]
    assert len(lines) == 1 and "answer, question" in lines[0], err


# ----------------------------------------------------------------------------- launched runs

RUN = ["--model.name", "gpt-tiny", "--data.seq_len", "64", "--train.micro_batch_size", "4",
       "--train.max_steps", "3", "--train.eval_every", "0", "--logging.every_steps", "1", "--logging.progress",
       "false", "--checkpoint.save_at_end", "false", "--checkpoint.export", "false", "--train.sample_tokens", "0",
       "--data.val_fraction", "0", "--ds-config", "ds_configs/ddp.json", "--optim.warmup_steps", "0"]


def _losses(tmp_path: Path, name: str, args: list) -> list[float]:
    run_dir = tmp_path / name
    run_train("python", 1, [*RUN, *args, "--train.run_dir", str(run_dir)],
              env={"HF_DATASETS_CACHE": str(tmp_path / "hf_datasets_cache")})
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


@pytest.mark.multiproc
def test_sft_and_dpo_runs_on_parquet_have_the_jsonl_runs_losses_exactly(tmp_path):
    sft_records = SFT_MIXED + [{"messages": [msg("user", "q"), msg("assistant", random_text(25, 40 + i))]}
                               for i in range(4)]
    got = {}
    for fmt, write in (("jsonl", write_jsonl), ("parquet", write_parquet)):
        got[f"sft {fmt}"] = _losses(tmp_path, f"sft_{fmt}", ["--data.kind", "sft", "--data.path",
                                                            str(write(tmp_path / f"s.{fmt}", sft_records))])
        got[f"dpo {fmt}"] = _losses(tmp_path, f"dpo_{fmt}", ["--data.kind", "preference", "--data.path",
                                                            str(write(tmp_path / f"p.{fmt}", PAIRS + PAIRS[:4])),
                                                            "--train.objective", "dpo"])
    assert len(got["sft jsonl"]) == 3 and len(got["dpo jsonl"]) == 3
    assert got["sft parquet"] == got["sft jsonl"], got
    assert got["dpo parquet"] == got["dpo jsonl"], got


def test_data_kind_text_reads_the_text_column_of_a_table(tmp_path):
    texts = [random_text(700, s) for s in range(4)]
    path = write_parquet(tmp_path / "t.parquet", [{"text": t, "id": i} for i, t in enumerate(texts)])
    data = build_data(DataConfig(kind="text", path=str(path), seq_len=32, val_fraction=0.0), 32, 0, None)
    assert bytes(data.train.tokens.tolist()) == "\n".join(texts).encode()
    assert 'the "text" column of' in data.describe
    capped = build_data(DataConfig(kind="text", path=str(path), seq_len=32, val_fraction=0.0, max_bytes=1500), 32, 0,
                        None)
    assert bytes(capped.train.tokens.tolist()) == "\n".join(texts).encode()[:1500]


def test_data_split_picks_a_dataset_dicts_split_and_is_refused_where_there_are_none(tmp_path):
    import datasets
    datasets.DatasetDict({"train": datasets.Dataset.from_list(PC[:9]), "extra": datasets.Dataset.from_list(PC[9:])}) \
        .save_to_disk(str(tmp_path / "dd"))
    extra = build_data(DataConfig(kind="sft", path=str(tmp_path / "dd"), seq_len=48, split="extra"), 48, 0, None)
    assert (len(extra.train), extra.val) == (3, None)  # its 3 records (5% of 3 held out: none), no "validation"
    same_samples(extra.train, build("sft", write_jsonl(tmp_path / "x.jsonl", PC[9:]), seq_len=48).train)
    with pytest.raises(DataError, match=r'has no split "validation" \(its splits: train, extra\); set data.split'):
        build("sft", tmp_path / "dd", split="validation")
    pq = write_parquet(tmp_path / "one.parquet", PC)
    with pytest.raises(DataError, match="data.split test: data.path .*one.parquet is neither a Hub dataset id nor"):
        build("sft", pq, split="test")
    with pytest.raises(DataError, match="data.subset default: data.path .* is not a Hub dataset id"):
        build("preference", write_parquet(tmp_path / "p.parquet", PAIRS), subset="default")
    with pytest.raises(DataError, match="data.split test: data.path .*x.jsonl is a single file"):
        build("sft", tmp_path / "x.jsonl", split="test")


def test_a_precomputed_reference_needs_one_jsonl_file(tmp_path, capsys):
    """The reference file is keyed by JSONL lines: a table is refused in one line, by prepare and by the run."""
    from zerotrain.train.commands.prepare import main as prepare_main
    path = write_parquet(tmp_path / "p.parquet", PAIRS)
    args = ["--config", str(REPO / "examples" / "dpo.yaml"), "--data.path", str(path), "--train.dpo.reference", "precomputed",
            "--train.run_dir", str(tmp_path / "run")]
    with pytest.raises(SystemExit) as e:
        prepare_main(["--reference", *args])
    assert e.value.code == 2 and "is not one JSONL file" in capsys.readouterr().err
    code, err = run_main(capsys, args)
    assert code == 2 and "is not one JSONL file" in err and len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- prompt / response boundary

def test_prompt_and_response_are_tokenized_apart_where_joint_tokenization_differs(tmp_path):
    """zerotrain tokenizes a pair's prompt and each response apart and concatenates the ids
    (docs/workloads.md, "Tokens"); TRL's DPOTrainer 1.16 tokenizes the joined text. With a
    byte-level BPE a prompt ending in a space ("A: " + "7") is where the two differ: the joined
    text makes " 7" one pre-token, apart it is " " then "7". Pinned here: what zerotrain builds
    (prompt ids, then the response ids, then EOS; labels exactly the response and EOS) and that the
    joint tokenization is really different for this pair, as the docs state."""
    from zerotrain.models.losses import IGNORE_INDEX
    from zerotrain.train.data.sft import hf_encoder
    d = tmp_path / "tok"
    make_tokenizer(d, [random_text(3000, s) for s in range(2)] + ["A: 7 A: 8 Q: 7 " * 50], vocab_size=300)
    enc = hf_encoder(str(d), True)
    prompt, chosen, rejected = "A: ", "7", "78"
    assert enc.encode(prompt + chosen) != enc.encode(prompt) + enc.encode(chosen)  # the boundary differs jointly
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
    data = build_data(DataConfig(kind="preference", path=str(path), seq_len=32, val_fraction=0), 32, 0, str(d))
    for seqs, resp in ((data.train.chosen, chosen), (data.train.rejected, rejected)):
        rec = seqs.record(0)
        ids = enc.bos + enc.encode(prompt) + enc.encode(resp) + [enc.eos]   # apart, then concatenated
        assert rec["input_ids"].tolist() == ids[:-1]
        labels = rec["labels"][rec["labels"] != IGNORE_INDEX].tolist()
        assert labels == enc.encode(resp) + [enc.eos]
        joint = enc.bos + enc.encode(prompt + resp) + [enc.eos]
        assert joint != ids  # what TRL's joint tokenization would give instead
    doc = (REPO / "docs" / "workloads.md").read_text()
    assert "tokenized apart" in doc and '"A: " + "7"' in doc
