"""FSDP2 in fp16 (train/strategy/fsdp2.py with loss_scale.DynamicScale): fp16 compute over fp32
master shards, a dynamic loss scale decided on the global gradient norm, saved with checkpoints.

fp16 needs a CUDA GPU in zerotrain and there is none here: these run the real FSDP2Strategy on
CPU with only that refusal lifted (load_ds_setup's cuda=True; tests/fsdp2_fp16_driver.py), on a
one-process gloo group in this process, and on two ranks under torchrun. What they cannot show:
CUDA's fp16 kernels and NCCL (bench/gpu_check.sh runs FSDP2 fp16 on a GPU).

  - a real fp16 overflow (the loss times 1e4: the fp16 gradients become inf) skips the step and
    halves the scale; loss_scale_window (3) clean steps double it again;
  - the parameters after 6 steps equal a plain loop written here (fp32 masters, an fp16 copy
    computing forward and backward on the scaled loss, unscale, global norm, clip, fused AdamW,
    the scale rule by hand) bit for bit;
  - the scale and its count of clean steps round-trip through state_dict / load_state_dict (a
    resumed run continues with the same scales), in the record DDP's GradScaler loads;
  - on two ranks, an inf in one rank's gradient shard only skips the step on both;
  - DPO's frozen reference is cast to fp16 as the units are (the same loss at step 1);
  - the file's fp16 keys are DDP's: the same refusals, naming FSDP2's loss scale.
"""

from __future__ import annotations

import copy
import json
import subprocess

import pytest
import torch

import fsdp2_fp16_driver as driver
from helpers import BIN, REPO, ds_variant, free_port, subprocess_env

OVERFLOW_AT, STEPS = 2, 6
# the scale after each step: 2**16, the overflow halves it, the 3rd clean step after it doubles it
SCALES = [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16, 2.0 ** 16]


@pytest.fixture
def one_rank(tmp_path, fresh_accelerate, monkeypatch):
    """A one-process gloo group in this process (as a launched run has), torn down after."""
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29531").items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield tmp_path
    finally:
        dist.destroy_process_group()


def _mult(n: int) -> float:
    return 1e4 if n == OVERFLOW_AT else 1.0


def _reference(steps: int):
    """Parameters and scales after `steps` of the plain loop: fp32 masters stepped by the fused
    AdamW zerotrain builds (train/optim/optimizer.py, same groups and hyper-parameters), gradients
    from an fp16 copy of them on the scaled loss, unscaled, clipped by their global norm."""
    from zerotrain.train.config import RunConfig
    from zerotrain.train.optim.optimizer import adamw
    master = driver.model()
    opt = adamw(master, RunConfig().optim, fused=True)
    scale, clean, scales = 2.0 ** 16, 0, []
    for n in range(1, steps + 1):
        half = copy.deepcopy(master).half()
        x, y = driver.batch(n)
        (half(x, y) * _mult(n)).float().mul(scale).backward()
        for p, h in zip(master.parameters(), half.parameters()):
            p.grad = h.grad.float() / scale
        grads = [p.grad for p in master.parameters()]
        norm = torch.nn.utils.get_total_norm(grads)
        torch.nn.utils.clip_grads_with_norm_(list(master.parameters()), driver.CLIP, norm)
        overflow = not bool(torch.isfinite(norm))
        opt.found_inf = torch.tensor(float(overflow))
        opt.step()
        opt.zero_grad(set_to_none=True)
        if overflow:
            scale, clean = scale / 2, 0
        else:
            clean += 1
            if clean == driver.FP16["loss_scale_window"]:
                scale, clean = scale * 2, 0
        scales.append(scale)
    return [p.detach() for p in master.parameters()], scales


def test_fsdp2_fp16_skips_an_overflow_grows_the_scale_and_equals_a_plain_fp16_loop(one_rank):
    s, m = driver.build(one_rank, 1)
    assert type(s).__name__ == "FSDP2Strategy" and s.precision == "fp16"
    assert s.acc.mixed_precision == "no" and getattr(s.acc, "scaler", None) is None  # no second scaler
    assert {p.dtype for p in m.parameters()} == {torch.float32}  # the masters
    scales, norms = [], []
    for n in range(1, STEPS + 1):
        before = driver.full_params(m)
        norms.append(float(driver.step(s, m, n, loss_mult=_mult(n))))
        scales.append(float(s.loss_scale()))
        after = driver.full_params(m)
        moved = any(not torch.equal(a, b) for a, b in zip(before, after))
        assert moved is (n != OVERFLOW_AT), n  # the overflow step leaves every parameter as it was
    assert scales == SCALES
    assert [n == OVERFLOW_AT for n in range(1, STEPS + 1)] == [not torch.isfinite(torch.tensor(v)) for v in norms]
    assert {int(st["step"]) for st in s.raw_optimizer.state.values()} == {STEPS - 1}  # AdamW skipped it too
    want, want_scales = _reference(STEPS)
    assert want_scales == SCALES
    got = driver.full_params(m)
    for (name, _), g, w in zip(m.named_parameters(), got, want):
        assert torch.equal(g, w), (name, (g - w).abs().max())


def test_fsdp2_fp16_computes_in_fp16_over_fp32_masters(one_rank):
    s, m = driver.build(one_rank, 1)
    seen = []
    hook = m.blocks[0][0].register_forward_hook(lambda mod, inp, out: seen.append((mod.weight.dtype, out.dtype)))
    driver.step(s, m, 1)
    hook.remove()
    assert seen == [(torch.float16, torch.float16)]
    assert {p.dtype for p in m.parameters()} == {torch.float32}


def test_fsdp2_fp16_frozen_copy_computes_as_the_policy(one_rank):
    """DPO's frozen reference (copied whole before sharding) is cast as the policy's units are:
    at step 1 it gives the sharded model's loss bit for bit (an fp32 copy would not)."""
    s, m = driver.build(one_rank, 1)
    x, y = driver.batch(1)
    frozen = s.frozen_like_policy(driver.model())  # the same initial weights, whole
    assert {p.dtype for p in frozen.parameters()} == {torch.float16}
    with torch.no_grad():
        got, want, fp32 = m(x, y), frozen(x, y), driver.model()(x, y)
    assert torch.equal(got, want) and not torch.equal(got, fp32)


def test_fsdp2_fp16_scale_round_trips_through_the_engine_state(one_rank):
    s, m = driver.build(one_rank, 1)
    for n in range(1, 4):  # the overflow at 2, then one clean step: scale 2**15, one clean step counted
        driver.step(s, m, n, loss_mult=_mult(n))
    state = json.loads(json.dumps(s.state_dict()))  # what the checkpoint's "engine" component holds
    rec = state["loss_scaler"]
    assert rec["kind"] == "torch" and rec["scale"] == 2.0 ** 15 and rec["_growth_tracker"] == 1
    assert rec["growth_interval"] == 3
    # a fresh scale (as at a resumed start) takes it, and grows after the 2 clean steps left
    s.scaler.load_state_dict({"scale": 2.0 ** 16, "_growth_tracker": 0})
    s.load_state_dict(state, None)
    assert float(s.loss_scale()) == 2.0 ** 15 and int(s.scaler.growth_tracker) == 1
    driver.step(s, m, 4)
    assert float(s.loss_scale()) == 2.0 ** 15
    driver.step(s, m, 5)
    assert float(s.loss_scale()) == 2.0 ** 16
    # DDP's GradScaler reads the same record (a checkpoint moves between DDP fp16 and FSDP2 fp16)
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict({k: v for k, v in rec.items() if k != "kind"})
    assert scaler.get_scale() == 2.0 ** 15
    # another backend's record (DeepSpeed's) leaves the scale as it is
    s.load_state_dict({"loss_scaler": {"kind": "deepspeed", "cur_scale": 8.0}}, None)
    assert float(s.loss_scale()) == 2.0 ** 16


def test_fsdp2_fp16_window_shorter_on_resume_still_grows(one_rank):
    """A resumed file with a smaller loss_scale_window: the saved count is capped below it (the
    file's window rules), so the scale grows at the next clean step rather than never."""
    s, m = driver.build(one_rank, 1, {**driver.FP16, "loss_scale_window": 2})
    s.load_state_dict({"loss_scaler": {"kind": "torch", "scale": 1024.0, "_growth_tracker": 5,
                                       "growth_interval": 1000}}, None)
    assert s.scaler.growth_interval == 2 and int(s.scaler.growth_tracker) == 1
    driver.step(s, m, 1)
    assert float(s.loss_scale()) == 2048.0


@pytest.mark.multiproc
def test_fsdp2_fp16_one_ranks_overflow_skips_the_step_on_every_rank(tmp_path):
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(REPO / "tests" / "fsdp2_fp16_driver.py"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, env=subprocess_env(None), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["scale"] == [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 15, 2.0 ** 16]
        assert r["before"][1] == r["after"][1]            # step 2: nothing moved, on rank 0 too
        assert all(r["before"][i] != r["after"][i] for i in (0, 2, 3, 4))
        assert r["norm"][1] == float("inf") and all(v < float("inf") for i, v in enumerate(r["norm"]) if i != 1)
        assert r["adam_steps"] == [4]
    assert ranks[0] == ranks[1]  # the same parameters, scales and norms on both ranks


# ------------------------------------------------------------------ the file
def _load(tmp_path, fp16, cuda=True):
    from zerotrain.train.config import Batch, RunConfig
    from zerotrain.train.strategy.ds_config import load_ds_setup
    path = ds_variant(tmp_path, "fsdp2", "fsdp2_fp16_test", bf16={"enabled": False}, fp16=fp16)
    return load_ds_setup(path, RunConfig(), Batch(4, 1, 2), 10, cuda=cuda)


def test_the_shipped_fsdp2_fp16_file_resolves():
    from zerotrain.train.config import Batch, RunConfig
    from zerotrain.train.strategy.ds_config import load_ds_setup
    ds = load_ds_setup(str(REPO / "ds_configs" / "fsdp2_fp16.json"), RunConfig(), Batch(4, 1, 2), 10, cuda=True)
    assert (ds.backend, ds.precision) == ("fsdp2", "fp16")
    assert ds.settings.grad_scaler == {"init_scale": 2.0 ** 16, "growth_interval": 1000}
    assert ds.describe() == "FSDP2 (fp16)"
    from zerotrain.train.strategy.option import Option  # the planner prices its 16-bit elements as bf16's
    o = Option.from_json("FSDP2 fp16", REPO / "ds_configs" / "fsdp2_fp16.json")
    assert (o.backend, o.precision, o.elem_bytes) == ("fsdp2", "fp16", 2)


@pytest.mark.parametrize("fp16,needle", [
    ({"loss_scale": 128}, '"fp16.loss_scale": 128: FSDP2\'s loss scale has no static loss scale'),
    ({"hysteresis": 2}, '"fp16.hysteresis": 2: FSDP2\'s loss scale lowers the scale at every overflow'),
    ({"min_loss_scale": 1}, '"fp16.min_loss_scale" has no equivalent in FSDP2\'s loss scale'),
])
def test_fsdp2_fp16_keys_without_a_meaning_are_refused_in_one_line(tmp_path, fp16, needle):
    from zerotrain.train.errors import ConfigError
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, {"enabled": True, **fp16})
    assert needle in str(e.value) and "fsdp2_fp16_test.json" in str(e.value) and "\n" not in str(e.value)


def test_fsdp2_fp16_settings_reach_the_scale_and_cpu_is_refused(tmp_path):
    from zerotrain.train.errors import ConfigError
    ds = _load(tmp_path, {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50})
    assert ds.settings.grad_scaler == {"init_scale": 4096.0, "growth_interval": 50}
    with pytest.raises(ConfigError, match="fp16 needs a CUDA GPU"):  # a real launch on this machine
        _load(tmp_path, {"enabled": True}, cuda=False)
