"""Mixture-of-experts hf: models (issue 28, models/moe.py): the sparse blocks found from the
model's modules, made ZeRO-3 leaves; the router's aux loss added and logged; tokens per expert.

The launches train a tiny random Qwen3-MoE (8 experts, top-2, tests/helpers.py save_tiny_moe)
on 2 processes, every parameter partitioned (persistence threshold 0), on a token file written
so that rank 0 only ever sees ids of one band and rank 1 of the other: layer 0 routes them to
disjoint experts (0-3 and 4-7). One ZeRO-3 launch (checkpoints, export) and one DDP launch of
the same run are shared by the tests below; a third runs ZeRO-3 without the leaf setting."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import (MOE_VOCAB, SEQ, assert_resumable_checkpoint, assert_zero3_planned_to_the_byte, banded_tokens,
                     data_trace, ds_variant, hf_val_loss, layer0_experts, metrics, rank_infos, run_train,
                     save_tiny_moe, train_losses, zero3_all_partitioned)

STEPS, SEED, MICRO, ACCUM = 6, 1234, 1, 2
NO_LEAF_TIMEOUT = 240  # s: the leaf run takes ~30 s here


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    model = save_tiny_moe(d / "qwen3moe")
    return SimpleNamespace(dir=d, model=model, tokens=banded_tokens(d / "banded.bin", SEED))


def run_args(moe, run_dir: Path, ds: str) -> list[str]:
    return ["--model.name", f"hf:{moe.model}", "--data.kind", "tokens", "--data.path", str(moe.tokens),
            "--data.seq_len", str(SEQ), "--train.micro_batch_size", str(MICRO), "--train.grad_accum_steps",
            str(ACCUM), "--train.max_steps", str(STEPS), "--train.eval_every", "0", "--train.eval_batches", "null",
            "--train.seed", str(SEED), "--optim.lr", "3e-3", "--optim.warmup_steps", "2", "--logging.progress", "false",
            "--logging.every_steps", "1", "--debug.trace_data", "true", "--checkpoint.every_steps", "3",
            "--checkpoint.save_at_end", "true", "--checkpoint.export", "true", "--checkpoint.export_dtype", "fp32",
            "--ds-config", ds, "--train.run_dir", str(run_dir)]


def launch(moe, name: str, ds: str, env=None, timeout=600, check=True):
    run_dir = moe.dir / name
    proc = run_train("torchrun", 2, run_args(moe, run_dir, ds), env={"HF_HUB_OFFLINE": "1", **(env or {})},
                     timeout=timeout, check=check)
    return SimpleNamespace(dir=run_dir, proc=proc, rows=[r for r in metrics(run_dir) if "loss" in r])


@pytest.fixture(scope="module")
def zero3(moe, tmp_path_factory):
    return launch(moe, "zero3", zero3_all_partitioned(tmp_path_factory.mktemp("ds")))


@pytest.fixture(scope="module")
def ddp(moe, tmp_path_factory):
    return launch(moe, "ddp", ds_variant(tmp_path_factory.mktemp("ds"), "ddp", "ddp_fp32", bf16={"enabled": False}))


# ----------------------------------------------------------------------------- in process

@pytest.mark.parametrize("kind,cls", [("qwen3_moe", "Qwen3MoeSparseMoeBlock"), ("mixtral", "MixtralSparseMoeBlock")])
def test_sparse_blocks_are_found_from_the_modules(tmp_path, kind, cls):
    from zerotrain.models import build_workload, resolve
    from zerotrain.models.config import ModelConfig
    from zerotrain.models.moe import detect
    from helpers import lm_bundle, save_tiny
    d = save_tiny_moe(tmp_path / kind, kind)
    wl = build_workload(resolve(ModelConfig(name=f"hf:{d}")), lm_bundle(MOE_VOCAB))
    info = wl.moe.info
    assert [c.__name__ for c in info.block_classes] == [cls]
    assert (info.blocks, info.num_experts, info.top_k, info.aux_coef) == (2, 8, 2, 0.01)
    assert info.banner().startswith(f"MoE: 8 experts x 2 active, 2 sparse layers, {cls}")
    # Active FLOPs: 6 per active weight; the 6 experts a token skips in each layer do not count.
    skipped = sum(p.numel() for n, p in wl.model.named_parameters() if ".experts." in n) * 6 // 8
    assert info.active_params_delta == skipped
    from zerotrain.models.hf import flops_per_token
    assert wl.flops_per_item == flops_per_token(wl.model, 32, 2, SEQ) - 6 * skipped
    # A dense model has none; the override is refused there, and for non-hf models.
    llama = save_tiny("llama", tmp_path / "llama", MOE_VOCAB)
    assert detect(build_workload(resolve(ModelConfig(name=f"hf:{llama}")), lm_bundle(MOE_VOCAB)).model,
                  None) is None
    from zerotrain.models.errors import ConfigError
    with pytest.raises(ConfigError, match="model.router_aux_loss_coef: .* has no sparse mixture-of-experts block"):
        build_workload(resolve(ModelConfig(name=f"hf:{llama}", router_aux_loss_coef=0.1)), lm_bundle(MOE_VOCAB))
    with pytest.raises(ConfigError, match="^model.router_aux_loss_coef is not a key of model family gpt"):
        resolve(ModelConfig(name="gpt-tiny", router_aux_loss_coef=0.1))
    with pytest.raises(ConfigError, match="must be >= 0"):
        ModelConfig(name=f"hf:{d}", router_aux_loss_coef=-1)


def test_run_file_coefficient_overrides_the_models_and_weights_the_aux_loss(tmp_path):
    from zerotrain.models import build_workload, resolve
    from zerotrain.models.config import ModelConfig
    from helpers import lm_bundle
    d = save_tiny_moe(tmp_path / "m")
    batch = {"input_ids": torch.randint(0, MOE_VOCAB, (2, SEQ)), "labels": torch.randint(0, MOE_VOCAB, (2, SEQ))}
    losses = {}
    for coef in (None, 0.0, 0.5):
        wl = build_workload(resolve(ModelConfig(name=f"hf:{d}", router_aux_loss_coef=coef)), lm_bundle(MOE_VOCAB))
        loss = wl.loss(wl.model, batch)
        m, _ = wl.moe.window(SimpleNamespace(num_processes=1))
        assert math.isclose(float(loss), m["loss/lm"] + wl.moe.info.aux_coef * m["loss/aux"], rel_tol=1e-6)
        assert sum(m["moe/expert_tokens"][0]) == 2 * SEQ * 2  # every token routed to its top-2
        losses[coef] = (float(loss), m["loss/aux"])
    assert losses[0.0][0] < losses[None][0] < losses[0.5][0]
    assert losses[0.0][1] == losses[None][1] == losses[0.5][1] > 1.0  # the model's own aux loss, unweighted


# ----------------------------------------------------------------------------- 2 processes

@pytest.mark.multiproc
def test_zero3_trains_every_parameter_partitioned_with_ranks_on_disjoint_experts(moe, zero3):
    assert "MoE: 8 experts x 2 active, 2 sparse layers, Qwen3MoeSparseMoeBlock as ZeRO-3 leaf" in zero3.proc.stdout
    assert "model built partitioned by deepspeed.zero.Init" in zero3.proc.stdout
    for info in rank_infos(zero3.dir):
        z = info["zero3"]
        assert z["partitioned_tensors"] == z["tensors"] and z["whole_tensors"] == 0, z
        assert z["held_elements"] <= z["partitioned_elements"] / 2 + z["partitioned_tensors"], z
    # Each rank's windows are all of one band, and layer 0 sends the two bands to disjoint experts.
    from zerotrain.train.config import DataConfig
    from zerotrain.train.data import build_data
    data = build_data(DataConfig(kind="tokens", path=str(moe.tokens)), SEQ, SEED)
    import zlib
    crc = {zlib.crc32(data.train[i]["input_ids"].numpy().tobytes()): i for i in range(len(data.train))}
    seen = [[data.train[crc[c]]["input_ids"] for r in data_trace(zero3.dir, rank) for c in r["crc"]]
            for rank in (0, 1)]
    assert len(seen[0]) == len(seen[1]) == STEPS * ACCUM
    assert all(int(x.max()) < MOE_VOCAB // 2 for x in seen[0]) and all(int(x.min()) >= MOE_VOCAB // 2 for x in seen[1])
    assert layer0_experts(moe.model, torch.cat(seen[0])) == {0, 1, 2, 3}
    assert layer0_experts(moe.model, torch.cat(seen[1])) == {4, 5, 6, 7}
    assert [r["step"] for r in zero3.rows] == list(range(1, STEPS + 1))


@pytest.mark.multiproc
def test_zero3_losses_equal_ddp_aux_loss_included(zero3, ddp):
    assert len(zero3.rows) == len(ddp.rows) == STEPS
    for a, b in zip(zero3.rows, ddp.rows):
        for k in ("loss", "loss/lm", "loss/aux"):
            assert abs(a[k] - b[k]) < 1e-5, (k, a, b)
        assert a["moe/expert_tokens"] == b["moe/expert_tokens"], (a, b)
    assert zero3.rows[-1]["loss"] < zero3.rows[0]["loss"]


@pytest.mark.multiproc
def test_fsdp2_trains_experts_no_token_of_a_rank_reaches(moe, zero3, tmp_path_factory):
    """FSDP2 with each rank's tokens routed to disjoint experts: the experts a rank did not use
    still join their block's reduce-scatter (zeros), so the run neither hangs nor differs from
    ZeRO-3's."""
    run = launch(moe, "fsdp2", ds_variant(tmp_path_factory.mktemp("ds"), "fsdp2", "fsdp2_fp32",
                                          bf16={"enabled": False}, fp16={"enabled": False}), timeout=NO_LEAF_TIMEOUT)
    assert len(run.rows) == len(zero3.rows) == STEPS
    for a, b in zip(run.rows, zero3.rows):
        for k in ("loss", "loss/lm", "loss/aux"):
            assert abs(a[k] - b[k]) < 1e-5, (k, a, b)
        assert a["moe/expert_tokens"] == b["moe/expert_tokens"], (a, b)


@pytest.mark.multiproc
def test_aux_loss_and_expert_load_are_logged_per_interval(zero3):
    tokens_per_step = 2 * MICRO * ACCUM * SEQ
    for r in zero3.rows:
        assert math.isclose(r["loss"], r["loss/lm"] + 0.01 * r["loss/aux"], rel_tol=1e-6), r
        grid = r["moe/expert_tokens"]
        assert len(grid) == 2 and all(len(row) == 8 for row in grid)
        assert [sum(row) for row in grid] == [tokens_per_step * 2] * 2  # summed over both ranks, top-2
        assert r["moe/load_max_over_mean"] >= 1.0 >= r["moe/load_min_over_mean"]
    assert json.loads((zero3.dir / "config.json").read_text())["model"]["resolved"]["moe"]["zero3_leaf"] is True


@pytest.mark.multiproc
def test_zero3_moe_checkpoint_and_export_load_clean_with_the_trained_logits(moe, zero3):
    from transformers import AutoModelForCausalLM
    assert_resumable_checkpoint(zero3.dir / "checkpoints", STEPS)
    export = zero3.dir / "export"
    model, info = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32, local_files_only=True,
                                                       output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    init = AutoModelForCausalLM.from_pretrained(str(moe.model), dtype=torch.float32, local_files_only=True)
    x = torch.randint(0, MOE_VOCAB, (2, SEQ))
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=x).logits, init(input_ids=x).logits)  # trained, not the init
    val = [r for r in metrics(zero3.dir) if "val/loss" in r][-1]
    loss, n = hf_val_loss(model.eval(), moe.tokens)
    assert n == val["val/samples"] and math.isclose(loss, val["val/loss"], rel_tol=1e-5), (loss, val)


@pytest.mark.multiproc
def test_zero3_without_leaf_blocks(moe, zero3, tmp_path_factory):
    """ZEROTRAIN_MOE_LEAF=0: DeepSpeed gathers the router and the fused experts module by module.
    transformers 5.x stores the experts of a layer as one module with 3-D parameters, so every rank
    runs the same module's hooks whatever its tokens' experts: the run finishes with the leaf run's
    losses (no hang on today's code). A ModuleList of experts (transformers 4.x) is what hung."""
    ds = zero3_all_partitioned(tmp_path_factory.mktemp("ds"))
    try:
        run = launch(moe, "zero3_noleaf", ds, env={"ZEROTRAIN_MOE_LEAF": "0"}, timeout=NO_LEAF_TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ZeRO-3 without leaf MoE blocks hung (no exit in {NO_LEAF_TIMEOUT} s)")
    assert "Qwen3MoeSparseMoeBlock;" in run.proc.stdout and "as ZeRO-3 leaf" not in run.proc.stdout
    for a, b in zip(run.rows, zero3.rows, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)


@pytest.mark.multiproc
def test_zero3_moe_model_states_are_planned_to_the_byte(zero3):
    """The planner sizes the fused 3-D expert tensors and the routers like any parameter: measured
    parameters, gradients and optimizer states equal the plan."""
    assert_zero3_planned_to_the_byte(next(r for r in metrics(zero3.dir) if "mem/model_states_bytes_per_rank" in r))


@pytest.mark.multiproc
def test_resume_on_one_process_continues_the_two_process_run(moe, zero3, tmp_path):
    """The step-3 checkpoint of the 2-rank ZeRO-3 run resumed by 1 process (accumulation 4: the same
    global batch and data order): steps 4-6 have the 2-rank losses, LM and aux, within 1e-5 (fp32)."""
    run_dir = tmp_path / "one"
    args = run_args(moe, run_dir, zero3_all_partitioned(tmp_path))
    args[args.index("--train.grad_accum_steps") + 1] = str(2 * ACCUM)
    args += ["--resume", str(zero3.dir / "checkpoints" / "step_00000003"), "--checkpoint.save_at_end", "false",
             "--checkpoint.export", "false"]
    run_train("python", 1, args, env={"HF_HUB_OFFLINE": "1"})
    one = {r["step"]: r for r in metrics(run_dir) if "loss" in r}
    two = {r["step"]: r for r in zero3.rows}
    assert sorted(one) == [4, 5, 6]
    for s in one:
        for k in ("loss", "loss/lm", "loss/aux"):
            assert abs(one[s][k] - two[s][k]) < 1e-5, (s, k, one[s], two[s])
        assert one[s]["moe/expert_tokens"] == two[s]["moe/expert_tokens"]


@pytest.mark.multiproc
def test_lora_on_the_moe_model_under_zero3_saves_an_adapter_peft_loads(moe, tmp_path):
    """Adapters on the attention projections of the partitioned MoE model, activation checkpointing
    on (each recomputed layer gathers its leaf block again): the export is PEFT's
    adapter directory, non-empty and trained, and PeftModel over the base reproduces the run's
    validation loss."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    run_dir = tmp_path / "lora"
    args = run_args(moe, run_dir, zero3_all_partitioned(tmp_path))
    args[args.index("--train.max_steps") + 1] = "4"
    args += ["--model.lora.r", "8", "--model.lora.target_modules", "q_proj,v_proj", "--optim.lr", "1e-2",
             "--model.activation_checkpointing", "true"]  # transformers' own, around the leaf blocks
    proc = run_train("torchrun", 2, args, env={"HF_HUB_OFFLINE": "1"})
    assert "Qwen3MoeSparseMoeBlock as ZeRO-3 leaf" in proc.stdout
    live = run_dir / "export"
    assert sorted(p.name for p in live.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    saved = load_file(str(live / "adapter_model.safetensors"))
    assert len(saved) == 2 * 2 * 2 and all(t.numel() > 0 for t in saved.values())  # 2 layers x q,v x A,B
    assert any(t.abs().sum() > 0 for n, t in saved.items() if "lora_B" in n)  # B moved off zero: trained
    base = AutoModelForCausalLM.from_pretrained(str(moe.model), dtype=torch.float32, local_files_only=True)
    peft_model = PeftModel.from_pretrained(base, str(live)).eval()
    val = [r for r in metrics(run_dir) if "val/loss" in r][-1]
    loss, n = hf_val_loss(peft_model, moe.tokens)
    assert n == val["val/samples"] and math.isclose(loss, val["val/loss"], rel_tol=1e-5), (loss, val)


def test_planner_counts_total_and_active_parameters_and_the_gathered_block(tmp_path, capsys):
    """Memory follows every parameter, FLOPs the active ones; under ZeRO-3 a whole sparse block
    (all its experts) is gathered at once even when stage3_max_live_parameters is smaller."""
    from zerotrain.train.commands import plan as plan_cli
    from zerotrain.train.plan.estimate import estimate
    from zerotrain.train.plan.memory_check import model_shape
    from zerotrain.train.plan.shapes import BatchShape
    from zerotrain.train.strategy.option import Option
    from zerotrain.models import resolve
    from zerotrain.models.config import ModelConfig
    d = save_tiny_moe(tmp_path / "m")
    shape = model_shape(resolve(ModelConfig(name=f"hf:{d}")), None)
    experts = 2 * 8 * (2 * 16 * 32 + 32 * 16)          # 2 layers x 8 experts x (gate_up + down)
    assert shape.leaf_block == experts // 2 + 8 * 32    # one layer's experts and its router
    assert shape.active_params == shape.num_params - experts * 6 // 8
    small = ds_variant(tmp_path, "zero3", "z3_small_live", bf16={"enabled": False},
                       zero_optimization={"stage": 3, "stage3_max_live_parameters": 1000,
                                          "stage3_param_persistence_threshold": 0})
    e = estimate(shape, Option.from_json("z3", Path(small)), 2, BatchShape(1, SEQ), rank=0)
    largest = max(shape.tensors)
    assert e.backward_work == 4 * shape.leaf_block + 4 * largest  # fp32: the block, not 1000 elements
    run = tmp_path / "run.yaml"
    run.write_text(f"model: {{name: 'hf:{d}'}}\ndata: {{seq_len: {SEQ}}}\n")
    assert plan_cli.main([str(run), "--device-mem", "24GB"]) == 0
    out = capsys.readouterr().out
    assert f"{shape.active_params / 1e6:,.1f}M active per token" in out and "(one MoE block)" in out, out


def _skewed_training(d: Path, coef: float, steps: int = 40) -> list[list[int]]:
    """The banded model trained in process on band-0 tokens only (layer 0 routes them all to
    experts 0-3) with the trainer's loss; the layer-0 expert load of each step."""
    from zerotrain.models import build_workload, resolve
    from zerotrain.models.config import ModelConfig
    from helpers import lm_bundle
    torch.manual_seed(0)
    wl = build_workload(resolve(ModelConfig(name=f"hf:{d}", router_aux_loss_coef=coef)), lm_bundle(MOE_VOCAB))
    opt = torch.optim.AdamW(wl.model.parameters(), lr=1e-2)
    loads = []
    for _ in range(steps):
        x = torch.randint(0, MOE_VOCAB // 2, (4, SEQ + 1))
        wl.loss(wl.model, {"input_ids": x[:, :-1], "labels": x[:, 1:]}).backward()
        opt.step()
        opt.zero_grad()
        loads.append(wl.moe.window(SimpleNamespace(num_processes=1))[0]["moe/expert_tokens"][0])
    return loads


def test_aux_loss_moves_the_router_towards_balance_on_skewed_data(tmp_path):
    """Skewed data (one token band) trained with and without the aux loss: the load spread of layer 0."""
    d = save_tiny_moe(tmp_path / "m")
    without, with_aux = _skewed_training(d, 0.0), _skewed_training(d, 1.0)
    assert without[0] == with_aux[0] and sum(without[0][4:]) == 0  # the same start: experts 4-7 idle
    late = lambda loads: [sum(col) for col in zip(*loads[-10:])]  # noqa: E731 - the last 10 steps' load
    spread = lambda load: max(load) / (sum(load) / len(load))  # noqa: E731
    print(f"layer-0 load, last 10 steps: without aux {late(without)}, with aux (coef 1) {late(with_aux)}")
    # Without it the router collapses onto 2 of the 4 experts it can reach; with it all 4 keep tokens
    # (experts 4-7 stay out of reach in 40 steps: the band's embedding sign outweighs the router's update).
    assert sorted(late(without)[:4])[:2] == [0, 0]
    assert min(late(with_aux)[:4]) > 0.1 * sum(late(with_aux)) / 4
    assert spread(late(with_aux)) < 0.75 * spread(late(without))


def test_an_idle_expert_is_warned_about_after_five_intervals(tmp_path):
    from zerotrain.models import build_workload, resolve
    from zerotrain.models.config import ModelConfig
    from helpers import lm_bundle
    wl = build_workload(resolve(ModelConfig(name=f"hf:{save_tiny_moe(tmp_path / 'm')}")), lm_bundle(MOE_VOCAB))
    x = torch.randint(0, MOE_VOCAB // 2, (2, SEQ))  # band 0 only: layer 0's experts 4-7 get nothing
    warned = []
    with torch.no_grad():
        for _ in range(6):
            wl.loss(wl.model, {"input_ids": x, "labels": x})
            warned.append(wl.moe.window(SimpleNamespace(num_processes=1))[1])
    assert warned[:4] == [[]] * 4 and warned[5] == []  # said once, at the fifth interval
    assert warned[4][0].startswith("MoE: experts 4, 5, 6, 7 of sparse layer 0 got under 1% of an even share of "
                                   "tokens for 5 log intervals in a row"), warned[4]
    assert len(warned[4]) <= 2  # one line per sparse layer
