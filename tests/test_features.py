"""The run's features, each one component (train/training/features.py): train.ema and
train.early_stop, launched for real.

EMA: its average is saved through the holder like the moments, so a resume continues it bit for
bit under DDP, ZeRO-2 and ZeRO-3 (the losses and the checkpoint's "ema" pieces of an interrupted
run equal an uninterrupted run's), and a 2-process checkpoint resumes on 1 process. The export
with checkpoint.export_weights ema writes the average (equal to the checkpoint's pieces).
Early stopping stops every rank at the same step, saves, exits 0, and resumes its patience.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import TINY, data_trace, fp32, metrics, run_train, train_losses, zero3_all_partitioned

pytestmark = pytest.mark.multiproc

EMA = [*TINY, "--train.global_batch_size", "8", "--train.max_steps", "8", "--train.eval_every", "4", "--checkpoint.every_steps", "4",
       "--checkpoint.save_at_end", "true", "--train.ema.decay", "0.8", "--train.ema.every_steps", "1"]


def _pieces(ckpt: Path, kind: str) -> dict[str, torch.Tensor]:
    """{parameter name: its whole flat tensor of `kind`} from every rank's files."""
    from zerotrain.train.checkpoint.files import PieceReader, read_json
    meta = read_json(ckpt / "meta.json", "meta")
    reader = PieceReader(sorted(ckpt.glob("rank*.safetensors")))
    try:
        return {n: reader.read(kind, n, 0, int(torch.Size(p["shape"]).numel()))
                for n, p in meta["params"].items() if p["trainable"]}
    finally:
        reader.close()


def _ds(tmp_path, name):
    return zero3_all_partitioned(tmp_path) if name == "zero3" else fp32(tmp_path, name)


@pytest.mark.parametrize("stage", ["ddp", "zero2", "zero3"])
def test_ema_resume_is_bit_identical(tmp_path, stage):
    ds = _ds(tmp_path, stage)
    whole, part = tmp_path / "whole", tmp_path / "part"
    run_train("torchrun", 2, [*EMA, "--ds-config", ds, "--train.run_dir", str(whole)])
    step4 = whole / "checkpoints" / "step_00000004"
    run_train("torchrun", 2, [*EMA, "--ds-config", ds, "--train.run_dir", str(part),
                              "--checkpoint.resume", str(step4)])
    assert {s: l for s, l in train_losses(whole).items() if s > 4} == train_losses(part)
    a, b = _pieces(whole / "checkpoints" / "step_00000008", "ema"), _pieces(part / "checkpoints" / "step_00000008", "ema")
    assert a.keys() == b.keys() and len(a) > 0
    assert all(torch.equal(a[n], b[n]) for n in a)
    # the average is not the weights: it trails them (decay 0.8 over 8 steps)
    params = _pieces(whole / "checkpoints" / "step_00000008", "param")
    assert any(not torch.equal(a[n], params[n]) for n in a)
    evals = [r for r in metrics(whole) if "val_ema/loss" in r]
    assert [r["step"] for r in evals] == [4, 8]
    meta = json.loads((step4 / "meta.json").read_text())
    assert meta["tensors"] == {"ema": "ema"} and meta["state"]["ema"]["updates"] == 4


def test_ema_resumes_on_another_world_size_and_exports_the_average(tmp_path):
    """A 2-process ZeRO-2 checkpoint resumed on 1 process: the average comes back whole (the
    step-4 pieces, read by any world size) and goes on; export_weights ema writes it."""
    ds = fp32(tmp_path, "zero2")
    two, one = tmp_path / "two", tmp_path / "one"
    run_train("torchrun", 2, [*EMA, "--ds-config", ds, "--train.run_dir", str(two), "--train.max_steps", "4"])
    step4 = two / "checkpoints" / "step_00000004"
    run_train("python", 1, [*EMA, "--ds-config", ds, "--train.run_dir", str(one), "--checkpoint.resume", str(step4),
                            "--train.max_steps", "4", "--checkpoint.export", "true",
                            "--checkpoint.export_dtype", "fp32", "--checkpoint.export_weights", "ema"])
    saved = _pieces(step4, "ema")
    again = _pieces(one / "checkpoints" / "step_00000004", "ema")  # the 1-process run saved what it resumed
    assert all(torch.equal(saved[n], again[n]) for n in saved)
    from safetensors.torch import load_file
    exported = {}
    for f in (one / "export").glob("*.safetensors"):
        exported.update(load_file(f))
    for n, t in saved.items():
        if n in exported:
            assert torch.equal(exported[n].reshape(-1), t), n
    assert sum(n in exported for n in saved) >= len(saved) - 1  # (a tied alias is written once)


def test_early_stop_stops_every_rank_at_the_same_step_and_resumes_its_patience(tmp_path):
    """min_delta 100: no evaluation after the first improves enough. Patience 2, evaluations at
    steps 2, 4, ...: a run to step 4 has one bad evaluation and ends normally; its resume stops
    at step 6 (the second bad one), on both ranks, saved, exit 0. Without the resumed count it
    would have stopped at step 8."""
    ds = fp32(tmp_path, "ddp")
    args = [*TINY, "--ds-config", ds, "--train.eval_every", "2", "--train.early_stop.patience", "2",
            "--train.early_stop.min_delta", "100", "--checkpoint.save_at_end", "true", "--debug.trace_data", "true"]
    first, second = tmp_path / "first", tmp_path / "second"
    run_train("torchrun", 2, [*args, "--train.max_steps", "4", "--train.run_dir", str(first)])
    assert not [r for r in metrics(first) if "stop/reason" in r]
    proc = run_train("torchrun", 2, [*args, "--train.max_steps", "20", "--train.run_dir", str(second),
                                     "--checkpoint.resume", str(first / "checkpoints" / "step_00000004")])
    stops = [r for r in metrics(second) if "stop/reason" in r]
    assert [(r["step"], r["stop/reason"]) for r in stops] == [(6, "early_stop")]
    assert "early stop at step 6: val/loss did not improve by more than 100 for 2 evaluations" in proc.stdout
    assert [max(r["step"] for r in data_trace(second, rank)) for rank in (0, 1)] == [5, 5]  # steps 5 and 6 (0-based)
    assert (second / "checkpoints" / "step_00000006" / "manifest.json").is_file()
    bad = [r["early_stop/bad_evals"] for r in metrics(second) if "early_stop/bad_evals" in r]
    assert bad == [2]


def test_ema_export_loads_in_transformers_with_the_ema_val_loss(tmp_path, corpus):
    """A tiny hf: Llama under ZeRO-2, checkpoint.export_weights ema: the export loads in
    transformers and reproduces the run's last val_ema/loss (not its val/loss)."""
    import math

    from transformers import AutoModelForCausalLM

    from helpers import SEQ, hf_val_loss, save_tiny
    src = save_tiny("llama", tmp_path / "llama", corpus["vocab"], tokenizer_dir=corpus["tok_dir"])
    run_dir = tmp_path / "run"
    run_train("torchrun", 2, [
        "--ds-config", fp32(tmp_path, "zero2"), "--model.name", f"hf:{src}", "--data.kind", "tokens",
        "--data.path", str(corpus["tokens"]), "--data.seq_len", str(SEQ), "--train.micro_batch_size", "4",
        "--train.max_steps", "12", "--train.eval_every", "0", "--train.eval_batches", "null", "--optim.lr", "3e-3",
        "--optim.warmup_steps", "2", "--logging.progress", "false", "--checkpoint.save_at_end", "false",
        "--checkpoint.export", "true", "--checkpoint.export_dtype", "fp32", "--train.ema.decay", "0.7",
        "--checkpoint.export_weights", "ema", "--train.run_dir", str(run_dir)], env={"HF_HUB_OFFLINE": "1"})
    last = {k: v for r in metrics(run_dir) for k, v in r.items() if k.startswith(("val/", "val_ema/"))}
    model = AutoModelForCausalLM.from_pretrained(str(run_dir / "export"), dtype=torch.float32,
                                                 local_files_only=True).eval()
    loss, n = hf_val_loss(model, corpus["tokens"])
    assert n == last["val_ema/samples"]
    assert math.isclose(loss, last["val_ema/loss"], rel_tol=1e-4), (loss, last)
    assert not math.isclose(last["val_ema/loss"], last["val/loss"], rel_tol=1e-3), last
