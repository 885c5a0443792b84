"""`zerotrain import`: native DeepSpeed checkpoints (ZeRO-0..3) -> zerotrain checkpoints.

One 2-process launch (tests/ds_native_loop.py) writes DeepSpeed checkpoints of all four stages
with DeepSpeed's own save_checkpoint and records how the loop continues; each is imported
(in this process) and compared exactly with DeepSpeed's own readers / the raw per-rank
optimizer files; four zerotrain resumes cover {1, 2} processes x {DDP, ZeRO-3}, one per source
stage, and must continue the DeepSpeed loop's losses within 1e-6. The refusals (no
--trust-pickle, a code-running pickle, not a checkpoint, a shape mismatch) need no launch: a
ZeRO-0 checkpoint is a single torch.save file, built here.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import BIN, REPO, free_port, run_train, subprocess_env, train_losses

SAVE_AT, CONTINUE = 3, 3
RUN_YAML = """\
model: {name: gpt-tiny}
data: {seq_len: 64, max_bytes: 300000}
train: {micro_batch_size: 4, global_batch_size: 8, sample_tokens: 0, eval_every: 0,
        eval_batches: 1}
optim: {lr: 0.003, schedule: constant, warmup_steps: 0}
logging: {every_steps: 1, progress: false}
checkpoint: {export: false, save_at_end: false}
"""


@pytest.fixture(scope="module")
def run_yaml(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("cfg") / "run.yaml"
    p.write_text(RUN_YAML)
    return str(p)


def zt_import(argv, capsys=None) -> tuple[int, str]:
    from zerotrain.train.commands.import_ckpt import main
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err if capsys else ""
    return code, err


def read_ckpt(ckpt: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every (kind, name) of an imported checkpoint, whole (shape from meta.json)."""
    from zerotrain.train.checkpoint import files as io
    meta = io.read_json(ckpt / io.META, "meta")
    r = io.PieceReader(sorted(ckpt.glob("*.safetensors")))
    out = {}
    for (kind, name) in list(r.index):
        shape = meta["params"][name]["shape"] if kind != "buffer" else meta["buffers"][name]["shape"]
        n = int(torch.tensor(shape).prod()) if shape else 1
        out[(kind, name)] = r.read(kind, name, 0, n).view(shape)
    r.close()
    return out


# ---------------------------------------------------------------------------- no launch

def _zero0_checkpoint(run_yaml: str, root: Path, *, d_model: int | None = None, extra: dict | None = None) -> Path:
    """A ZeRO-0 save_checkpoint directory as DeepSpeed writes it (one mp_rank_00 file holding the
    module and the torch optimizer's state dict), after one AdamW step of the run's model."""
    from zerotrain.models import build_workload
    from zerotrain.models import resolve as resolve_model
    from zerotrain.train.config import load_config
    from zerotrain.train.data import build_data
    from zerotrain.train.optim.optimizer import param_groups
    cfg = load_config(run_yaml)
    if d_model:
        cfg.model.d_model = d_model
    spec = resolve_model(cfg.model)
    data = build_data(cfg.data, 64, cfg.train.seed)
    torch.manual_seed(0)
    model = build_workload(spec, data).model
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3)
    batch = torch.utils.data.default_collate([data.train[i] for i in range(4)])
    model(batch["input_ids"]).float().pow(2).mean().backward() if "input_ids" in batch else None
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.randn_like(p)
    opt.step()
    step = root / "global_step1"
    step.mkdir(parents=True)
    (root / "latest").write_text("global_step1")
    torch.save({"module": model.state_dict(), "buffer_names": [], "optimizer": opt.state_dict(),
                "param_shapes": None, "global_steps": 1, "global_samples": 8, "skipped_steps": 0,
                "dp_world_size": 2, **(extra or {})}, step / "mp_rank_00_model_states.pt")
    return root


def test_zero0_round_trip_without_a_launch(run_yaml, tmp_path, capsys):
    src = _zero0_checkpoint(run_yaml, tmp_path / "ds")
    code, _ = zt_import([str(src), "--out", str(tmp_path / "z"), "--config", run_yaml, "--trust-pickle"], capsys)
    assert code == 0
    saved = torch.load(src / "global_step1" / "mp_rank_00_model_states.pt", weights_only=False)
    got = read_ckpt(tmp_path / "z")
    module = saved["module"]
    assert "lm_head.weight" in module and ("param", "lm_head.weight") not in got  # tied: stored once
    for name, t in module.items():
        if name != "lm_head.weight":
            assert torch.equal(got[("param", name)], t), name
    from zerotrain.train.checkpoint import files as io
    meta = io.read_json(tmp_path / "z" / io.META, "meta")
    assert meta["train_state"]["step"] == 1 and meta["data"]["global_batch"] == 8
    assert all(p["optimizer_step"] == 1 for p in meta["params"].values())


PY_RUN_YAML = RUN_YAML.replace("model: {name: gpt-tiny}", 'model: {name: "py:user_models.tiny_lm:build", kwargs: {d: 32}}')


def test_a_py_model_checkpoint_imports_and_resumes(tmp_path, capsys, clean_env, fresh_accelerate):
    """A DeepSpeed checkpoint of a py: model (tests/user_models/tiny_lm.py) imports by parameter
    name, records the factory, and a run resumes from it (in this process)."""
    from helpers import fp32
    run_yaml = tmp_path / "py.yaml"
    run_yaml.write_text(PY_RUN_YAML)
    src = _zero0_checkpoint(str(run_yaml), tmp_path / "ds")
    code, _ = zt_import([str(src), "--out", str(tmp_path / "z"), "--config", str(run_yaml), "--trust-pickle"], capsys)
    assert code == 0
    module = torch.load(src / "global_step1" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    got = read_ckpt(tmp_path / "z")
    assert sorted(module) == ["emb.weight", "head.bias", "head.weight", "mix.bias", "mix.weight"]
    for name, t in module.items():
        assert torch.equal(got[("param", name)], t), name
    from zerotrain.train.checkpoint import files as io
    meta = io.read_json(tmp_path / "z" / io.META, "meta")
    assert meta["model"]["config"]["factory"] == "user_models.tiny_lm:build" and meta["train_state"]["step"] == 1
    from zerotrain.train.main import main
    run = tmp_path / "run"
    assert main(["--config", str(run_yaml), "--resume", str(tmp_path / "z"), "--train.max_steps", "2",
                 "--logging.trackers", "jsonl", "--train.run_dir", str(run), "--ds-config", fp32(tmp_path, "ddp")]) == 0
    assert list(train_losses(run)) == [2]


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_code_running_pickle_is_refused_without_running(run_yaml, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    step = tmp_path / "evil" / "global_step1"
    step.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}, "args": _RunsCode(marker)}, step / "mp_rank_00_model_states.pt")
    code, err = zt_import([str(step), "--out", str(tmp_path / "z"), "--config", run_yaml, "--trust-pickle"], capsys)
    assert code == 2 and ("refused to unpickle posix.system" in err or "refused to unpickle os.system" in err), err
    assert not marker.exists() and not (tmp_path / "z").exists()
    from zerotrain.train.checkpoint.safe_unpickle import UnsafePickle, restricted_load
    with pytest.raises(UnsafePickle):
        restricted_load(step / "mp_rank_00_model_states.pt")
    assert not marker.exists()
    with pytest.raises(UnsafePickle):  # a bare pickle (torch's legacy format) as well: refused, never run
        p = tmp_path / "bare.pkl"
        p.write_bytes(pickle.dumps(_RunsCode(marker)))
        restricted_load(p)
    assert not marker.exists()


def _bf16_zero0(run_yaml, t):
    src = _zero0_checkpoint(run_yaml, t / "ds")
    f = src / "global_step1" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["module"] = {n: v.bfloat16() for n, v in sd["module"].items()}
    torch.save(sd, f)
    return src


def _not_a_checkpoint(t):
    (t / "empty").mkdir()
    return t / "empty"


def _evil(t):
    step = t / "evil" / "global_step1"
    step.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}, "args": _RunsCode(t / "PWNED")}, step / "mp_rank_00_model_states.pt")
    return step


# The reliability catalogue's pattern (tests/test_reliability.py) for `zerotrain import`: each bad input
# -> exit 2, a message naming the file / flag and the fix, no traceback, nothing written.
BAD_IMPORTS = {
    # name: (source builder (run_yaml, tmp) -> path, extra argv, substring of the message)
    "no --trust-pickle": (lambda c, t: _zero0_checkpoint(c, t / "ds"), [], "pass --trust-pickle to import it"),
    "not a checkpoint": (lambda c, t: _not_a_checkpoint(t), ["--trust-pickle"],
                         "is not a DeepSpeed or HF Trainer checkpoint"),
    "code-running pickle": (lambda c, t: _evil(t), ["--trust-pickle"], "refused to unpickle posix.system"),
    "shape mismatch": (lambda c, t: _zero0_checkpoint(c, t / "ds", d_model=32), ["--trust-pickle"],
                       "tok_emb.weight: model [256, 64] vs checkpoint [256, 32]"),
    "bf16 ZeRO-0": (_bf16_zero0, ["--trust-pickle"], "only fp32 ZeRO-0 checkpoints can be imported"),
    "bad --strict": (lambda c, t: _zero0_checkpoint(c, t / "ds"), ["--trust-pickle", "--strict", "maybe"],
                     "expected true or false"),
}


@pytest.mark.parametrize("case", sorted(BAD_IMPORTS))
def test_bad_import_gives_one_clear_message_and_exit_2(case, run_yaml, tmp_path, capsys):
    build, extra, want = BAD_IMPORTS[case]
    src = build(run_yaml, tmp_path)
    code, err = zt_import([str(src), "--out", str(tmp_path / "z"), "--config", run_yaml, *extra], capsys)
    assert code == 2 and want in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()[0]) < 400
    assert not (tmp_path / "z").exists() and not (tmp_path / "PWNED").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp directory left


def test_shape_mismatch_is_named_exit_2_and_nothing_written(run_yaml, tmp_path, capsys):
    src = _zero0_checkpoint(run_yaml, tmp_path / "ds", d_model=32)
    out = tmp_path / "z"
    code, err = zt_import([str(src), "--out", str(out), "--config", run_yaml, "--trust-pickle"], capsys)
    assert code == 2 and "do not fit the model" in err and "tok_emb.weight: model [256, 64] vs checkpoint [256, 32]" \
        in err, err
    assert not out.exists()


def test_a_vocabulary_taken_from_the_data_is_named_with_the_fix(run_yaml, tmp_path, capsys):
    """gpt-tiny trained on bytes (vocabulary 256), imported with a run on a raw token file without a
    sidecar whose largest id is 122: the model takes the data's vocabulary, 123, and the message
    says which setting makes the checkpoint fit."""
    import numpy as np
    src = _zero0_checkpoint(run_yaml, tmp_path / "ds")
    np.random.default_rng(0).integers(0, 123, 20000).astype(np.uint16).tofile(tmp_path / "tok.bin")
    tokens_yaml = tmp_path / "tokens.yaml"
    tokens_yaml.write_text(RUN_YAML.replace("data: {seq_len: 64, max_bytes: 300000}",
                                            f"data: {{kind: tokens, path: {tmp_path / 'tok.bin'}, token_dtype: uint16, "
                                            f"seq_len: 64}}"))
    code, err = zt_import([str(src), "--out", str(tmp_path / "z"), "--config", str(tokens_yaml), "--trust-pickle"],
                          capsys)
    assert code == 2 and "tok_emb.weight: model [123, 64] vs checkpoint [256, 64]" in err, err
    assert (f"the checkpoint was trained with a vocabulary of 256, this model has 123 (model.vocab_size is unset: "
            f"the data's): set model.vocab_size: 256 in {tokens_yaml}") in err, err
    # Set as advised, it imports.
    tokens_yaml.write_text(tokens_yaml.read_text().replace("model: {name: gpt-tiny}",
                                                           "model: {name: gpt-tiny, vocab_size: 256}"))
    code, err = zt_import([str(src), "--out", str(tmp_path / "z"), "--config", str(tokens_yaml), "--trust-pickle"],
                          capsys)
    assert code == 0, err
    # Another dimension differs too: no vocabulary advice.
    code, err = zt_import([str(_zero0_checkpoint(run_yaml, tmp_path / "ds32", d_model=32)), "--out",
                           str(tmp_path / "z2"), "--config", run_yaml, "--trust-pickle"], capsys)
    assert code == 2 and "model.vocab_size" not in err and "import with the run file of the model" in err, err


def test_an_existing_output_is_replaced_only_when_it_is_a_checkpoint(run_yaml, tmp_path, capsys):
    src = _zero0_checkpoint(run_yaml, tmp_path / "ds")
    out = tmp_path / "z"
    out.mkdir()
    (out / "keep").write_text("previous")  # not a checkpoint: refused, left alone
    code, err = zt_import([str(src), "--out", str(out), "--config", run_yaml, "--trust-pickle"], capsys)
    assert code == 2 and "exists and is not a zerotrain checkpoint" in err and len(err.strip().splitlines()) == 1, err
    assert (out / "keep").read_text() == "previous"
    (out / "keep").unlink()
    for _ in range(2):  # an empty directory, then the previous import: replaced whole
        code, _ = zt_import([str(src), "--out", str(out), "--config", run_yaml, "--trust-pickle"], capsys)
        assert code == 0 and (out / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "z"]  # no temp or .old directory left


def test_unmatched_optimizer_state_needs_strict_false(run_yaml, tmp_path, capsys):
    src = _zero0_checkpoint(run_yaml, tmp_path / "ds")
    f = src / "global_step1" / "mp_rank_00_model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["optimizer"]["param_groups"][0]["params"] = sd["optimizer"]["param_groups"][0]["params"][:-1]  # order lost
    torch.save(sd, f)
    code, err = zt_import([str(src), "--out", str(tmp_path / "z"), "--config", run_yaml, "--trust-pickle"], capsys)
    assert code == 2 and "--strict false" in err, err
    code, _ = zt_import([str(src), "--out", str(tmp_path / "z"), "--config", run_yaml, "--trust-pickle",
                         "--strict", "false"], capsys)
    assert code == 0
    got = read_ckpt(tmp_path / "z")
    assert ("param", "tok_emb.weight") in got and not any(k == "exp_avg" for k, _ in got)  # weights all kept


# ---------------------------------------------------------------------------- one DeepSpeed launch

@pytest.fixture(scope="module")
def native(tmp_path_factory, run_yaml) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("ds_native")
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "ds_native_loop.py"), run_yaml, str(out), str(SAVE_AT), str(CONTINUE)]
    p = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return out, {int(k): v for k, v in json.loads((out / "losses.json").read_text()).items()}


@pytest.fixture(scope="module")
def imported(native, run_yaml, tmp_path_factory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("imported")
    res = {}
    for stage in range(4):
        code, _ = zt_import([str(native[0] / f"stage{stage}"), "--out", str(out / f"z{stage}"), "--config", run_yaml,
                             "--trust-pickle"])
        assert code == 0
        res[stage] = out / f"z{stage}"
    return res


def _expected_moments(step_dir: Path, stage: int) -> dict[str, dict[str, torch.Tensor]]:
    """The moments from the raw per-rank files, reassembled here independently of zerotrain and
    of zero_to_fp32: ZeRO-1/2 by each rank's param_slice_mappings, ZeRO-3 by the documented
    partitioning (rank r holds [r*ceil(N/W), (r+1)*ceil(N/W)) of each parameter, in order)."""
    files = sorted(step_dir.glob("*optim_states.pt"), key=lambda f: int(f.name.split("_")[3]))
    osd = [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]
    model = torch.load(sorted(step_dir.glob("*model_states.pt"))[0], weights_only=False)
    shapes = [s for g in model["param_shapes"] for s in g.items()]
    out = {k: {} for k in ("exp_avg", "exp_avg_sq")}
    world = len(osd)
    for kind in out:
        if stage <= 2:
            for name, shape in shapes:
                g = next(i for i, gs in enumerate(model["param_shapes"]) if name in gs)
                parts = []
                for o in osd:
                    m = o["param_slice_mappings"][g].get(name)
                    if m is not None:
                        parts.append((m.start, o["base_optimizer_state"]["state"][g][kind][m.start:m.start + m.numel]))
                # fragments come in rank order; together they are the whole parameter
                out[kind][name] = torch.cat([p for _, p in parts]).view(shape)
        else:
            flat = [torch.cat([o["optimizer_state_dict"]["state"][g][kind]
                               for g in range(len(o["fp32_flat_groups"]))]) for o in osd]
            off = 0
            for name, shape in shapes:
                n = shape.numel()
                part = -(-n // world)
                out[kind][name] = torch.cat([f[off:off + part] for f in flat])[:n].view(shape)
                off += part
    return out


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_imported_state_equals_deepspeeds(native, imported, stage):
    step_dir = native[0] / f"stage{stage}" / f"global_step{SAVE_AT}"
    got = read_ckpt(imported[stage])
    if stage == 0:
        # zero_to_fp32 does not read ZeRO-0 (checked: it fails); the reference is the raw file.
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        with pytest.raises(Exception):
            get_fp32_state_dict_from_zero_checkpoint(str(native[0] / "stage0"))
        ms = torch.load(step_dir / "mp_rank_00_model_states.pt", weights_only=False)
        weights = dict(ms["module"])
        opt = ms["optimizer"]
        # zerotrain's param_groups order (decay matrices, then the rest), by the module's names
        decay = [n for n, t in weights.items() if t.dim() >= 2 and n not in ("tok_emb.weight", "lm_head.weight")]
        rest = [n for n, t in weights.items() if n not in decay and n != "lm_head.weight"]
        idx = [i for g in opt["param_groups"] for i in g["params"]]
        moments = {k: {n: opt["state"][i][k] for i, n in zip(idx, decay + rest)} for k in ("exp_avg", "exp_avg_sq")}
    else:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
        weights = get_fp32_state_dict_from_zero_checkpoint(str(native[0] / f"stage{stage}"))
        moments = _expected_moments(step_dir, stage)
    weights.pop("lm_head.weight")  # tied to tok_emb.weight: one tensor in zerotrain's checkpoint
    assert sorted(n for k, n in got if k == "param") == sorted(weights)
    worst = 0.0
    for name, t in weights.items():
        assert torch.equal(got[("param", name)], t.float()), name
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[(kind, name)], moments[kind][name].float()), (kind, name)
            worst = max(worst, float((got[(kind, name)] - moments[kind][name]).abs().max()))
    assert worst == 0.0
    from zerotrain.train.checkpoint import files as io
    meta = io.read_json(imported[stage] / io.META, "meta")
    assert meta["train_state"]["step"] == SAVE_AT and meta["train_state"]["offset"] == SAVE_AT * 8
    assert {p["optimizer_step"] for p in meta["params"].values()} == {SAVE_AT}


def _ds_json(tmp_path: Path, base: str) -> str:
    data = json.loads((REPO / "ds_configs" / f"{base}.json").read_text())
    data["bf16"] = {"enabled": False}
    data.pop("fp16", None)
    if base == "zero3":
        data["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    p = tmp_path / f"{base}_fp32.json"
    p.write_text(json.dumps(data))
    return str(p)


# One resume per source stage, together covering 1 and 2 processes under DDP and ZeRO-3.
RESUMES = [(0, 2, "zero3"), (1, 1, "zero3"), (2, 2, "ddp"), (3, 1, "ddp")]


@pytest.mark.multiproc
@pytest.mark.parametrize("stage,nproc,strategy", RESUMES, ids=[f"zero{s}-to-{n}proc-{k}" for s, n, k in RESUMES])
def test_resume_continues_the_deepspeed_loop(native, imported, run_yaml, tmp_path, stage, nproc, strategy):
    run_dir = tmp_path / "run"
    args = ["--config", run_yaml, "--ds-config", _ds_json(tmp_path, strategy), "--resume", str(imported[stage]),
            "--train.max_steps", str(SAVE_AT + CONTINUE), "--train.run_dir", str(run_dir)]
    proc = run_train("torchrun" if nproc == 2 else "python", nproc, args)
    assert f"resumed from {imported[stage]}" in proc.stdout
    got = train_losses(run_dir)
    want = native[1][stage][SAVE_AT:]
    diffs = [abs(got[SAVE_AT + 1 + i] - w) for i, w in enumerate(want)]
    print(f"ZeRO-{stage} -> {nproc} proc {strategy}: max |loss diff| {max(diffs):.2e}")
    assert max(diffs) < 1e-6, (got, want)


# ---------------------------------------------------------------------------- HF Trainer (one launch + one resume)

@pytest.fixture(scope="module")
def hf_native(tmp_path_factory) -> tuple[Path, Path, list]:
    """A tiny local GPT-2 trained by transformers.Trainer on zerotrain's data in zerotrain's order
    (tests/hf_trainer_loop.py): checkpoint-3 and the losses of steps 1..6."""
    from helpers import save_tiny
    root = tmp_path_factory.mktemp("hf_native")
    model = save_tiny("gpt2", root / "model", 256)
    cfg = root / "run.yaml"
    cfg.write_text(RUN_YAML.replace("{name: gpt-tiny}", f'{{name: "hf:{model}"}}')
                   .replace("seq_len: 64, max_bytes: 300000", "seq_len: 32, max_bytes: 200000")
                   .replace("warmup_steps: 0}", "warmup_steps: 0, weight_decay: 0.0}"))
    out = root / "out"
    p = subprocess.run([sys.executable, str(REPO / "tests" / "hf_trainer_loop.py"), str(cfg), str(out), str(SAVE_AT),
                        str(CONTINUE)], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    return cfg, out, json.loads((out / "losses.json").read_text())


@pytest.mark.multiproc
def test_hf_trainer_checkpoint_imports_exactly_and_resumes(hf_native, tmp_path, capsys):
    cfg, out, losses = hf_native
    src = out / f"checkpoint-{SAVE_AT}"
    code, _ = zt_import([str(src), "--out", str(tmp_path / "z"), "--config", str(cfg), "--trust-pickle"], capsys)
    assert code == 0
    got = read_ckpt(tmp_path / "z")
    from safetensors.torch import load_file
    weights = load_file(str(src / "model.safetensors"))
    assert sorted(n for k, n in got if k == "param") == sorted(weights)  # lm_head.weight: tied, not saved by HF
    for n, t in weights.items():
        assert torch.equal(got[("param", n)], t), n
    # optimizer.pt by position, in the Trainer's grouping (decay, then no decay; named_parameters order)
    opt = torch.load(src / "optimizer.pt", weights_only=True)
    from transformers import AutoModelForCausalLM, Trainer
    m = AutoModelForCausalLM.from_pretrained(str(src))
    decay = set(Trainer.get_decay_parameter_names(None, m))
    names = [n for n, _ in m.named_parameters() if n in decay] + [n for n, _ in m.named_parameters() if n not in decay]
    idx = [i for g in opt["param_groups"] for i in g["params"]]
    for i, n in zip(idx, names):
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[(kind, n)], opt["state"][i][kind].view(got[(kind, n)].shape)), (kind, n)
    # Resumed on 2 processes under ZeRO-3 (every parameter partitioned): the Trainer's continued losses.
    run_dir = tmp_path / "run"
    run_train("torchrun", 2, ["--config", str(cfg), "--ds-config", _ds_json(tmp_path, "zero3"), "--resume",
                              str(tmp_path / "z"), "--train.max_steps", str(SAVE_AT + CONTINUE),
                              "--train.run_dir", str(run_dir)])
    resumed = train_losses(run_dir)
    diffs = [abs(resumed[SAVE_AT + 1 + i] - w) for i, w in enumerate(losses[SAVE_AT:])]
    print(f"HF Trainer -> 2 proc zero3: max |loss diff| {max(diffs):.2e}")
    assert max(diffs) < 1e-6, (resumed, losses)
