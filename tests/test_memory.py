"""Measured model-state bytes (train/observe/memory.py): the counting rule on plain modules, then the
real engines (DDP, ZeRO-1/2/3, 2 processes) against each other and against the planner."""

from __future__ import annotations

import pytest
import torch

from helpers import TINY, assert_zero3_planned_to_the_byte, metrics, rank_infos, run_train
from zerotrain.train.observe.memory import StepProbe
from zerotrain.train.strategy.state_bytes import measure


def _adam_step(model, opt):
    model(torch.randn(4, model.in_features)).square().mean().backward()
    opt.step()


def test_counts_params_grads_and_adam_moments():
    model = torch.nn.Linear(100, 50)                      # 5050 parameters
    opt = torch.optim.AdamW(model.parameters())
    before = measure(model, opt, accelerator_is_cpu=True)
    assert before.device["params"] == 5050 * 4 and before.device["grads"] == 0
    assert not before.optimizer_state_ready               # Adam creates its moments lazily
    _adam_step(model, opt)
    after = measure(model, opt, accelerator_is_cpu=True)
    assert after.device["grads"] == 5050 * 4
    # exp_avg + exp_avg_sq (fp32) + a scalar step tensor per parameter tensor
    assert 5050 * 8 <= after.device["optimizer"] <= 5050 * 8 + 2 * 8
    assert after.model_states == sum(after.device[k] for k in ("params", "grads", "optimizer"))


def test_views_into_one_buffer_count_once():
    flat = torch.zeros(1000)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(flat[:600].view(20, 30))  # like ZeRO-1/2: params are views of a flat buffer
    model.b = torch.nn.Parameter(flat[600:])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert measure(model, opt, accelerator_is_cpu=True).device["params"] == 1000 * 4


def test_probe_fires_once_before_the_optimizer_step():
    model = torch.nn.Linear(10, 10)
    opt = torch.optim.AdamW(model.parameters())
    _adam_step(model, opt)
    probe = StepProbe(model, opt, step_target=opt, measure=measure)
    probe.arm()
    _adam_step(model, opt)
    assert not probe.armed and probe.result.device["grads"] == 110 * 4 and probe.result.optimizer_state_ready
    first = probe.result
    _adam_step(model, opt)                                   # disarmed: no new measurement
    assert probe.result is first


# ---------------------------------------------------------------------------- real engines

STAGES = ("ddp", "zero1", "zero2", "zero3")


@pytest.fixture(scope="module")
def runs(fp32_stage_runs):
    """The stage tests' launches (tests/helpers.py STAGE_ARGS): the first metrics row with the
    measurement, and the launcher's stdout."""
    out = {}
    for stage in STAGES:
        run_dir = fp32_stage_runs[stage]
        row = next(r for r in metrics(run_dir) if "mem/model_states_bytes_per_rank" in r)
        out[stage] = (row, (run_dir / "launcher.out").read_text())
    return out


def _psi() -> int:
    from zerotrain.models.gpt import preset
    return preset("gpt-tiny", d_model=256, n_layer=2).num_params()


@pytest.mark.multiproc
def test_measured_model_states_decrease_with_the_stage(runs):
    per_rank = {s: runs[s][0]["mem/model_states_bytes_per_rank"] for s in STAGES}
    for rank in range(2):
        sizes = [per_rank[s][rank] for s in STAGES]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4, per_rank


@pytest.mark.multiproc
def test_planner_matches_measured_within_10_percent(runs):
    for stage in STAGES:
        row = runs[stage][0]
        for measured, planned in zip(row["mem/model_states_bytes_per_rank"], row["plan/model_states_bytes_per_rank"]):
            assert abs(planned - measured) / measured < 0.10, (stage, measured, planned)
    # ZeRO-3's parameters and gradients to the byte (a prefetched parameter is "gathered", no model state).
    z3 = runs["zero3"][0]
    assert_zero3_planned_to_the_byte(z3)


@pytest.mark.multiproc
@pytest.mark.parametrize("stage", ["zero0", "zero3_offload"])
def test_plan_of_device_and_host_bytes_matches_without_partitions_and_offloaded(fp32_stage_runs, stage):
    row = next(r for r in metrics(fp32_stage_runs[stage]) if "mem/model_states_bytes_per_rank" in r)
    for kind in ("model_states", "host"):  # on the device and, offloaded, on the host
        for measured, planned in zip(row[f"mem/{kind}_bytes_per_rank"], row[f"plan/{kind}_bytes_per_rank"]):
            # + 1 MiB: with everything offloaded, the parameters ZeRO-3 has gathered at the
            # moment of measurement (here the tied embedding, 256 KiB) dominate the device's bytes.
            assert abs(planned - measured) <= 0.10 * measured + 2 ** 20, (stage, kind, measured, planned)


@pytest.mark.multiproc
def test_each_stage_partitions_what_it_should(runs):
    psi = _psi()
    ddp, z1, z2, z3 = (runs[s][0] for s in STAGES)
    assert ddp["mem/params_bytes"] == ddp["mem/grads_bytes"] == 4 * psi     # grads are views of DDP's buckets
    assert 8 * psi <= ddp["mem/optimizer_bytes"] < 8 * psi + 1024
    assert z1["mem/grads_bytes"] == 4 * psi                                  # full until the boundary
    assert abs(z1["mem/optimizer_bytes"] - 12 * psi / 2) < 0.01 * psi        # fp32 master + moments, halved
    assert z2["mem/grads_bytes"] < 0.6 * 4 * psi                            # ~half: the partition
    assert z3["mem/params_bytes"] < 0.75 * 4 * psi                          # partition + small tensors whole
    assert all(r["mem/optimizer_state_ready"] and r["mem/host_bytes"] == 0 for r in (ddp, z1, z2, z3))


@pytest.mark.multiproc
def test_startup_banner_shows_the_estimate_and_the_run_reports_the_measurement(runs):
    for stage in STAGES:
        out = runs[stage][1]
        assert "model states " in out and "per rank (estimated)" in out, out[-3000:]
        assert "model states measured at step 2: rank 0" in out and "planner" in out


@pytest.mark.multiproc
def test_frozen_parameters_under_zero3_are_planned_to_the_byte(tmp_path, fp32_configs):
    """LoRA over gpt-tiny (its head tied to the embedding) under ZeRO-3, 2 processes, fp32: the
    frozen base is partitioned (the embedding = head and the matrices) or whole (the norms, under
    the persistence threshold of 10 x d_model), the adapters partitioned by the engine or whole.
    The plan counts every frozen tensor as DeepSpeed holds it. (The untied case, an hf: Llama, is
    tests/test_lora.py's ZeRO-3 round trip.) Before, the embedding counted twice: DeepSpeed's
    pre-forward prefetch had gathered it when the measurement ran (it is "gathered" now)."""
    from zerotrain.models import gpt, gpt_config
    from zerotrain.train.checkpoint.weights import write_weights
    from zerotrain.train.config import ModelConfig
    gcfg = gpt_config(ModelConfig(name="gpt-tiny"), vocab_size=256)
    torch.manual_seed(0)
    params = dict(gpt.GPT(gcfg).named_parameters())
    write_weights(tmp_path / "base", [(n, tuple(p.shape), torch.float32) for n, p in params.items()],
                  lambda n: params[n].detach(), dtype=torch.float32, max_shard_size="2GB",
                  tied=[("lm_head.weight", "tok_emb.weight")], family="gpt",
                  model_config={"family": "gpt", **gcfg.to_dict()})
    run = tmp_path / "run"
    run_train("torchrun", 2, ["--ds-config", fp32_configs["zero3"], *TINY, "--model.init_from", str(tmp_path / "base"),
                              "--model.lora.r", "4", "--model.lora.target_modules", "qkv,proj", "--train.max_steps", "3",
                              "--train.eval_every", "0", "--train.eval_batches", "1", "--train.run_dir", str(run)])
    row = next(r for r in metrics(run) if "mem/model_states_bytes_per_rank" in r)
    assert_zero3_planned_to_the_byte(row)
    assert row["mem/gathered_bytes"] == 4 * 256 * 64, row    # the tied embedding, prefetched whole
    for info in rank_infos(run):
        z = info["zero3"]
        assert z["partitioned_tensors"] == 1 + 2 * 4 and 0 < z["whole_elements"] < 0.05 * z["elements"], z
