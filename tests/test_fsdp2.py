"""FSDP2 (ds_configs/fsdp2*.json, train/strategy/fsdp2.py) as the third backend: it trains the
same numbers as ZeRO-3, its checkpoints move to and from ZeRO-3 and DDP on any world size, its
export loads in transformers, and its file's mistakes are one line each.

Launches (module-scoped, fp32, constant LR, 8 steps, a checkpoint every 4):
  z3        2 procs ZeRO-3
  fsdp      2 procs FSDP2 (reshard after forward)
    z3_to_f1     1 proc FSDP2 --resume z3's step 4 (same global batch: accumulation 2)
    f_to_z3      2 procs ZeRO-3 --resume fsdp's step 4
    f_to_ddp     2 procs DDP --resume fsdp's step 4
    f_exact      2 procs FSDP2 --resume fsdp's step 4            -> bit-identical
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import REPO, TINY, ds_variant, metrics, rank_infos, run_train

STEPS = 8
BASE = [*TINY, "--data.max_bytes", "2000", "--train.max_steps", str(STEPS), "--optim.schedule", "constant",
        "--checkpoint.every_steps", "4", "--checkpoint.keep_last", "10", "--model.dropout", "0.0"]
REL = 1e-6   # fp32, another backend: the same arithmetic but the norm's and reductions' order


def fp32_json(d: Path, base: str) -> str:
    return ds_variant(d, base, f"{base}_fp32", bf16={"enabled": False}, fp16={"enabled": False},
                      scheduler=None, data_types=None)


def launch(nproc: int, ds: str, run_dir: Path, *extra, check=True):
    return run_train("python" if nproc == 1 else "torchrun", nproc,
                     [*BASE, "--strategy", ds, "--train.run_dir", str(run_dir), *extra], check=check)


def losses(run_dir: Path) -> dict[int, float]:
    """The last launch's {step: loss} (a resumed run appends to metrics.jsonl)."""
    out = {}
    for r in metrics(run_dir):
        if "loss" in r:
            out[r["step"]] = r["loss"]
    return out


def resumed(tmp: Path, source: Path, name: str, nproc: int, ds: str, *extra) -> Path:
    """A copy of `source`'s run dir resumed from its step-4 checkpoint under `ds` on `nproc`."""
    run = tmp / name
    shutil.copytree(source, run)
    launch(nproc, ds, run, "--resume", str(run / "checkpoints" / "step_00000004"), *extra)
    return run


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2")


@pytest.fixture(scope="module")
def z3(work):
    launch(2, fp32_json(work, "zero3"), work / "z3")
    return work / "z3"


@pytest.fixture(scope="module")
def fsdp(work):
    launch(2, fp32_json(work, "fsdp2"), work / "fsdp")
    return work / "fsdp"


def assert_close(got: dict, want: dict, steps, rel=REL):
    for s in steps:
        assert abs(got[s] - want[s]) <= rel * abs(want[s]), (s, got[s], want[s])


@pytest.mark.multiproc
def test_zero3_checkpoint_resumes_under_fsdp2_on_one_process(work, z3):
    run = resumed(work, z3, "z3_to_f1", 1, fp32_json(work, "fsdp2"), "--train.grad_accum_steps", "2")
    got, want = losses(run), losses(z3)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert_close(got, want, range(5, STEPS + 1))
    assert json.loads((run / "config.json").read_text())["resolved"]["backend"] == "fsdp2"


@pytest.mark.multiproc
def test_fsdp2_trains_what_zero3_trains(z3, fsdp):
    """From the same initial values: rank 1 built the model on the meta device and its shards were
    filled from rank 0's build (ZeRO-3 builds partitioned, from every rank's own construction)."""
    assert_close(losses(fsdp), losses(z3), range(1, STEPS + 1))
    cfg = json.loads((fsdp / "config.json").read_text())
    assert cfg["resolved"]["backend"] == "fsdp2" and cfg["resolved"]["reshard_after_forward"] is True
    assert [r["model_built"] for r in rank_infos(fsdp)] == ["whole", "meta device, filled from rank 0"]


@pytest.mark.multiproc
def test_fsdp2_checkpoint_resumes_under_zero3_and_ddp(work, fsdp):
    want = losses(fsdp)
    for name, base in (("f_to_z3", "zero3"), ("f_to_ddp", "ddp")):
        assert_close(losses(resumed(work, fsdp, name, 2, fp32_json(work, base))), want, range(5, STEPS + 1))


@pytest.mark.multiproc
def test_fsdp2_resume_is_bit_identical(work, fsdp):
    got = losses(resumed(work, fsdp, "f_exact", 2, fp32_json(work, "fsdp2")))
    assert {s: got[s] for s in range(5, STEPS + 1)} == {s: losses(fsdp)[s] for s in range(5, STEPS + 1)}


@pytest.mark.multiproc
def test_fsdp2_resume_with_another_global_batch_is_one_line(work, fsdp):
    run = work / "f_batch"
    shutil.copytree(fsdp, run)
    saved = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    proc = launch(1, fp32_json(work, "fsdp2"), run, "--resume", str(run / "checkpoints" / "step_00000004"),
                  check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = [x for x in proc.stderr.splitlines() if "global batch" in x]
    assert line and "--train.global_batch_size 8" in line[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == saved == ["step_00000004"]


@pytest.mark.multiproc
def test_fsdp2_kept_after_forward_with_accumulation_and_export_loads_in_transformers(work, tmp_path):
    """reshard_after_forward false, 2 micro-batches a step, on a tiny transformers Llama: the
    export is sharded safetensors that transformers loads, equal to the checkpoint's masters.
    Rank 1 built the model on the meta device (from config.json alone): every parameter it trained
    started from rank 0's pretrained values (3 AdamW steps of lr 1e-4 move an element by ~3e-4;
    a shard left unfilled would be off by the weights' own size, ~0.02 to 1)."""
    from helpers import make_tokenizer, random_text, save_tiny
    from transformers import AutoModelForCausalLM
    make_tokenizer(tmp_path / "tok", [random_text(4000, s) for s in range(3)])
    model_dir = save_tiny("llama", tmp_path / "llama", vocab=384, tokenizer_dir=tmp_path / "tok")
    run = tmp_path / "run"
    ds = ds_variant(tmp_path, "fsdp2_keep", bf16={"enabled": False}, fp16={"enabled": False})
    run_train("torchrun", 2, ["--model.name", f"hf:{model_dir}", "--data.kind", "text", "--data.seq_len", "32",
                              "--data.max_bytes", "20000", "--train.micro_batch_size", "2", "--train.grad_accum_steps",
                              "2", "--train.max_steps", "3", "--train.eval_every", "0", "--logging.progress", "false",
                              "--train.sample_tokens", "0", "--checkpoint.export", "true", "--checkpoint.export_dtype",
                              "fp32", "--checkpoint.max_shard_size", "20KB", "--checkpoint.save_at_end", "true",
                              "--optim.lr", "1e-4", "--optim.warmup_steps", "0",
                              "--strategy", ds, "--train.run_dir", str(run)])
    export = run / "export"
    assert len(list(export.glob("model-*.safetensors"))) > 1  # sharded
    loaded = AutoModelForCausalLM.from_pretrained(str(export))
    base = AutoModelForCausalLM.from_pretrained(str(model_dir))
    changed = [n for n, p in loaded.named_parameters() if not (p == dict(base.named_parameters())[n]).all()]
    assert len(changed) == len(list(base.parameters()))  # every parameter trained and exported
    start = dict(base.named_parameters())
    drift = max(float((p - start[n]).abs().max()) for n, p in loaded.named_parameters())
    assert drift < 3e-3, drift
    assert [r["model_built"] for r in rank_infos(run)] == ["whole", "meta device, filled from rank 0"]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["resolved"]["reshard_after_forward"] is False


# ------------------------------------------------------------------ the file's mistakes
def _setup(tmp_path, **changes):
    from zerotrain.train.config import Batch, RunConfig
    from zerotrain.train.strategy.ds_config import load_ds_setup
    path = ds_variant(tmp_path, "fsdp2", **changes)
    return load_ds_setup(path, RunConfig(), Batch(micro=4, accum=1, world=2), 10, cuda=False), path


def test_the_shipped_files_select_fsdp2(tmp_path):
    import zerotrain.train.strategy as strategy
    for name, keep in (("fsdp2", True), ("fsdp2_keep", False)):
        from zerotrain.train.config import Batch, RunConfig
        from zerotrain.train.strategy.ds_config import load_ds_setup
        ds = load_ds_setup(str(REPO / "ds_configs" / f"{name}.json"), RunConfig(), Batch(4, 1, 2), 10, cuda=False)
        s = strategy.for_setup(ds)
        assert type(s).__name__ == "FSDP2Strategy" and s.reshard_after_forward is keep
        assert s.describe().startswith("FSDP2")


@pytest.mark.parametrize("changes, words", [
    ({"fsdp": {"reshard_after_forwad": True}}, ['"fsdp.reshard_after_forwad"', "reshard_after_forward"]),
    ({"fsdp": {"reshard_after_forward": "yes"}}, ['"fsdp.reshard_after_forward" must be true or false']),
    ({"zero_optimization": {"stage": 3}}, ['"zero_optimization"', '"fsdp"', "one backend"]),
    ({"offload_optimizer": {"device": "cpu"}}, ['"offload_optimizer"', "FSDP2 cannot honour"]),
    ({"ddp": {}}, ['"ddp"', '"fsdp"', "one backend"]),
    ({"steps_per_print": 10}, ['"steps_per_print" is not a key of an FSDP2 file']),
])
def test_fsdp2_file_mistakes_are_one_line(tmp_path, changes, words):
    from zerotrain.train.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        _setup(tmp_path, **changes)
    msg = str(e.value)
    assert "\n" not in msg and "fsdp2.json" in msg, msg
    for w in words:
        assert w in msg, msg


def test_fsdp2_refuses_sequence_parallel_in_one_line(tmp_path):
    """(fp16 trains under FSDP2: tests/test_fsdp2_fp16.py, its refused keys included.)"""
    from zerotrain.train.errors import ConfigError
    import zerotrain.train.strategy as strategy
    ds, _ = _setup(tmp_path)
    with pytest.raises(ConfigError, match="distributed.sequence_parallel"):
        strategy.for_setup(ds).check_sequence_parallel("distributed.sequence_parallel 2")


def test_fsdp2_units_are_the_outermost_repeated_blocks():
    import torch
    from zerotrain.train.strategy.fsdp2 import units

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(4, 2)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

    net = Net()
    assert units(net) == list(net.blocks)  # the experts inside a block stay in its unit


# ------------------------------------------------------------------ the plan, both reshard settings
@pytest.mark.multiproc
@pytest.mark.parametrize("name", ["fsdp2", "fsdp2_keep"])
def test_fsdp2_plan_is_the_measured_model_states_and_losses_are_ddps(fp32_stage_runs, name):
    """The stage runs' model (d_model 256, accumulation 2): the planner's model states per rank
    are the measured ones (to the byte: AdamW's step scalars included), within 10% and never
    under; the losses are DDP's."""
    rows = metrics(fp32_stage_runs[name])
    row = next(r for r in rows if "mem/model_states_bytes_per_rank" in r)
    for measured, planned in zip(row["mem/model_states_bytes_per_rank"], row["plan/model_states_bytes_per_rank"]):
        assert measured == planned, (name, measured, planned)
    ddp = {r["step"]: r["loss"] for r in metrics(fp32_stage_runs["ddp"]) if "loss" in r}
    got = {r["step"]: r["loss"] for r in rows if "loss" in r}
    assert sorted(got) == sorted(ddp)
    assert_close(got, ddp, sorted(ddp))


# ------------------------------------------------------------------ accelerate launch
@pytest.mark.multiproc
def test_accelerate_fsdp2_yaml_trains_fsdp2(work):
    run = work / "acc"
    run_train("accelerate", 2, [*BASE, "--train.max_steps", "2", "--strategy", fp32_json(work, "fsdp2"),
                                "--train.run_dir", str(run)],
              accelerate_config=str(REPO / "ds_configs" / "accelerate" / "fsdp2.yaml"))
    cfg = json.loads((run / "config.json").read_text())["resolved"]
    assert (cfg["backend"], cfg["launcher"], cfg["world_size"]) == ("fsdp2", "accelerate", 2)


def test_an_accelerate_fsdp_yaml_picks_or_checks_the_fsdp2_file(monkeypatch, tmp_path):
    from zerotrain.train.errors import ConfigError
    from zerotrain.train.launch.ds_config_choice import resolve_ds_config_path
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    assert resolve_ds_config_path(None, "accelerate").endswith("ds_configs/fsdp2_keep.json")
    with pytest.raises(ConfigError, match="fsdp_reshard_after_forward false but .*fsdp2.json sets the opposite"):
        resolve_ds_config_path(str(REPO / "ds_configs" / "fsdp2.json"), "accelerate")
    with pytest.raises(ConfigError, match=r"launches FSDP \(distributed_type: FSDP\) but the run asks for .*zero3.json"):
        resolve_ds_config_path(str(REPO / "ds_configs" / "zero3.json"), "accelerate")
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(ConfigError, match="model.activation_checkpointing"):
        resolve_ds_config_path(None, "accelerate")
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="fsdp_version 1"):
        resolve_ds_config_path(None, "accelerate")


# ------------------------------------------------------------------ features under FSDP2
@pytest.mark.multiproc
@pytest.mark.full
def test_fsdp2_packed_lora_with_activation_checkpointing_and_async_saves_resumes_exactly(tmp_path):
    """What a fine-tuning user combines, under FSDP2 on 2 processes: a tiny transformers Llama,
    packed instruction data, LoRA adapters, activation checkpointing and asynchronous saves. It
    trains, the rows are packed (little padding), and a resume from the async save of step 4
    continues bit for bit."""
    from helpers import make_tokenizer, random_text, save_tiny
    make_tokenizer(tmp_path / "tok", [random_text(4000, s) for s in range(3)])
    model_dir = save_tiny("llama", tmp_path / "llama", vocab=384, tokenizer_dir=tmp_path / "tok")
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": random_text(20 + 7 * (i % 5), i) + ":",
                                        "response": random_text(30 + 11 * (i % 3), 100 + i)}) + "\n"
                            for i in range(48)))
    run = tmp_path / "run"
    args = ["--model.name", f"hf:{model_dir}", "--data.kind", "sft", "--data.path", str(path),
            "--data.seq_len", "64", "--data.packing", "true", "--data.val_fraction", "0", "--train.max_steps", "6",
            "--train.eval_every", "0", "--train.micro_batch_size", "2", "--optim.lr", "3e-3", "--optim.schedule",
            "constant", "--optim.warmup_steps", "0", "--logging.every_steps", "1", "--logging.progress", "false",
            "--train.sample_tokens", "0", "--model.lora.r", "4", "--model.activation_checkpointing", "true",
            "--checkpoint.async", "true", "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "10",
            "--checkpoint.export", "false", "--strategy", fp32_json(tmp_path, "fsdp2"), "--train.run_dir", str(run)]
    run_train("torchrun", 2, args, env={"HF_HUB_OFFLINE": "1"})
    rows = [r for r in metrics(run) if "loss" in r]
    whole = {r["step"]: r["loss"] for r in rows}
    assert sorted(whole) == list(range(1, 7)) and whole[6] < whole[1]
    assert max(r["data/pad_fraction"] for r in rows) < 0.25, [r["data/pad_fraction"] for r in rows]
    assert (run / "checkpoints" / "step_00000004").is_dir()
    again = tmp_path / "again"
    shutil.copytree(run, again)
    run_train("torchrun", 2, [*args[:-1], str(again), "--resume", str(again / "checkpoints" / "step_00000004")],
              env={"HF_HUB_OFFLINE": "1"})
    assert {s: l for s, l in losses(again).items() if s > 4} == {5: whole[5], 6: whole[6]}
