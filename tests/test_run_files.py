"""Every run file the project ships or shows loads with this schema (examples/*.yaml, the
```yaml blocks of README.md and docs/*.md that are run files), and the errors of a run file
written for another kind, another family or the layout before 0.2 are one line naming the key,
exit code 2."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys

import pytest
import yaml

from helpers import REPO
from zerotrain.train.config import RunConfig, load_config, upgrade_saved
from zerotrain.train.errors import ConfigError

SECTIONS = {f.name for f in dataclasses.fields(RunConfig)}
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
DOCS = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]


def _yaml_blocks():
    """(doc:line, text) of every ```yaml block whose top level is a mapping of run-config sections."""
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```ya?ml\n(.*?)^```", text, re.S | re.M):
            data = yaml.safe_load(m.group(1))
            if isinstance(data, dict) and set(data) & SECTIONS:
                out.append((f"{doc.relative_to(REPO)}:{text[:m.start()].count(chr(10)) + 1}", m.group(1)))
    return out


BLOCKS = _yaml_blocks()


def test_the_docs_show_run_files():
    assert len(EXAMPLES) >= 10 and BLOCKS, (len(EXAMPLES), [b for b, _ in BLOCKS])


def _keys(cls, prefix="") -> set[str]:
    """Every dotted key of the schema, in any variant of a tagged section."""
    import typing
    out = set()
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]
        sub = args[0] if len(args) == 1 else None
        if isinstance(sub, type) and hasattr(sub, "variants"):
            for v in sub.variants().values():
                out |= _keys(v, f"{prefix}{f.name}.")
        elif dataclasses.is_dataclass(sub):
            out |= {f"{prefix}{f.name}"} | _keys(sub, f"{prefix}{f.name}.")
        else:
            out.add(f"{prefix}{f.name}")
    return out


def test_every_dotted_option_in_the_docs_is_a_key():
    """`--train.progress false` in a doc would fail the run it shows (a key moved, or a typo)."""
    keys = _keys(RunConfig)
    flag = re.compile(r"--((?:%s)\.[a-z_][a-z0-9_.]*[a-z0-9_])" % "|".join(SECTIONS))
    bad = [f"{doc.relative_to(REPO)}: --{k}" for doc in [*DOCS, *EXAMPLES, REPO / "Makefile"]
           for k in flag.findall(doc.read_text()) if k not in keys]
    assert not bad, bad


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_loads(path):
    cfg = load_config(str(path))
    assert cfg.data.kind in ("text", "tokens", "sft", "preference", "imagefolder", "regression", "stream")


@pytest.mark.parametrize("where,text", BLOCKS, ids=[b for b, _ in BLOCKS])
def test_every_run_file_in_the_docs_loads(tmp_path, where, text):
    data = yaml.safe_load(text)
    assert set(data) <= SECTIONS, f"{where}: top-level keys {sorted(set(data) - SECTIONS)} are not sections"
    path = tmp_path / "run.yaml"
    path.write_text(text)
    load_config(str(path))


@pytest.mark.parametrize("text,message", [
    ("optim:\n  lrr: 1e-3\n", 'unknown key "optim.lrr" (did you mean "lr"?)'),
    ("data:\n  kind: tokens\n  path: t.bin\n  max_byte: 1000\n",
     'data.max_byte is not a key of data.kind tokens (its keys: kind, path, sources, seq_len, val_fraction, '
     'token_dtype, document_mask, eos_id, num_workers)'),
    ("data:\n  kind: tokens\n  path: t.bin\n  max_bytes: 1000\n",
     "data.max_bytes is not a key of data.kind tokens (its keys: kind, path, sources, seq_len, val_fraction, "
     "token_dtype, document_mask, eos_id, num_workers); data.kind text has it"),
    ("model:\n  name: resnet18\n  vocab_size: 100\n",
     "model.vocab_size is not a key of model family vision (its keys: name, num_classes, pretrained, "
     "freeze_backbone, channels_last, activation_checkpointing, init_from); model family gpt has it"),
    ("model:\n  name: hf:/models/llama\n  num_clases: 3\n",
     "model.num_clases is not a key of model family hf (its keys: name, trust_remote_code, activation_checkpointing, "
     "attn_implementation, router_aux_loss_coef, init_from, lora)"),
    ("train:\n  tf32: false\n", "train.tf32 moved to hardware.tf32 in zerotrain 0.2; rename it in "),
    ("train:\n  progress: false\n", "train.progress moved to logging.progress in zerotrain 0.2; rename it in "),
    ("train:\n  trace_data: true\n", "train.trace_data moved to debug.trace_data in zerotrain 0.2; rename it in "),
])
def test_a_key_of_another_kind_family_or_release_is_one_line(tmp_path, text, message):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert message in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,message", [
    ([("train.compile", "true")], "--train.compile moved to --hardware.compile in zerotrain 0.2; rename it on the "
                                  "command line"),
    ([("train.host_malloc", "compact")], "--train.host_malloc moved to --hardware.host_malloc"),
    ([("data.kind", "tokens"), ("data.max_bytes", "10")], "--data.max_bytes is not a key of data.kind tokens"),
    ([("data.max_bytes", "10"), ("data.kind", "tokens")], "--data.max_bytes is not a key of data.kind tokens"),
    ([("model.name", "linear"), ("model.lora.r", "4")], "--model.lora.r is not a key of model family linear"),
    ([("data.kind", "streams")], 'data.kind "streams" is not one of text, tokens, sft, preference, imagefolder, regression, '
                                 'stream, py (did you mean "stream"?)'),
])
def test_overrides_are_checked_against_the_variant(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_overrides_switch_kind_and_family(tmp_path):
    # The tag applies first, whatever its place: the other keys are the new variant's.
    cfg = load_config(None, [("data.path", "x.bin"), ("data.token_dtype", "uint16"), ("data.kind", "tokens"),
                             ("data.seq_len", "64"), ("model.lora.r", "16")])
    assert (cfg.data.kind, cfg.data.path, cfg.data.token_dtype, cfg.data.seq_len) == ("tokens", "x.bin", "uint16", 64)
    assert cfg.model.lora.r == 16 and cfg.model.family == "gpt"
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  kind: tokens\n  path: t.bin\nmodel:\n  name: gpt-tiny\n  n_layer: 2\n")
    cfg = load_config(str(path), [("data.kind", "stream"), ("data.text_field", "body")])
    assert (type(cfg.data).__name__, cfg.data.path, cfg.data.text_field) == ("StreamData", "t.bin", "body")
    cfg = load_config(None, [("model.num_classes", "3"), ("model.name", "resnet18")])
    assert (cfg.model.family, cfg.model.num_classes) == ("vision", 3)
    with pytest.raises(ConfigError, match="run.yaml: model.n_layer is not a key of model family vision"):
        load_config(str(path), [("model.name", "resnet18")])  # the run file's GPT key does not apply


def test_help_lists_each_variant_with_its_keys(capsys):
    from zerotrain.train.args import parse_train_args
    with pytest.raises(SystemExit):
        parse_train_args(["--help"])
    out = capsys.readouterr().out
    groups = dict(re.findall(r"^ (\w+ \([^)]*\)):.*\n((?:  .*\n?)*)", out, re.M))
    tokens = groups["data (data.kind tokens)"]
    assert "--data.token_dtype (None)" in tokens and "--data.max_bytes" not in tokens
    assert "--data.max_bytes (4000000)" in groups["data (data.kind text)"]
    vision = groups["model (model family vision)"]
    assert "--model.num_classes (None)" in vision and "--model.n_layer" not in vision and "--model.lora" not in vision
    hf = groups["model (model family hf)"]
    assert "--model.trust_remote_code (False)" in hf and "--model.lora.r (8)" in hf
    assert "--model.kwargs ({})" in groups["model (model family py)"]
    for key in ("hardware.compile", "hardware.tf32", "hardware.host_malloc", "debug.trace_data", "logging.progress"):
        assert f"  --{key} (" in out
    assert "--train.tf32" not in out and "--train.progress" not in out


def test_the_training_program_refuses_an_old_key_before_building_anything(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  name: gpt-tiny\ntrain:\n  max_steps: 3\n  tf32: false\n")
    r = subprocess.run([sys.executable, "train/main.py", "--config", str(path), "--train.run_dir", str(tmp_path / "r")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [f"zerotrain: error: train.tf32 moved to hardware.tf32 in zerotrain 0.2; "
                                             f"rename it in {path}"]
    assert not (tmp_path / "r").exists()
    path.write_text("model:\n  name: resnet18\n  n_layer: 2\ndata:\n  kind: imagefolder\n  path: x\n")
    r = subprocess.run([sys.executable, "train/main.py", "--config", str(path), "--train.run_dir", str(tmp_path / "r")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "model.n_layer is not a key of model family vision" in r.stderr


def test_a_saved_config_of_the_old_layout_reads_as_the_new_one():
    new = RunConfig().to_dict()
    old = {**new, "train": {**new["train"], "compile": False, "tf32": False, "host_malloc": "compact",
                            "trace_data": True, "progress": False},
           "logging": {k: v for k, v in new["logging"].items() if k != "progress"}}
    del old["hardware"], old["debug"]
    up = upgrade_saved(old)
    assert up["hardware"] == {"compile": False, "tf32": False, "host_malloc": "compact"}
    assert up["debug"] == {"trace_data": True} and up["logging"]["progress"] is False
    assert up.keys() == new.keys() and up["train"] == new["train"]
    assert upgrade_saved(new) == new and upgrade_saved(None) is None
