"""tokens_per_s and data/pad_fraction count what ran: tokens_per_s the real (non-pad) tokens the
model's training forwards ran on, data/pad_fraction the padding of the batches as built, for
every layout of padded data: sft rows packed, sft rows padded per batch (data.pad_to longest),
preference pairs as padded rows (to seq_len, or per batch) and packed. Each run logs every step;
the forwards' inputs are recorded in the process and the two metrics are checked against them."""

from __future__ import annotations

import json
import random

import pytest
import torch
from helpers import fp32, metrics

from zerotrain.models.workload import Workload


def _records(n: int, seed: int, preference: bool) -> str:
    """Byte-level records of varied lengths (no NUL: the byte pad id is 0, so a real input token
    is a non-zero id)."""
    rng = random.Random(seed)
    word = lambda k: "".join(rng.choice("abcdefgh") for _ in range(k))  # noqa: E731
    out = []
    for i in range(n):
        rec = {"prompt": f"{i}:{word(rng.randint(1, 6))}", "chosen": word(rng.randint(2, 20))} if preference else \
            {"prompt": f"{i}:{word(rng.randint(1, 6))}", "response": word(rng.randint(2, 40))}
        if preference:
            rec["rejected"] = word(rng.randint(2, 20)) + "x"
        out.append(json.dumps(rec))
    return "\n".join(out) + "\n"


@pytest.fixture
def forwards(monkeypatch):
    """The input_ids of every training forward (gradients on: not evaluation, not the DPO
    reference), in order."""
    seen: list[torch.Tensor] = []
    logits = Workload.logits

    def recording(self, model, batch):
        if torch.is_grad_enabled():
            seen.append(batch["input_ids"].detach().cpu().clone())
        return logits(self, model, batch)
    monkeypatch.setattr(Workload, "logits", recording)
    return seen


LAYOUTS = {
    # name: (data.kind, seq_len, extra flags)
    "sft packed": ("sft", 64, ["--data.packing", "true"]),
    "sft padded per batch": ("sft", 256, ["--data.pad_to", "longest"]),
    "preference pairs": ("preference", 64, ["--train.objective", "dpo"]),
    "preference pairs packed": ("preference", 64, ["--train.objective", "dpo", "--data.packing", "true"]),
    "preference pairs padded per batch": ("preference", 256, ["--train.objective", "dpo", "--data.pad_to", "longest"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tokens_per_s_and_pad_fraction_count_the_batches_that_ran(layout, tmp_path, forwards, clean_env, fresh_accelerate):
    from zerotrain.train.main import main
    kind, seq, extra = LAYOUTS[layout]
    data = tmp_path / "d.jsonl"
    data.write_text(_records(96, 7, kind == "preference"))
    run = tmp_path / "run"
    steps, accum = 3, 2
    assert main(["--model.name", "gpt-tiny", "--model.seq_len", str(seq), "--data.kind", kind,
                 "--data.path", str(data), "--data.seq_len", str(seq), "--data.val_fraction", "0",
                 *extra, "--train.max_steps", str(steps), "--train.micro_batch_size", "4",
                 "--train.grad_accum_steps", str(accum), "--train.eval_every", "0", "--train.sample_tokens", "0",
                 "--logging.progress", "false", "--logging.every_steps", "1", "--logging.trackers", "jsonl",
                 "--checkpoint.save_at_end", "false", "--checkpoint.export", "false",
                 "--train.run_dir", str(run), "--ds-config", fp32(tmp_path, "ddp")]) == 0
    rows = [r for r in metrics(run) if "loss" in r]
    assert len(rows) == steps and len(forwards) == steps * accum, (len(rows), len(forwards))
    built_seen = set()
    for s, row in enumerate(rows):
        ran = forwards[s * accum:(s + 1) * accum]
        real = sum(int((ids != 0).sum()) for ids in ran)     # real input tokens of the step's forwards
        built = sum(ids.numel() for ids in ran)              # the positions they ran on, padding included
        built_seen |= {ids.shape[-1] for ids in ran}
        assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(real, rel=1e-9), (layout, s, row)
        assert row["data/pad_fraction"] == pytest.approx(1 - real / built, rel=1e-9, abs=1e-12), (layout, s, row)
    if layout in ("sft padded per batch", "preference pairs padded per batch"):
        assert max(built_seen) < seq, built_seen  # the batches really were shorter than seq_len
    if layout == "preference pairs packed":
        # fewer rows than the 2 x micro-batch padded rows: packing changed what ran
        assert all(ids.shape[0] < 2 * 4 for ids in forwards), [ids.shape for ids in forwards]
