"""Checkpoints: exact resume, resume on another cluster with the optimizer moments, exported
weights, crash safety, damaged files, no unpickling. See docs/checkpoints.md.

Launches are shared through module-scoped fixtures (each costs ~20-45 s on 2 busy cores):

  ref_z3     2 procs ZeRO-3 fp32, dropout 0.1, 10 steps (3 per epoch), checkpoint every 2, fp32 export
    z3_exact   2 procs ZeRO-3 --resume step 2                          -> bit-identical losses
    ddp_crash  2 procs DDP --resume auto in a copy holding ZeRO-3 steps 2-4, SIGKILLed inside
               the step-10 save; then --resume auto again              -> matches ref / bit-identical
  ref_z2     2 procs ZeRO-2 bf16, 10 steps, checkpoint every 2, bf16 export
    z2_exact   2 procs ZeRO-2 bf16 --resume step 2                     -> bit-identical losses
    z2_to_z3   1 proc ZeRO-3 bf16 --resume step 4, unpickling forbidden -> matches ref closely
    z2_fresh   the same with checkpoint.load_optimizer false           -> clearly off
    z2_to_z1   1 proc ZeRO-1 bf16 (DeepSpeed's BF16_Optimizer fragments) --resume step 4
  init_from  1 proc ZeRO-2 fp32 from ref_z3's export, 4 steps, checkpoint every 2
    one_to_two 2 procs ZeRO-1 fp32 --resume its step 2                  -> continues it

ZeRO-3 partitions every matrix and the tied embedding here (the shipped JSON's "auto"
persistence threshold is 10 x d_model = 640 elements): the checkpoints hold real shards.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import REPO, TINY, ds_variant, metrics, rank_infos, run_train

STEPS = 10
BASE = [*TINY, "--data.max_bytes", "2000", "--train.max_steps", str(STEPS), "--optim.schedule", "constant",
        "--checkpoint.every_steps", "2", "--checkpoint.keep_last", "10"]
DROPOUT = ["--model.dropout", "0.1"]
ONE_PROC_SAME_BATCH = ["--train.global_batch_size", "8"]  # 4 x 2 procs = 4 x 2 accumulation steps


def export_args(dtype: str) -> list[str]:
    return ["--checkpoint.save_at_end", "true", "--checkpoint.export", "true", "--checkpoint.export_dtype", dtype,
            "--checkpoint.max_shard_size", "100KB"]


def ds_json(d: Path, base: str, bf16: bool) -> str:
    # Constant LR (no scheduler block): a fresh optimizer after resume shows clearly.
    changes = {} if bf16 else {"bf16": {"enabled": False}, "fp16": {"enabled": False}}
    return ds_variant(d, base, f"{base}_{'bf16' if bf16 else 'fp32'}_const", scheduler=None, **changes)


def launch(nproc: int, ds: str, run_dir: Path, *extra, check=True, env=None):
    return run_train("python" if nproc == 1 else "torchrun", nproc,
                     [*BASE, "--ds-config", ds, "--train.run_dir", str(run_dir), *extra], check=check, env=env)


def loss_runs(run_dir: Path) -> list[dict[int, float]]:
    """metrics.jsonl loss rows split into one {step: loss} per process launch (a resumed run
    in the same directory appends, restarting at an earlier step)."""
    runs, last = [{}], 0
    for r in metrics(run_dir):
        if "loss" not in r:
            continue
        if r["step"] <= last:
            runs.append({})
        runs[-1][r["step"]] = r["loss"]
        last = r["step"]
    return runs


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def max_diff(a: dict, b: dict, steps) -> float:
    return max(abs(a[s] - b[s]) for s in steps)


# ---------------------------------------------------------------------------- shared runs

@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def ref_z3(work):
    d = work / "ref_z3"
    p = launch(2, ds_json(work, "zero3", bf16=False), d, *DROPOUT, *export_args("fp32"), "--resume", "auto")
    return SimpleNamespace(dir=d, proc=p, losses=loss_runs(d)[0])


@pytest.fixture(scope="module")
def ref_z2(work):
    d = work / "ref_z2"
    p = launch(2, ds_json(work, "zero2", bf16=True), d, *export_args("bf16"))
    return SimpleNamespace(dir=d, proc=p, losses=loss_runs(d)[0])


@pytest.fixture(scope="module")
def ddp_crash(work, ref_z3):
    """DDP continues a ZeRO-3 run (--resume auto in a copy of its run dir cut back to step 4),
    is SIGKILLed inside its step-10 save, and is restarted with --resume auto."""
    KILL_ENV = "ZEROTRAIN_INJECT_KILL_IN_SAVE"  # train/testhooks.py "saved_file"
    d = work / "ddp"
    shutil.copytree(ref_z3.dir / "checkpoints", d / "checkpoints")
    for s in (6, 8, 10):
        shutil.rmtree(ckpt(d, s))  # `latest` still names step 10: auto falls back to the newest complete
    ds = ds_json(work, "ddp", bf16=False)
    args = [*DROPOUT, "--resume", "auto", "--checkpoint.save_at_end", "true"]
    crashed = launch(2, ds, d, *args, check=False, env={KILL_ENV: "10"})
    root = d / "checkpoints"
    after_crash = SimpleNamespace(entries=sorted(p.name for p in root.iterdir()),
                                  latest=(root / "latest").read_text().strip(), losses=loss_runs(d)[0])
    resumed = launch(2, ds, d, *args)
    return SimpleNamespace(dir=d, crashed=crashed, after_crash=after_crash, resumed=resumed,
                           resumed_losses=loss_runs(d)[1])


# ---------------------------------------------------------------------------- exact resume

@pytest.mark.multiproc
def test_zero3_resume_is_bit_identical_with_dropout_across_epochs(work, ref_z3):
    assert "--resume auto: no checkpoint" in ref_z3.proc.stdout  # a first run starts from scratch
    for info in rank_infos(ref_z3.dir):  # the checkpoint is made of shards, not whole replicated tensors
        z = info["zero3"]
        assert z["partitioned_tensors"] == 1 + 4 * 2 and z["held_elements"] <= z["partitioned_elements"] / 2 + 9
    meta2 = json.loads((ckpt(ref_z3.dir, 2) / "meta.json").read_text())
    assert meta2["holder"] == "zero3" and meta2["world_size"] == 2
    meta = json.loads((ckpt(ref_z3.dir, 2) / "meta.json").read_text())
    assert meta["data"]["steps_per_epoch"] == 3 and meta["train_state"]["offset"] == 16  # mid-epoch
    d = work / "z3_exact"
    p = launch(2, ds_json(work, "zero3", bf16=False), d, *DROPOUT, "--resume", str(ckpt(ref_z3.dir, 2)))
    assert "resumed from" in p.stdout
    resumed = loss_runs(d)[0]
    assert sorted(resumed) == list(range(3, STEPS + 1))
    # "epoch" is logged after the step: steps 3..10 finish epochs 0, 1 and 2.
    assert {r["epoch"] for r in metrics(d) if "loss" in r} == {1, 2, 3}
    assert resumed == {s: ref_z3.losses[s] for s in resumed}  # bit-identical, dropout included


@pytest.mark.multiproc
def test_zero2_bf16_resume_is_bit_identical(work, ref_z2):
    d = work / "z2_exact"
    launch(2, ds_json(work, "zero2", bf16=True), d, "--resume", str(ckpt(ref_z2.dir, 2)))
    resumed = loss_runs(d)[0]
    assert sorted(resumed) == list(range(3, STEPS + 1))
    assert resumed == {s: ref_z2.losses[s] for s in resumed}


# ---------------------------------------------------------------------------- crash + cross-stage

@pytest.mark.multiproc
def test_sigkill_during_save_keeps_previous_checkpoint_and_auto_resume_continues(ddp_crash):
    c = ddp_crash
    assert c.crashed.returncode != 0
    # The killed save left only its temporary directory; `latest` still names the last complete one.
    assert c.after_crash.entries == [".tmp-step_00000010", "latest", "step_00000002", "step_00000004",
                                     "step_00000006", "step_00000008"]
    assert c.after_crash.latest == "step_00000008"
    assert not (c.dir / "checkpoints" / ".tmp-step_00000010" / "manifest.json").exists()
    assert f"resumed from {ckpt(c.dir, 8)}" in c.resumed.stdout
    assert (ckpt(c.dir, 10) / "manifest.json").is_file()
    assert not any(p.name.startswith(".tmp") for p in (c.dir / "checkpoints").iterdir())
    # DDP -> DDP across the step-9 epoch boundary: bit-identical to the killed run's steps 9-10.
    assert c.resumed_losses == {s: c.after_crash.losses[s] for s in (9, 10)}


@pytest.mark.multiproc
def test_zero3_checkpoint_continues_under_ddp_with_moments(ddp_crash, ref_z3):
    # Same world size, so the restored RNG streams give the same dropout masks: only the
    # summation order differs between ZeRO-3 and DDP.
    first = ddp_crash.after_crash.losses
    assert sorted(first) == list(range(5, STEPS + 1))
    assert "[zero3]" in ddp_crash.crashed.stdout  # it really loaded the ZeRO-3 checkpoint
    assert max_diff(first, ref_z3.losses, first) < 1e-4


@pytest.mark.multiproc
def test_zero2_two_procs_to_zero3_one_proc_keeps_moments_and_never_unpickles(work, ref_z2):
    ds = ds_json(work, "zero3", bf16=True)
    log = work / "unpickle.log"
    guard = {"PYTHONPATH": str(REPO / "tests" / "nopickle"), "ZEROTRAIN_NOPICKLE_LOG": str(log)}
    moved = work / "z2_to_z3"
    p = launch(1, ds, moved, *ONE_PROC_SAME_BATCH, "--resume", str(ckpt(ref_z2.dir, 4)), env=guard)
    assert "[fragments]" in p.stdout and not log.exists(), log.read_text() if log.exists() else ""
    fresh = work / "z2_fresh"
    launch(1, ds, fresh, *ONE_PROC_SAME_BATCH, "--resume", str(ckpt(ref_z2.dir, 4)),
           "--checkpoint.load_optimizer", "false")
    steps = range(5, STEPS + 1)
    kept, restarted = loss_runs(moved)[0], loss_runs(fresh)[0]
    assert sorted(kept) == list(steps)
    err_kept, err_fresh = max_diff(kept, ref_z2.losses, steps), max_diff(restarted, ref_z2.losses, steps)
    # bf16 sums in another order on 1 process; fresh AdamW moments move the weights far more.
    assert err_kept < 2e-3, (kept, ref_z2.losses)
    assert err_fresh > 1e-2 and err_fresh > 10 * err_kept, (err_kept, err_fresh)


# ---------------------------------------------------------------------------- exported weights

def _gpt_from_export(d: Path):
    from zerotrain.models.gpt import GPT, GPTConfig
    cfg = json.loads((d / "config.json").read_text())
    assert cfg.pop("family") == "gpt"
    return GPT(GPTConfig.from_dict(cfg))


def _check_hf_layout(d: Path, dtype: torch.dtype):
    from safetensors.torch import load_file
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
    assert sorted(set(index["weight_map"].values())) == shards
    seen = {}
    for s in shards:  # safetensors alone reads every shard; every tensor is stored exactly once
        for k, v in load_file(d / s).items():
            assert k not in seen and v.dtype == dtype
            seen[k] = v
    assert set(seen) == set(index["weight_map"])
    assert "lm_head.weight" not in seen and index["metadata"]["lm_head.weight"] == "tok_emb.weight"
    model = _gpt_from_export(d)
    assert index["metadata"]["total_size"] == model.num_params() * dtype.itemsize  # the tie counted once
    return seen


def _offline_export(src: Path, out: Path, *args):
    from zerotrain.train.cli import main
    assert main(["export", str(src), str(out), *args]) == 0


@pytest.mark.multiproc
def test_zero3_export_equals_checkpoint_and_reproduces_the_runs_val_loss(work, ref_z3):
    from zerotrain.train.config import DataConfig
    from zerotrain.train.data import build_data
    from zerotrain.train.checkpoint.weights import load_weights
    live = ref_z3.dir / "export"
    tensors = _check_hf_layout(live, torch.float32)
    # DeepSpeed's own ZeRO-3 gather (live export) == the pieces every rank wrote (offline export).
    offline = work / "z3_offline"
    _offline_export(ckpt(ref_z3.dir, STEPS), offline, "--dtype", "fp32", "--max-shard-size", "100KB")
    assert all(torch.equal(v, _check_hf_layout(offline, torch.float32)[k]) for k, v in tensors.items())
    model = load_weights(_gpt_from_export(live), live).eval()
    assert model.lm_head.weight is model.tok_emb.weight
    assert torch.equal(model.lm_head.weight, tensors["tok_emb.weight"])
    # The exported weights are the ones the run evaluated at the end.
    val = build_data(DataConfig(max_bytes=2000), 64, 1234).val
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(b["input_ids"][None])[0], b["labels"]).item() for b in val]
    final_val = [r["val/loss"] for r in metrics(ref_z3.dir) if "val/loss" in r][-1]
    assert abs(sum(losses) / len(losses) - final_val) < 1e-4


@pytest.mark.multiproc
def test_zero2_bf16_export_ties_once_and_matches_offline_export(work, ref_z2):
    from zerotrain.models.gpt import GPT
    from zerotrain.train.checkpoint.weights import load_weights
    live = ref_z2.dir / "export"
    tensors = _check_hf_layout(live, torch.bfloat16)
    offline = work / "z2_offline"
    _offline_export(ref_z2.dir, offline)  # a run dir: its newest checkpoint, the run's dtype and shard size
    assert all(torch.equal(v, _check_hf_layout(offline, torch.bfloat16)[k]) for k, v in tensors.items())
    model = load_weights(_gpt_from_export(live), live)
    assert model.lm_head.weight is model.tok_emb.weight
    # Weights saved untied by someone else's model still load: the alias is re-tied.
    untied = _gpt_from_export(live)
    untied.lm_head.weight = torch.nn.Parameter(torch.zeros_like(untied.lm_head.weight))
    assert isinstance(load_weights(untied, live), GPT) and untied.lm_head.weight is untied.tok_emb.weight


@pytest.fixture(scope="module")
def init_from(work, ref_z3):
    """1 process, ZeRO-2 fp32, starting from ref_z3's exported weights; checkpoints at steps 2, 4."""
    d = work / "init_from"
    launch(1, ds_json(work, "zero2", bf16=False), d, *ONE_PROC_SAME_BATCH, "--train.max_steps", "4",
           "--model.init_from", str(ref_z3.dir / "export"))
    return SimpleNamespace(dir=d, losses=loss_runs(d)[0])


@pytest.mark.multiproc
def test_init_from_exported_weights_trains_on_from_there(init_from, ref_z3):
    losses = init_from.losses
    # From scratch the first loss is ~ln(256) = 5.5; the exported weights had reached ~3.9. The
    # second step shows the fp32 master weights were loaded too (not only the module's copy).
    assert ref_z3.losses[1] > 5.3 and losses[1] < 4.3 and losses[2] < 4.3, losses


@pytest.mark.multiproc
def test_one_process_checkpoint_resumes_on_two_into_zero1_fragments(work, init_from):
    """1 -> 2 processes, ZeRO-2 -> ZeRO-1: each rank reads only its own fragment of every
    flat partition; the continuation is the 1-process run's, up to summation order (fp32)."""
    d = work / "one_to_two"
    p = launch(2, ds_json(work, "zero1", bf16=False), d, "--train.max_steps", "4", "--resume",
               str(ckpt(init_from.dir, 2)))
    assert "saved by 1 process(es) [fragments]" in p.stdout
    got = loss_runs(d)[0]
    assert sorted(got) == [3, 4]
    assert max_diff(got, init_from.losses, (3, 4)) < 1e-4, (got, init_from.losses)


@pytest.mark.multiproc
def test_two_process_zero2_checkpoint_resumes_on_one_into_bf16_zero1(work, ref_z2):
    """2 -> 1 process, ZeRO-2 -> ZeRO-1 with bf16 (fp32 accumulation: DeepSpeed's BF16_Optimizer,
    whose fp32 partition is one fragment per parameter at world size 1), moments kept."""
    d = work / "z2_to_z1"
    p = launch(1, ds_json(work, "zero1", bf16=True), d, *ONE_PROC_SAME_BATCH, "--resume", str(ckpt(ref_z2.dir, 4)))
    assert "[fragments]" in p.stdout
    got = loss_runs(d)[0]
    assert sorted(got) == list(range(5, STEPS + 1))
    assert max_diff(got, ref_z2.losses, got) < 2e-3, (got, ref_z2.losses)


# ---------------------------------------------------------------------------- damaged checkpoints

def _damaged_copies(src: Path, dst: Path):
    """A copy with one rank-1 file truncated, and one with a byte of a rank-0 file flipped."""
    truncated, altered = dst / "truncated" / src.name, dst / "altered" / src.name
    for c in (truncated, altered):
        shutil.copytree(src, c)
    cut = sorted(truncated.glob("rank00001*.safetensors"))[0]
    cut.write_bytes(cut.read_bytes()[:-100])
    flip = sorted(altered.glob("rank00000*.safetensors"))[-1]
    data = bytearray(flip.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flip.write_bytes(bytes(data))
    return (truncated, cut, "truncated"), (altered, flip, "checksum")


@pytest.mark.multiproc
def test_damaged_checkpoint_is_refused_naming_the_file(work, ref_z2, capsys):
    # `zerotrain export` runs the same verify() as a resume (there each rank hashes a share of the files).
    from zerotrain.train.cli import main
    for c, damaged, why in _damaged_copies(ckpt(ref_z2.dir, 2), work / "damaged"):
        with pytest.raises(SystemExit) as e:
            main(["export", str(c), str(work / "never")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"is damaged: {damaged}" in err and why in err, err
    assert not (work / "never").exists()


# ---------------------------------------------------------------------------- units (no launch)

def test_piece_reader_reassembles_any_range_and_names_holes(tmp_path):
    from zerotrain.train.checkpoint import files as io
    from zerotrain.train.errors import CheckpointError
    full = torch.arange(12, dtype=torch.float32)
    io.save_tensors({io.piece_key("param", "w", 0): full[:5].clone()}, tmp_path / "a.safetensors")
    io.save_tensors({io.piece_key("param", "w", 5): full[5:].clone()}, tmp_path / "b.safetensors")
    r = io.PieceReader([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert torch.equal(r.read("param", "w", 3, 9), full[3:9]) and torch.equal(r.read("param", "w", 0, 12), full)
    r.close()
    r = io.PieceReader([tmp_path / "b.safetensors"])
    with pytest.raises(CheckpointError, match=r"no data for elements \[0, 5\) of param w"):
        r.read("param", "w", 0, 12)
    r.close()


def test_rng_state_round_trips_through_json():
    import random

    import numpy as np
    from zerotrain.train.checkpoint import files as io
    s = json.loads(json.dumps(io.rng_state()))
    a = (random.random(), np.random.rand(), torch.rand(3))
    io.set_rng_state(s)
    b = (random.random(), np.random.rand(), torch.rand(3))
    assert a[0] == b[0] and a[1] == b[1] and torch.equal(a[2], b[2])


def test_checkpoint_resolution_prefers_latest_and_skips_incomplete(tmp_path):
    from zerotrain.train.checkpoint import files as io
    from zerotrain.train.errors import CheckpointError
    root = tmp_path / "run" / "checkpoints"
    for step, complete in ((2, True), (4, True), (6, True), (8, False)):
        d = root / io.step_dir_name(step)
        d.mkdir(parents=True)
        if complete:
            (d / io.MANIFEST).write_text("{}")
    assert io.resolve_checkpoint(tmp_path / "run") == root / "step_00000006"
    (root / "latest").write_text("step_00000004\n")  # a run resumed from step 4 and saved it again
    assert io.newest_checkpoint(root) == root / "step_00000004"
    with pytest.raises(CheckpointError, match="incomplete"):
        io.resolve_checkpoint(root / "step_00000008")
    with pytest.raises(CheckpointError, match="does not exist"):
        io.resolve_checkpoint(tmp_path / "nope")


def test_shape_mismatch_lists_missing_extra_and_resized_names():
    from zerotrain.train.checkpoint.load import shape_mismatch
    assert shape_mismatch({"a": (2,)}, {"a": [2]}, "model", "weights") is None
    msg = shape_mismatch({"a": (2,), "b": (3, 4), "c": (1,)}, {"a": (2,), "b": (3, 8), "d": (5,)}, "model", "weights")
    assert "in model only (1):\n    c" in msg and "in weights only (1):\n    d" in msg
    assert "b: model [3, 4] vs weights [3, 8]" in msg


def test_max_shard_size_is_validated():
    from zerotrain.train.config import CheckpointConfig
    from zerotrain.train.errors import ConfigError
    assert CheckpointConfig(max_shard_size="500MB").max_shard_size == "500MB"
    with pytest.raises(ConfigError, match="max_shard_size"):
        CheckpointConfig(max_shard_size="lots")


def test_version_1_meta_is_read_as_the_engine_component():
    """A checkpoint of format version 1 kept the engine's counters and fp16 scaler at meta.json's
    top level; version 2 keeps {name: state} of the registered components. Both give the "engine"
    component the same record (a launched v1 -> v2 resume: the closing note of issue 36)."""
    from zerotrain.train.checkpoint.files import VERSION, component_states
    counters = {"global_steps": 4, "global_samples": 32, "skipped_steps": 1}
    scaler = {"kind": "deepspeed", "cur_scale": 1024.0, "cur_iter": 4, "last_overflow_iter": 2, "cur_hysteresis": 2}
    v1 = {"version": 1, "train_state": {"step": 4}, "engine": counters, "loss_scaler": scaler}
    v2 = {"version": 2, "train_state": {"step": 4}, "state": {"engine": {"counters": counters, "loss_scaler": scaler}}}
    assert VERSION == 2
    assert component_states(v1) == component_states(v2) == {"engine": {"counters": counters, "loss_scaler": scaler}}
    assert component_states({"version": 1, "engine": None, "loss_scaler": None}) == {
        "engine": {"counters": None, "loss_scaler": None}}  # DDP without fp16: nothing, as before


def test_registered_components_are_saved_and_restored_by_name(tmp_path):
    """The Checkpointer keeps {name: state_dict()} of what is registered and hands each its record
    back after the TrainState, without knowing what the component is."""
    from zerotrain.train.checkpoint.manager import Checkpointer
    from zerotrain.train.checkpoint.state import TrainState

    class Counter:
        def __init__(self):
            self.n, self.at = 0, None

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, state, at):
            self.n, self.at = state.get("n", -1), at.step

    engine = SimpleNamespace(state_dict=lambda: {"counters": {"global_steps": 3}}, loaded=[])
    engine.load_state_dict = lambda state, at: engine.loaded.append((state, at.step))
    c = Checkpointer.__new__(Checkpointer)
    c.registered = {}
    c.register("engine", engine)
    mine = Counter()
    mine.n = 5
    c.register("counter", mine)
    with pytest.raises(ValueError, match="counter"):
        c.register("counter", Counter())
    saved = {name: comp.state_dict() for name, comp in c.registered.items()}
    assert saved == {"engine": {"counters": {"global_steps": 3}}, "counter": {"n": 5}}
    mine.n = 0
    st = c._restore_counters({"train_state": {**TrainState(step=3).to_dict(), "unknown_later_field": 1},
                              "state": saved})
    assert st == TrainState(step=3) and (mine.n, mine.at) == (5, 3)
    assert engine.loaded == [({"counters": {"global_steps": 3}}, 3)]
    fresh = Counter()  # registered after the checkpoint was written: gets {} and keeps its start
    c.registered = {"counter": fresh}
    c._restore_counters({"train_state": TrainState(step=3).to_dict(), "state": {"engine": {}}})
    assert fresh.n == -1 and fresh.at == 3


def test_the_same_weights_are_written_to_the_same_bytes(tmp_path):
    """safetensors' save_file writes the header's metadata in the order of a Rust HashMap seeded
    afresh for every map: an export with tied weights (several metadata keys) differed from one
    save to the next in that order alone (8 saves here gave 8 different files). The writer every
    checkpoint and export goes through sorts it; the file still loads with its metadata."""
    import hashlib

    from safetensors import safe_open

    from zerotrain.train.checkpoint import files
    meta = {"format": "pt", **{f"alias{i}.weight": "tok_emb.weight" for i in range(5)}}
    tensors = {"tok_emb.weight": torch.arange(6.0).reshape(2, 3)}
    digests = set()
    for i in range(8):
        path = tmp_path / f"model{i}.safetensors"
        files.write_safetensors(tensors, path, meta)
        digests.add(hashlib.sha256(path.read_bytes()).hexdigest())
    assert len(digests) == 1
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == meta and torch.equal(f.get_tensor("tok_emb.weight"), tensors["tok_emb.weight"])
