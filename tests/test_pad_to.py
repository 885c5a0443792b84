"""data.pad_to (data.kind sft without packing): "longest" pads each micro-batch only to its
longest record, rounded up to a multiple of 64, "seq_len" every sample to data.seq_len. The
same records in the same order, and the same loss per step."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest
import torch
from helpers import data_trace, fp32, metrics, run_train

from zerotrain.models.losses import IGNORE_INDEX
from zerotrain.train.config import DataConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.sampler import GlobalBatchSampler
from zerotrain.train.data.sft import PAD_MULTIPLE, LongestPadding, fixed_length_reason, pad_sample
from zerotrain.train.errors import ConfigError

SEQ = 256


def heavy_tailed(n: int, seed: int) -> list[dict]:
    """Mostly short records, a few long ones (cut at seq_len): the case that pads most."""
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "zeta", "theta", "kappa", "sigma", "omega", "lambda"]
    say = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    out = []
    for i in range(n):
        long = rng.random() < 0.1
        out.append({"prompt": f"{i}: " + say(rng.randint(1, 6) if not long else rng.randint(10, 25)),
                    "response": say(rng.randint(1, 5) if not long else rng.randint(10, 40))})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def sft(path: Path, pad_to: str):
    return build_data(DataConfig(kind="sft", path=str(path), seq_len=SEQ, val_fraction=0.1, pad_to=pad_to), SEQ, 0)


def test_pad_to_takes_longest_or_seq_len_only():
    with pytest.raises(ConfigError, match='data.pad_to must be one of longest, seq_len'):
        DataConfig(kind="sft", path="x.jsonl", pad_to="max")
    assert DataConfig(kind="sft", path="x.jsonl").pad_to == "longest"


def test_longest_batches_are_the_fixed_batches_without_their_common_pad_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", heavy_tailed(200, 0))
    fixed, longest = sft(path, "seq_len"), sft(path, "longest")
    assert "padded to each batch's longest record (a multiple of 64, at most 256)" in longest.describe
    assert "padded to 256" in fixed.describe
    view = LongestPadding(longest.train)
    sampler = GlobalBatchSampler(len(fixed.train), micro=8, world=1, accum=1, seed=3)
    lengths = []
    for rows in list(sampler)[:20]:
        a = torch.utils.data.default_collate([fixed.train[i] for i in rows])
        b = view.collate([view[i] for i in rows])
        T = b["input_ids"].size(1)
        longest_record = max(int(view[i]["input_ids"].numel()) for i in rows)
        assert T % PAD_MULTIPLE == 0 and longest_record <= T <= SEQ and T - longest_record < PAD_MULTIPLE
        assert torch.equal(a["input_ids"][:, :T], b["input_ids"]) and torch.equal(a["labels"][:, :T], b["labels"])
        assert (a["labels"][:, T:] == IGNORE_INDEX).all() and (a["input_ids"][:, T:] == fixed.train.pad).all()
        lengths.append(T)
    assert min(lengths) < SEQ and {64, 128} & set(lengths), lengths  # short batches really are shorter
    pads = lambda T: sum(1 - (int(view[i]["input_ids"].numel()) / T) for i in range(len(view)))  # noqa: E731
    assert pads(SEQ) / len(view) > 0.6  # the data pads heavily at seq_len


def test_a_run_that_needs_one_length_keeps_seq_len():
    assert fixed_length_reason(1, False, False, False) is None
    assert "sequence parallelism" in fixed_length_reason(2, False, False, False)
    assert "hardware.compile" in fixed_length_reason(1, True, False, False)
    assert "aux loss" in fixed_length_reason(1, False, True, False)
    assert "own loss" in fixed_length_reason(1, False, False, True)


def _crc_to_record(ds, lengths) -> dict[int, int]:
    """crc32 of a traced row (debug.trace_data: the input_ids row as trained) -> record index."""
    out = {}
    for i in range(len(ds)):
        rec = ds.record(i)
        for T in lengths:
            if rec["input_ids"].numel() <= T:
                out[zlib.crc32(pad_sample(rec, T, ds.pad)["input_ids"].numpy().tobytes())] = i
    return out


@pytest.mark.multiproc
def test_longest_padding_trains_the_same_records_to_the_same_losses(tmp_path):
    """Two ranks, ZeRO-2 fp32, micro 4 x accum 2: data.pad_to longest against seq_len gives the
    same records per step on each rank, the same step losses and validation loss (to fp32
    rounding: only the shapes of the matmuls differ), and batches shorter than seq_len. A resume
    from the longest run's step-3 checkpoint continues with its exact losses."""
    path = write_jsonl(tmp_path / "d.jsonl", heavy_tailed(240, 1))
    base = ["--model.name", "gpt-tiny", "--model.seq_len", str(SEQ), "--data.kind", "sft", "--data.path", str(path),
            "--data.seq_len", str(SEQ), "--data.val_fraction", "0.1", "--ds-config", fp32(tmp_path, "zero2"),
            "--train.micro_batch_size", "4", "--train.grad_accum_steps", "2", "--train.max_steps", "6",
            "--train.eval_every", "3", "--train.eval_batches", "null", "--train.sample_tokens", "0",
            "--optim.lr", "3e-3", "--optim.warmup_steps", "1", "--logging.progress", "false",
            "--logging.every_steps", "1", "--checkpoint.export", "false", "--checkpoint.save_at_end", "false",
            "--debug.trace_data", "true", "--checkpoint.every_steps", "3"]
    runs = {}
    for pad_to in ("seq_len", "longest"):
        run_dir = tmp_path / pad_to
        proc = run_train("torchrun", 2, [*base, "--data.pad_to", pad_to, "--train.run_dir", str(run_dir)])
        runs[pad_to] = (run_dir, proc.stdout)
    assert "padded to each batch's longest record" in runs["longest"][1]
    assert {k: json.loads((d / "config.json").read_text())["resolved"]["pad_to"] for k, (d, _) in runs.items()} == \
        {"seq_len": "seq_len", "longest": "longest"}
    rows = {k: metrics(d) for k, (d, _) in runs.items()}
    loss = {k: [r["loss"] for r in v if "loss" in r] for k, v in rows.items()}
    val = {k: [r["val/loss"] for r in v if "val/loss" in r] for k, v in rows.items()}
    assert len(loss["longest"]) == 6 and len(val["longest"]) == 2
    print("max |loss longest - loss seq_len|:", max(abs(a - b) for a, b in zip(loss["longest"], loss["seq_len"])))
    assert loss["longest"] == pytest.approx(loss["seq_len"], rel=1e-5, abs=1e-6), loss
    assert val["longest"] == pytest.approx(val["seq_len"], rel=1e-5, abs=1e-6), val
    resumed = tmp_path / "resumed"
    run_train("torchrun", 2, [*base, "--train.run_dir", str(resumed),
                              "--resume", str(runs["longest"][0] / "checkpoints" / "step_00000003")])
    assert [r["loss"] for r in metrics(resumed) if "loss" in r] == loss["longest"][3:]
    # The same records per step on each rank, read back from the traced rows.
    train = sft(path, "longest").train
    ids = {"seq_len": _crc_to_record(train, [SEQ]), "longest": _crc_to_record(train, range(64, SEQ + 1, 64))}
    full = set(ids["seq_len"])
    for rank in range(2):
        order = {k: [(r["step"], [ids[k][c] for c in r["crc"]]) for r in data_trace(d, rank)]
                 for k, (d, _) in runs.items()}
        assert order["longest"] == order["seq_len"] and len(order["seq_len"]) == 6 * 2
        # many micro-batches ran shorter than seq_len (a row of seq_len columns has a full-length crc)
        short = [c not in full for r in data_trace(runs["longest"][0], rank) for c in r["crc"]]
        assert sum(short) >= len(short) // 4, short
    # tokens_per_s counts the real tokens of both ranks' rows, data/pad_fraction the rows as
    # built (each micro-batch padded to its own longest record): summed over the ranks.
    rows_T = {k: {c: T for T in (range(64, SEQ + 1, 64) if k == "longest" else [SEQ])
                  for c in _crc_to_record(train, [T])} for k in runs}
    for k, (d, _) in runs.items():
        real, built = {}, {}
        for rank in range(2):
            for r in data_trace(d, rank):
                step = r["step"] + 1
                real[step] = real.get(step, 0) + sum(train.record(ids[k][c])["input_ids"].numel() for c in r["crc"])
                built[step] = built.get(step, 0) + sum(rows_T[k][c] for c in r["crc"])
        logged = [r for r in rows[k] if "loss" in r]
        for r in logged:
            assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(real[r["step"]], rel=1e-9), (k, r)
            assert r["data/pad_fraction"] == pytest.approx(1 - real[r["step"]] / built[r["step"]], rel=1e-9), (k, r)
        assert k == "seq_len" or any(built[s] < 8 * 2 * SEQ for s in built), built  # shorter than seq_len rows


# ----------------------------------------------------------------------------- preference pairs

def preference_pairs(n: int, seed: int) -> list[dict]:
    """heavy_tailed's records as pairs: a short rejected response beside each chosen one."""
    rng = random.Random(seed)
    return [{"prompt": r["prompt"], "chosen": r["response"], "rejected": r["response"][::-1] + f" {rng.randint(0, 9)}"}
            for r in heavy_tailed(n, seed)]


def test_preference_pad_to_takes_longest_or_seq_len_and_not_with_packing():
    assert DataConfig(kind="preference", path="x.jsonl").pad_to == "seq_len"
    assert DataConfig(kind="preference", path="x.jsonl", pad_to="longest").pad_to == "longest"
    with pytest.raises(ConfigError, match='data.pad_to must be one of longest, seq_len'):
        DataConfig(kind="preference", path="x.jsonl", pad_to="max")
    with pytest.raises(ConfigError, match="data.pad_to longest does not apply with data.packing true .* set one"):
        DataConfig(kind="preference", path="x.jsonl", pad_to="longest", packing=True)


def test_longest_pairs_are_the_fixed_pairs_without_their_common_pad_columns(tmp_path):
    from zerotrain.train.data.preference import LongestPairs
    path = write_jsonl(tmp_path / "p.jsonl", preference_pairs(120, 0))
    make = lambda pad_to: build_data(DataConfig(kind="preference", path=str(path), seq_len=SEQ,  # noqa: E731
                                                val_fraction=0.1, pad_to=pad_to), SEQ, 0)
    fixed, longest = make("seq_len"), make("longest")
    assert "padded to each batch's longest sequence (a multiple of 64, at most 256)" in longest.describe
    assert "chosen and rejected padded to 256" in fixed.describe
    view = LongestPairs(longest.train)
    keys = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")
    lengths = []
    for rows in list(GlobalBatchSampler(len(fixed.train), micro=4, world=1, accum=1, seed=3))[:15]:
        a = torch.utils.data.default_collate([fixed.train[i] for i in rows])
        b = view.collate([view[i] for i in rows])
        T = b["chosen_input_ids"].size(1)
        assert all(b[k].size(1) == T for k in keys)  # one length for both sides: one forward
        longest_seq = max(int(view[i][k].numel()) for i in rows for k in ("chosen_input_ids", "rejected_input_ids"))
        assert T % PAD_MULTIPLE == 0 and longest_seq <= T <= SEQ and T - longest_seq < PAD_MULTIPLE
        for k in keys:
            assert torch.equal(a[k][:, :T], b[k]), k
        assert (a["chosen_labels"][:, T:] == IGNORE_INDEX).all() and (a["rejected_labels"][:, T:] == IGNORE_INDEX).all()
        lengths.append(T)
    assert min(lengths) < SEQ and {64, 128} & set(lengths), lengths  # short batches really are shorter


def test_preference_longest_padding_trains_to_the_seq_len_losses(tmp_path, clean_env, fresh_accelerate):
    """DPO in-process, fp32 DDP on one process, micro 4 x accum 2: data.pad_to longest against
    seq_len gives the same step losses, rewards and validation loss to fp32 rounding (only the
    matmuls' shapes differ; measured |diff| printed), while the forwards ran on fewer positions:
    most micro-batches on rows shorter than seq_len."""
    from accelerate.state import AcceleratorState

    from zerotrain.models.workload import Workload
    from zerotrain.train.main import main
    path = write_jsonl(tmp_path / "p.jsonl", preference_pairs(64, 1))
    widths: dict[str, list] = {}
    logits = Workload.logits

    def run(pad_to: str) -> list[dict]:
        seen = widths.setdefault(pad_to, [])

        def recording(self, model, batch):
            if torch.is_grad_enabled():  # the policy's training forwards (not the reference, not evaluation)
                seen.append(batch["input_ids"].shape[-1])
            return logits(self, model, batch)
        Workload.logits = recording
        AcceleratorState._reset_state(reset_partial_state=True)  # each main() starts its own, as a launch does
        try:
            run_dir = tmp_path / pad_to
            assert main(["--model.name", "gpt-tiny", "--model.seq_len", str(SEQ), "--data.kind", "preference",
                         "--data.path", str(path), "--data.seq_len", str(SEQ), "--data.val_fraction", "0.125",
                         "--data.pad_to", pad_to, "--train.objective", "dpo", "--train.max_steps", "4",
                         "--train.micro_batch_size", "4", "--train.grad_accum_steps", "2", "--train.eval_every", "2",
                         "--train.sample_tokens", "0", "--optim.lr", "3e-3", "--optim.warmup_steps", "1",
                         "--logging.progress", "false", "--logging.every_steps", "1", "--logging.trackers", "jsonl",
                         "--checkpoint.save_at_end", "false", "--checkpoint.export", "false",
                         "--train.run_dir", str(run_dir), "--ds-config", fp32(tmp_path, "ddp")]) == 0
        finally:
            Workload.logits = logits
        return metrics(run_dir)
    rows = {k: run(k) for k in ("seq_len", "longest")}
    assert set(widths["seq_len"]) == {SEQ} and len(widths["longest"]) == len(widths["seq_len"]) == 8, widths
    short = [w for w in widths["longest"] if w < SEQ]
    assert len(short) >= len(widths["longest"]) // 2 and sum(widths["longest"]) < sum(widths["seq_len"]), widths
    for key in ("loss", "val/loss", "rewards/margins"):
        got = {k: [r[key] for r in v if key in r] for k, v in rows.items()}
        assert got["seq_len"], key
        print(key, "max |longest - seq_len|:", max(abs(a - b) for a, b in zip(got["longest"], got["seq_len"])))
        assert got["longest"] == pytest.approx(got["seq_len"], rel=1e-5, abs=1e-6), (key, got)
