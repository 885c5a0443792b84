"""Your own model (issue 37): `model.name = "py:<module>:<factory>"` (models/user.py) and hf:
directories with their own modeling code (`model.trust_remote_code`, models/hf.py).

The factories live in tests/user_models/, imported from PYTHONPATH=tests as a user's package
would be. The launches train tests/user_models/banded_moe.py, a mixture of experts of the user's
own (an nn.ModuleList of 4 experts and a router, every expert run only on its tokens) on 2
processes, every parameter partitioned by ZeRO-3 (persistence threshold 0), on a token file
whose windows reach rank 0 only with ids of the low band and rank 1 only with the high band:
the model routes the bands to disjoint experts (0-1 and 2-3), so each rank never runs two of
the experts. The same run under DDP must give the same losses, and the export must load back
into the factory's module. A third launch trains a tiny hf: model whose classes are in its
directory's own .py files, under ZeRO-3."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import (MOE_VOCAB, REPO, SEQ, TINY, assert_zero3_planned_to_the_byte, banded_tokens, data_trace,
                     ds_variant, metrics, rank_infos, run_main, run_train, zero3_all_partitioned)

FACTORY = "py:user_models.banded_moe:build_model"
KWARGS = {"vocab": MOE_VOCAB, "d_model": 32, "ffn": 64, "n_experts": 4, "top_k": 2}
STEPS, SEED = 6, 1234
USER_ENV = {"PYTHONPATH": str(REPO / "tests")}  # where the user's package is importable from


def moe_args(tokens: Path, run_dir: Path, ds: str) -> list[str]:
    return ["--model.name", FACTORY, "--model.kwargs", json.dumps(KWARGS), "--data.kind", "tokens",
            "--data.path", str(tokens), "--data.seq_len", str(SEQ), "--train.micro_batch_size", "1",
            "--train.grad_accum_steps", "2", "--train.max_steps", str(STEPS), "--train.eval_every", "0",
            "--train.eval_batches", "null", "--train.seed", str(SEED), "--optim.lr", "3e-3",
            "--optim.warmup_steps", "2", "--logging.progress", "false", "--logging.every_steps", "1",
            "--debug.trace_data", "true", "--checkpoint.save_at_end", "false", "--checkpoint.export", "true",
            "--checkpoint.export_dtype", "fp32", "--ds-config", ds, "--train.run_dir", str(run_dir)]


@pytest.fixture(scope="module")
def user_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("user_moe")
    tokens = banded_tokens(d / "banded.bin", SEED)
    ddp_unused = ds_variant(d, "ddp", "ddp_fp32_unused", bf16={"enabled": False},
                            ddp={"find_unused_parameters": True, "bucket_cap_mb": 25, "gradient_as_bucket_view": True,
                                 "static_graph": False, "broadcast_buffers": True})
    runs = {}
    for name, ds in (("zero3", zero3_all_partitioned(d)), ("ddp", ddp_unused)):
        proc = run_train("torchrun", 2, moe_args(tokens, d / name, ds), env=USER_ENV)
        runs[name] = SimpleNamespace(dir=d / name, proc=proc, rows=[r for r in metrics(d / name) if "loss" in r])
    return SimpleNamespace(tokens=tokens, **runs)


@pytest.mark.multiproc
def test_user_moe_with_idle_experts_trains_under_the_shipped_ddp_options(tmp_path):
    """The shipped ddp.json (find_unused_parameters false), 2 ranks whose tokens reach disjoint
    experts: each rank leaves two experts idle every step. Detected from the model before the
    first step: find_unused_parameters is set and the start-up lines say so (DDP otherwise
    fails at step 2, waiting for the idle experts' gradients)."""
    from helpers import fp32
    tokens = banded_tokens(tmp_path / "banded.bin", SEED)
    ds = fp32(tmp_path, "ddp")
    assert json.loads(Path(ds).read_text())["ddp"]["find_unused_parameters"] is False
    proc = run_train("torchrun", 2, [*moe_args(tokens, tmp_path / "run", ds), "--train.max_steps", "3",
                                     "--checkpoint.export", "false"], env=USER_ENV, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "zerotrain: ddp.find_unused_parameters set to true: this model's 4 experts per sparse layer can get no " \
           "tokens on a rank" in proc.stdout, proc.stdout[-3000:]
    assert len([r for r in metrics(tmp_path / "run") if "loss" in r]) == 3


@pytest.mark.multiproc
def test_a_py_model_resumes_on_another_world_size_and_starts_a_run_from_its_export(tmp_path):
    """tests/user_models/tiny_lm.py through the lifecycle: 4 steps on 2 ranks under ZeRO-2 with a
    checkpoint at step 2 and the export at the end; resumed from step 2 on 1 process under DDP it
    continues with the same losses and parameters; a new run with model.init_from the export
    starts from the exported weights (its first step, at a negligible LR, leaves the parameters'
    checksum where the first run ended)."""
    from helpers import fp32
    name = "py:user_models.tiny_lm:build"
    base = [*TINY, "--model.name", name, "--model.kwargs", '{"d": 32}', "--data.seq_len", "32",
            "--train.global_batch_size", "8", "--train.eval_every", "0", "--optim.schedule", "constant",
            "--debug.param_checksum", "true", "--logging.trackers", "jsonl"]
    first, resumed, started = tmp_path / "first", tmp_path / "resumed", tmp_path / "started"
    run_train("torchrun", 2, [*base, "--ds-config", fp32(tmp_path, "zero2"), "--train.max_steps", "4",
                              "--checkpoint.every_steps", "2", "--checkpoint.export", "true",
                              "--checkpoint.export_dtype", "fp32", "--train.run_dir", str(first)], env=USER_ENV)
    run_train("python", 1, [*base, "--ds-config", fp32(tmp_path, "ddp"), "--train.max_steps", "4",
                            "--resume", str(first / "checkpoints" / "step_00000002"), "--train.run_dir", str(resumed)],
              env=USER_ENV)
    def per_step(run_dir):  # the step's log line and its checksum row, merged
        out: dict = {}
        for r in metrics(run_dir):
            if "step" in r and ("loss" in r or "debug/param_checksum" in r):
                out.setdefault(r["step"], {}).update(r)
        return out
    rows = {"first": per_step(first), "resumed": per_step(resumed)}
    assert sorted(rows["resumed"]) == [3, 4]
    for step in (3, 4):
        for key in ("loss", "debug/param_checksum"):
            assert rows["resumed"][step][key] == pytest.approx(rows["first"][step][key], rel=1e-5), (step, key)
    assert json.loads((first / "export" / "config.json").read_text())["factory"] == "user_models.tiny_lm:build"
    run_train("python", 1, [*base, "--ds-config", fp32(tmp_path, "ddp"), "--train.max_steps", "1", "--optim.lr",
                            "1e-12", "--optim.min_lr", "0", "--optim.warmup_steps", "0", "--model.init_from", str(first / "export"),
                            "--train.run_dir", str(started)], env=USER_ENV)
    [row] = per_step(started).values()
    assert row["debug/param_checksum"] == pytest.approx(rows["first"][4]["debug/param_checksum"], rel=1e-6)
    assert row["debug/param_checksum"] != pytest.approx(rows["first"][1]["debug/param_checksum"], rel=1e-3)


# ----------------------------------------------------------------------------- in process

@pytest.mark.parametrize("name,kwargs,says", [
    ("py:user_models.banded_moe", None, 'model.name "py:user_models.banded_moe" must be "py:<module>:<function>"'),
    ("py:user_models.missing:build", None, 'no module named "user_models.missing" on the Python path; make it '
                                           "importable: put its directory on PYTHONPATH"),
    ("py:user_models.banded_moe:build_modle", None, 'has no function "build_modle" (did you mean "build_model"?)'),
    ("py:user_models.bad:not_a_module", None, "the factory returned a dict, not a torch nn.Module; return the model"),
    (FACTORY, {"width": 8}, "model.kwargs {\"width\": 8}: the factory of model.name \"py:user_models.banded_moe:"
                            "build_model\" does not take them (got an unexpected keyword argument 'width')"),
], ids=["no-colon", "missing-module", "missing-function", "not-a-module", "wrong-kwargs"])
def test_a_bad_factory_stops_in_one_line_with_exit_2(capsys, tmp_path, name, kwargs, says):
    argv = [*TINY, "--model.name", name, "--train.max_steps", "1", "--train.run_dir", str(tmp_path / "run")]
    code, err = run_main(capsys, argv + (["--model.kwargs", json.dumps(kwargs)] if kwargs else []))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert says in lines[0] and name in lines[0], lines[0]


@pytest.mark.parametrize("ds", ["zero2_fp32", "ddp"])
def test_a_factory_that_raises_stops_with_its_own_exception_in_one_line(capsys, tmp_path, ds, fresh_accelerate):
    """The factory's own error (its type and message, with model.name), before the model is built:
    under ZeRO-2's "auto" bucket sizes it was a line about a missing hidden size, under DDP a traceback."""
    name = "py:user_models.bad:raises"
    code, err = run_main(capsys, [*TINY, "--model.name", name, "--ds-config", str(REPO / "ds_configs" / f"{ds}.json"),
                                  "--train.max_steps", "1", "--train.run_dir", str(tmp_path / "run")])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert f'model.name "{name}": the factory raised ValueError: d=32 must be a multiple of 64' in lines[0], lines[0]


def test_a_factory_that_fails_only_on_the_meta_device_trains_unchecked_with_a_note(capsys, tmp_path, clean_env,
                                                                                    fresh_accelerate):
    """The documented promise: built once on the CPU for the ZeRO-2 "auto" sizes' width, then the
    run trains, and says that the memory check could not size it."""
    from zerotrain.train.main import main
    name = "py:user_models.bad:meta_hostile"
    assert main([*TINY, "--model.name", name, "--ds-config", str(REPO / "ds_configs" / "zero2_fp32.json"),
                 "--train.max_steps", "2", "--train.eval_every", "0", "--logging.trackers", "jsonl",
                 "--train.run_dir", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert f'the factory of model.name "{name}" cannot build on the meta device' in out and "trains unchecked" in out, out
    assert len([r for r in metrics(tmp_path / "run") if "loss" in r]) == 2


def test_lm_logits_of_the_wrong_shape_stop_in_one_line_naming_the_contract(capsys, tmp_path, fresh_accelerate):
    """model.loss lm with a forward that returns (B, V): one line naming model.name and the
    (B, T, V) contract, instead of a traceback from inside the loss at step 1."""
    name = "py:user_models.bad:flat_logits"
    code, err = run_main(capsys, [*TINY, "--model.name", name, "--model.loss", "lm", "--ds-config",
                                  str(REPO / "ds_configs" / "ddp.json"), "--train.max_steps", "1",
                                  "--logging.trackers", "jsonl", "--train.run_dir", str(tmp_path / "run")])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert f'model.name "{name}" with model.loss lm' in lines[0] and "returned shape (4, 256)" in lines[0], lines[0]
    assert "(B, T, V) = (4, 64, vocab)" in lines[0], lines[0]


@pytest.mark.parametrize("override,says", [
    (["--model.kwargs", "{d: 1}"], "model.kwargs is not a key of model family gpt (its keys: name, "),
    (["--model.loss", "lm"], "model.loss is not a key of model family gpt"),
    (["--model.trust_remote_code", "true"], "model.trust_remote_code is not a key of model family gpt"),
    (["--model.name", "resnet18", "--model.trust_remote_code", "true"], "model family hf has it"),
    (["--model.name", FACTORY, "--model.loss", "clasification"], 'model.loss must be one of lm, classification, model '
                                                                  '(got "clasification") (did you mean "classification"?)'),
    (["--model.name", FACTORY, "--model.kwargs", "[1, 2]"], "model.kwargs must be a mapping (got '[1, 2]')"),
    (["--model.name", FACTORY, "--model.kwargs", "{day: 2020-01-01}"], "model.kwargs must hold plain values"),
])
def test_keys_of_another_kind_of_model_are_refused(override, says):
    from zerotrain.train.config import load_config
    from zerotrain.train.errors import ConfigError
    pairs = [(override[i].lstrip("-"), override[i + 1]) for i in range(0, len(override), 2)]
    with pytest.raises(ConfigError) as e:
        load_config(None, pairs)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_kwargs_reach_the_factory_and_the_planner_sizes_the_module_it_builds():
    """The factory is called with model.kwargs; the planner's meta-device module (no memory) has
    the tensors of the module the run builds, its sparse block found, top-k from the block."""
    from zerotrain.models import build_workload, resolve
    from zerotrain.models.config import ModelConfig
    from zerotrain.train.plan import memory_check
    from zerotrain.train.plan.shapes import module_shape
    spec = resolve(ModelConfig(name=FACTORY, kwargs={**KWARGS, "n_experts": 6}))
    data = SimpleNamespace(task="lm", extra={}, seq_len=SEQ, vocab_size=MOE_VOCAB)
    wl = build_workload(spec, data)
    assert len(wl.model.moe.experts) == 6 and wl.model.head.out_features == MOE_VOCAB
    planned = memory_check.model_shape(spec, data)
    built = module_shape(wl.model, spec.name)
    assert planned.groups == built.groups and planned.num_params == built.num_params > 0
    assert planned.leaf_block == built.leaf_block == sum(p.numel() for p in wl.model.moe.parameters())
    assert wl.moe_info.num_experts == 6 and wl.moe_info.top_k == 2 and wl.moe is None  # no aux loss of zerotrain's
    assert wl.model_config == {"family": "py", "factory": "user_models.banded_moe:build_model",
                               "kwargs": {**KWARGS, "n_experts": 6}, "loss": "lm"}
    # `zerotrain plan py:...` sizes the factory's module (its default kwargs) the same way.
    from zerotrain.train.commands.plan import resolve_model
    shape, _ = resolve_model(FACTORY)
    assert shape.num_params == sum(p.numel() for p in build_workload(resolve(ModelConfig(name=FACTORY)),
                                                                       data).model.parameters())


def test_model_loss_is_what_forward_returns():
    """model.loss "model": forward(**batch) computes the loss; training and evaluation take it as it is."""
    from zerotrain.models import build_workload, resolve
    from zerotrain.models.config import ModelConfig
    spec = resolve(ModelConfig(name="py:user_models.own_loss:regressor", loss="model", kwargs={"features": 3}))
    wl = build_workload(spec, SimpleNamespace(task="regress", extra={}, seq_len=None))
    x, y = torch.randn(5, 3), torch.randn(5, 1)
    want = torch.nn.functional.mse_loss(wl.model.lin(x), y) * 2  # the module's own loss (doubled: not zerotrain's)
    assert torch.allclose(wl.loss(wl.model, {"x": x, "y": y}), want)
    stats = wl.eval_stats(wl.model, {"x": x, "y": y})
    assert stats["loss"].shape == (5,) and torch.allclose(stats["loss"], want.expand(5))


def test_where_the_backend_builds_on_the_meta_device_a_constructor_that_needs_values_is_built_whole(capsys):
    """FSDP2 builds the model on the meta device on ranks but 0 (models/partitioned.py EmptyInit):
    a factory that reads its parameters' values in its constructor cannot run there, so it is built
    whole on that rank instead, with one line saying so; one that needs no values gets shapes only."""
    from zerotrain.models import build_workload, resolve
    from zerotrain.models.config import ModelConfig
    from zerotrain.models.partitioned import EmptyInit
    data = SimpleNamespace(task="regress", extra={}, seq_len=None)
    plain = build_workload(resolve(ModelConfig(name="py:user_models.own_loss:regressor", loss="model")), data,
                           EmptyInit())
    assert {p.device.type for p in plain.model.parameters()} == {"meta"}
    assert capsys.readouterr().out == ""
    needy = build_workload(resolve(ModelConfig(name="py:user_models.own_loss:rescaled", loss="model")), data,
                           EmptyInit())
    assert {p.device.type for p in needy.model.parameters()} == {"cpu"} and needy.model.scale > 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and "cannot be constructed on the meta device" in out[0] and "built whole" in out[0], out


# ----------------------------------------------------------------------------- 2 processes

@pytest.mark.multiproc
def test_user_moe_under_partitioned_zero3_equals_ddp_with_ranks_on_disjoint_experts(user_moe):
    z3, ddp = user_moe.zero3, user_moe.ddp
    assert "model built partitioned by deepspeed.zero.Init" in z3.proc.stdout
    assert "MoE: 4 experts x 2 active, 1 sparse layers, BandedSparseBlock as ZeRO-3 leaf" in z3.proc.stdout
    assert f"model        {FACTORY}:" in z3.proc.stdout and "your factory, loss lm" in z3.proc.stdout
    for info in rank_infos(z3.dir):
        z = info["zero3"]
        assert z["partitioned_tensors"] == z["tensors"] and z["whole_tensors"] == 0, z
        assert z["built_outside_zero_init"] == 0, z
        assert z["held_elements"] <= z["partitioned_elements"] / 2 + z["partitioned_tensors"], z
    # Rank 0 only ever held low-band windows (experts 0-1), rank 1 only high-band ones (experts 2-3).
    from zerotrain.train.config import DataConfig
    from zerotrain.train.data import build_data
    import zlib
    data = build_data(DataConfig(kind="tokens", path=str(user_moe.tokens)), SEQ, SEED)
    crc = {zlib.crc32(data.train[i]["input_ids"].numpy().tobytes()): i for i in range(len(data.train))}
    seen = [[data.train[crc[c]]["input_ids"] for r in data_trace(z3.dir, rank) for c in r["crc"]] for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == STEPS * 2
    assert all(int(x.max()) < MOE_VOCAB // 2 for x in seen[0]) and all(int(x.min()) >= MOE_VOCAB // 2 for x in seen[1])
    # The same training as DDP (the tolerance of tests/test_moe.py's equality).
    assert [r["step"] for r in z3.rows] == [r["step"] for r in ddp.rows] == list(range(1, STEPS + 1))
    for a, b in zip(z3.rows, ddp.rows):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
    assert z3.rows[-1]["loss"] < z3.rows[0]["loss"]
    # The planner sized the user's module exactly (built on the meta device before the run).
    assert_zero3_planned_to_the_byte(next(r for r in metrics(z3.dir) if "mem/params_bytes" in r))


@pytest.mark.multiproc
def test_user_moe_export_loads_into_the_factorys_module(user_moe):
    """The consolidated export is the module's state_dict: safetensors load into a fresh factory
    module (strict), the tensors equal the file's and DDP's export, and the loaded module gives
    the run's final validation loss."""
    from safetensors.torch import load_file

    from user_models.banded_moe import build_model
    export = user_moe.zero3.dir / "export"
    config = json.loads((export / "config.json").read_text())
    assert config == {"family": "py", "factory": "user_models.banded_moe:build_model", "kwargs": KWARGS, "loss": "lm"}
    tensors = load_file(str(export / "model.safetensors"))
    model = build_model(**config["kwargs"])
    model.load_state_dict(tensors, strict=True)
    state = model.state_dict()
    assert set(state) == set(tensors) and all(torch.equal(state[k], tensors[k]) for k in tensors)
    ddp = load_file(str(user_moe.ddp.dir / "export" / "model.safetensors"))
    assert set(ddp) == set(tensors) and all(torch.allclose(ddp[k], tensors[k], atol=1e-5) for k in tensors)
    # The loaded module reproduces the run's validation loss (token-weighted, as the evaluator).
    from zerotrain.train.config import DataConfig
    from zerotrain.train.data import build_data
    val = build_data(DataConfig(kind="tokens", path=str(user_moe.tokens)), SEQ, SEED).val
    model.eval()
    with torch.no_grad():
        total = sum(float(torch.nn.functional.cross_entropy(model(val[i]["input_ids"][None])[0], val[i]["labels"],
                                                            reduction="sum")) for i in range(len(val)))
    tokens = sum(int((val[i]["labels"] != -100).sum()) for i in range(len(val)))
    row = [r for r in metrics(user_moe.zero3.dir) if "val/loss" in r][-1]
    assert math.isclose(total / tokens, row["val/loss"], rel_tol=1e-5), (total / tokens, row)


# ----------------------------------------------------------------------------- trust_remote_code

CONFIG_PY = '''
from transformers import PretrainedConfig


class TinyMixerConfig(PretrainedConfig):
    model_type = "zt_tiny_mixer"

    def __init__(self, vocab_size=64, hidden_size=32, max_position_embeddings=64, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.max_position_embeddings = max_position_embeddings
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)
'''

MODELING_PY = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from .configuration_tiny_mixer import TinyMixerConfig


class TinyMixerForCausalLM(PreTrainedModel):
    config_class = TinyMixerConfig

    def __init__(self, config):
        super().__init__(config)
        d = config.hidden_size
        self.embed = nn.Embedding(config.vocab_size, d)
        self.mix = nn.Linear(2 * d, d)
        self.lm_head = nn.Linear(d, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, position_ids=None, labels=None, **kwargs):
        x = self.embed(input_ids)
        prev = F.pad(x, (0, 0, 1, 0))[:, :-1]
        return CausalLMOutput(logits=self.lm_head(x + torch.tanh(self.mix(torch.cat([x, prev], -1)))))
'''


def save_remote_code_model(d: Path) -> Path:
    """A model transformers does not know: its config and model classes are in the directory's
    own .py files, named by config.json's auto_map (no weights: trained from its initialisation)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "configuration_tiny_mixer.py").write_text(CONFIG_PY)
    (d / "modeling_tiny_mixer.py").write_text(MODELING_PY)
    (d / "config.json").write_text(json.dumps({
        "model_type": "zt_tiny_mixer", "architectures": ["TinyMixerForCausalLM"], "vocab_size": MOE_VOCAB,
        "hidden_size": 32, "max_position_embeddings": 64, "tie_word_embeddings": False,
        "auto_map": {"AutoConfig": "configuration_tiny_mixer.TinyMixerConfig",
                     "AutoModelForCausalLM": "modeling_tiny_mixer.TinyMixerForCausalLM"}}))
    return d


def test_a_dir_with_its_own_code_is_refused_without_trust_remote_code(capsys, tmp_path):
    d = save_remote_code_model(tmp_path / "tiny_mixer")
    code, err = run_main(capsys, [*TINY, "--model.name", f"hf:{d}", "--train.run_dir", str(tmp_path / "run")])
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert (f"model.name hf:{d}: {d / 'config.json'} names its own modeling code (configuration_tiny_mixer.py, "
            f"modeling_tiny_mixer.py in auto_map); set model.trust_remote_code true to run it") in lines[0], err


@pytest.mark.multiproc
def test_a_dir_with_its_own_code_trains_under_zero3_with_trust_remote_code(tmp_path):
    from helpers import write_token_file
    d = save_remote_code_model(tmp_path / "tiny_mixer")
    tokens = write_token_file(tmp_path / "t.bin", torch.randint(0, MOE_VOCAB, (40 * SEQ + 1,)).tolist(),
                              vocab_size=MOE_VOCAB)
    run_dir = tmp_path / "run"
    proc = run_train("torchrun", 2, [
        "--model.name", f"hf:{d}", "--model.trust_remote_code", "true", "--data.kind", "tokens", "--data.path",
        str(tokens), "--data.seq_len", str(SEQ), "--train.micro_batch_size", "2", "--train.max_steps", "2",
        "--train.eval_every", "0", "--train.eval_batches", "1", "--logging.progress", "false",
        "--logging.every_steps", "1", "--checkpoint.save_at_end", "false", "--checkpoint.export", "true",
        "--checkpoint.export_dtype", "fp32", "--ds-config", zero3_all_partitioned(tmp_path),
        "--train.run_dir", str(run_dir)], env={"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert "trust_remote_code: runs the directory's own modeling code" in proc.stdout
    assert "model built partitioned by deepspeed.zero.Init" in proc.stdout
    for info in rank_infos(run_dir):
        z = info["zero3"]
        assert z["partitioned_tensors"] == z["tensors"] and z["built_outside_zero_init"] == 0, z
    assert [r["step"] for r in metrics(run_dir) if "loss" in r] == [1, 2]
    # The export is a directory transformers loads with the same code (copied next to the weights).
    from transformers import AutoModelForCausalLM
    export = run_dir / "export"
    assert {"modeling_tiny_mixer.py", "configuration_tiny_mixer.py"} <= {p.name for p in export.iterdir()}
    model = AutoModelForCausalLM.from_pretrained(str(export), trust_remote_code=True, local_files_only=True)
    from safetensors.torch import load_file
    saved = load_file(str(export / "model.safetensors"))
    assert type(model).__name__ == "TinyMixerForCausalLM"
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
