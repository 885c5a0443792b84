"""A refusal names the sequence parallelism that would fit (train/plan/sp_fit.py): the memory check,
--ds-config auto and `zerotrain plan`, in-process on chosen budgets, no launch.

The run: gpt-tiny at 4096 tokens, one sample per micro-batch, in bf16 (the shipped JSONs). Its
model states are under 1 MiB and one sequence's activations 41.7 MiB, so the activations are
what does not fit. The expected N comes from the activation model (activation_bytes, checked
against autograd's saved tensors in tests/test_plan.py) and the all-to-all buffers, by hand."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from zerotrain.train.observe.report import human_bytes as hb
from zerotrain.train.plan.activations import activation_bytes
from zerotrain.train.plan.shapes import BatchShape

MiB = 2 ** 20
T = 4096
MARGIN = 0.9   # distributed.memory_margin 0.1 kept free


def gpt(kv: int = 4):
    from zerotrain.models.gpt import preset
    return preset("gpt-tiny", seq_len=T, n_kv_head=kv)


def hand(n: int, kv: int = 4) -> tuple[int, int]:
    """(activations per rank with sequence parallelism n, its all-to-all buffers): every saved
    activation is per token, so 1/n of the one-rank figure; q, k, v of one layer are sent and
    received, 2 x (d + 2 kv) bf16 elements per local token."""
    g = gpt(kv)
    whole = activation_bytes(g, BatchShape(1, T, 1, False), 2)
    assert whole % n == 0
    return whole // n, 2 * 2 * (T // n) * (g.d_model + 2 * g.n_kv_head * g.head_dim)


@pytest.fixture(scope="module")
def long_run():
    from zerotrain.models import resolve
    from zerotrain.train.config import load_config
    from zerotrain.train.data import build_data

    def make(kv=4, seq=T, sp=1, compile=False):
        cfg = load_config(None, [("model.name", "gpt-tiny"), ("model.seq_len", str(T)), ("model.n_kv_head", str(kv)),
                                 ("data.seq_len", str(seq)), ("data.max_bytes", "300000"),
                                 ("train.micro_batch_size", "1"), ("distributed.sequence_parallel", str(sp)),
                                 ("hardware.compile", str(compile).lower())])
        return cfg, resolve(cfg.model), build_data(cfg.data, seq, cfg.train.seed)
    return make


def budget(mib: float, kind: str = "cuda"):
    from zerotrain.train.launch.device_memory import Budget
    return Budget(int(mib * MiB), "a test budget", kind, 0)


def refusal(run, world: int, mib: float, ds: str = "zero3", kind: str = "cuda") -> str:
    """The memory check's one line for the run under ds_configs/<ds>.json."""
    from zerotrain.train.strategy.ds_config import load_ds_setup
    from zerotrain.train.plan import memory_check
    cfg, spec, data = run
    batch = cfg.train.batch(world // cfg.distributed.sequence_parallel)
    setup = load_ds_setup(f"ds_configs/{ds}.json", cfg, batch, 3, cuda=False, hidden_size=64)
    with pytest.raises(memory_check.DoesNotFit) as e:
        memory_check.require_fit(cfg, spec, setup, data, batch, cfg.data.seq_len, world, budget(mib, kind))
    return str(e.value)


def auto(run, world: int, mib: float, kind: str = "cuda"):
    """--ds-config auto's AutoChoice, or its refusal line."""
    from zerotrain.train.plan import memory_check
    cfg, spec, data = run
    batch = cfg.train.batch(world // cfg.distributed.sequence_parallel)
    try:
        return memory_check.choose("auto", cfg, spec, data, batch, cfg.data.seq_len, world, budget(mib, kind))
    except memory_check.DoesNotFit as e:
        return str(e)


def following(run, n: int):
    """The same run with --distributed.sequence_parallel n."""
    cfg, spec, data = run
    return dataclasses.replace(cfg, distributed=dataclasses.replace(cfg.distributed, sequence_parallel=n)), spec, data


def test_the_check_names_the_smallest_sequence_parallel_that_fits_and_following_it_runs(long_run):
    from zerotrain.train.strategy.ds_config import load_ds_setup
    from zerotrain.train.plan import memory_check
    run = long_run()
    a1, _ = hand(1)
    (a2, x2), (a4, x4) = hand(2), hand(4)
    # 30 MiB keeps 27: one sequence (41.7 MiB) cannot fit; half of it with its buffers (~22 MiB) can.
    assert a1 > MARGIN * 30 * MiB
    line = refusal(run, 4, 30)
    assert f"; --distributed.sequence_parallel 2 would fit (ZeRO-3 (bf16): activations per rank {hb(a1)} -> {hb(a2)}, " \
           f"peak " in line and "<= 30.00 MiB)" in line, line
    # 20 MiB keeps 18: SP 2 needs at least a2 + x2 (22.3 MiB); SP 4 (~11 MiB) fits.
    assert a2 + x2 > MARGIN * 20 * MiB
    line = refusal(run, 4, 20)
    assert f"--distributed.sequence_parallel 4 would fit (ZeRO-3 (bf16): activations per rank {hb(a1)} -> {hb(a4)}" \
           in line, line
    # Following the advice, the same JSON passes the check, with the activations it said.
    for n, mib, act in ((2, 30, a2), (4, 20, a4)):
        cfg, spec, data = following(run, n)
        batch = cfg.train.batch(4 // n)
        setup = load_ds_setup("ds_configs/zero3.json", cfg, batch, 3, cuda=False, hidden_size=64)
        e, warning = memory_check.require_fit(cfg, spec, setup, data, batch, T, 4, budget(mib))
        assert warning is None and e.activations == act and e.device_total >= act + (x2 if n == 2 else x4)
    # 10 MiB keeps 9: a quarter of the sequence (10.4 MiB) is already too much; 4 ranks allow no more.
    assert a4 > MARGIN * 10 * MiB
    assert "sequence_parallel" not in refusal(run, 4, 10)
    # A DDP run: SP needs ZeRO, so the suggestion names the JSON that fits with it.
    assert re.search(r"--distributed.sequence_parallel 2 with --ds-config \S*zero1\.json would fit \(ZeRO-1",
                     refusal(run, 4, 30, ds="ddp"))


def test_auto_suggests_it_in_its_refusal_and_never_switches_it_on(long_run):
    run = long_run()
    a1, _ = hand(1)
    a2, _ = hand(2)
    line = auto(run, 4, 30)
    assert isinstance(line, str) and line.startswith("--ds-config auto: no option fits 30.00 MiB"), line
    assert f"--distributed.sequence_parallel 2 would fit (ZeRO-1: activations per rank {hb(a1)} -> {hb(a2)}" in line
    # Given the flag, auto chooses that option: a ZeRO one (plain DDP fits the budget, but SP refuses DDP).
    pick = auto(following(run, 2), 4, 30)
    assert pick.label == "ZeRO-1" and pick.estimate.activations == a2, pick


def test_only_sizes_the_run_can_use_are_named(long_run):
    """N divides the world, the heads, the key/value heads and the sequence; it grows from the run's."""
    a1, _ = hand(1)
    a2, x2 = hand(2)
    assert a2 + x2 > MARGIN * 20 * MiB > a1 / 3   # SP 2 does not fit 20 MiB; 3 or more would by activations
    # 3 ranks: 3 divides neither the 4 heads nor 4096 tokens.
    assert "sequence_parallel" not in refusal(long_run(), 3, 30)
    # 6 ranks: 2, 3 and 6 divide the world; only 2 divides the heads.
    assert "--distributed.sequence_parallel 2 would fit" in refusal(long_run(), 6, 30)
    assert "sequence_parallel" not in refusal(long_run(), 6, 20)
    # 2 key/value heads (gpt-tiny's own): 4 ranks could hold a quarter each, but not of 2 KV heads.
    assert "--distributed.sequence_parallel 2 would fit" in refusal(long_run(kv=2), 4, 30)
    assert "sequence_parallel" not in refusal(long_run(kv=2), 4, 20)
    # 4094 tokens: 2 divides them, 4 does not.
    assert "sequence_parallel" not in refusal(long_run(seq=T - 2), 4, 20)
    # A run already at SP 2 is told the next size, from its own activations.
    a4, _ = hand(4)
    line = refusal(long_run(sp=2), 4, 20)
    assert f"--distributed.sequence_parallel 4 would fit (ZeRO-3 (bf16): activations per rank {hb(a2)} -> {hb(a4)}" \
           in line, line
    # hardware.compile refuses SP: the suggestion says to turn it off.
    assert "--distributed.sequence_parallel 2 and --hardware.compile false would fit" in refusal(long_run(compile=True),
                                                                                           4, 30)


def test_no_size_is_named_when_the_model_states_do_not_fit(long_run):
    """On CPU ranks the states include DeepSpeed's 64 MiB all-reduce workspace (and DDP's buckets):
    with 60 MiB no option holds its states and buffers, whatever the activations; with 100 MiB SP 2 fits."""
    from zerotrain.train.plan import memory_check
    cfg, spec, data = run = long_run()
    rows = memory_check._rows(memory_check.model_shape(spec, data), memory_check.plan_batch(cfg, cfg.train.batch(4), T),
                              4, memory_check._device(budget(60, "cpu")), memory_check.paths.DS_CONFIGS)
    assert min(r.device_total - r.work for r in rows if r.option.backend != "ddp") > MARGIN * 60 * MiB
    for line in (refusal(run, 4, 60, kind="cpu"), auto(run, 4, 60, kind="cpu")):
        assert "no option fits" in line and "sequence_parallel" not in line, line
    for line in (refusal(run, 4, 100, kind="cpu"), auto(run, 4, 100, kind="cpu")):
        assert "--distributed.sequence_parallel 2 would fit" in line, line


def test_zerotrain_plan_names_it_when_nothing_fits(tmp_path, capsys):
    from zerotrain.train.commands.plan import main as plan
    run = tmp_path / "long.yaml"
    run.write_text(f"model:\n  name: gpt-tiny\n  seq_len: {T}\n  n_kv_head: 4\ndata:\n  seq_len: {T}\n"
                   f"train:\n  micro_batch_size: 1\n")
    a1, _ = hand(1)
    for mib, n in ((30, 2), (20, 4)):
        assert plan([str(run), "--gpus-per-node", "4", "--device-mem", f"{mib}MiB"]) == 0
        out = capsys.readouterr().out
        an, _ = hand(n)
        assert re.search(rf"nothing fits in .* --sequence-parallel {n} would fit \(ZeRO-\S+: activations per rank "
                         rf"{re.escape(hb(a1))} -> {re.escape(hb(an))}, peak ", out), out
        assert plan([str(run), "--gpus-per-node", "4", "--device-mem", f"{mib}MiB", "--json"]) == 0
        fit = json.loads(capsys.readouterr().out)["sequence_parallel_would_fit"]
        assert fit["sequence_parallel"] == n and fit["activations_bytes"] == an and fit["peak_bytes"] <= MARGIN * mib * MiB
    assert plan([str(run), "--gpus-per-node", "4", "--device-mem", "10MiB", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["sequence_parallel_would_fit"] is None
    # With the flag and room, the recommendation is a ZeRO option (DDP fits, but SP refuses it).
    assert plan([str(run), "--gpus-per-node", "4", "--device-mem", "30MiB", "--sequence-parallel", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["options"][0]["option"] == "DDP" and out["options"][0]["fits"]
    assert out["recommended"] == "ZeRO-1", out["recommended"]
