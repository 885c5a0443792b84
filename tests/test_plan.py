"""zerotrain plan: model-state arithmetic against hand-computed values, the activation model
against autograd's saved tensors, the recommendation as memory shrinks, and the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from zerotrain.train import paths
from zerotrain.train.commands import plan as plan_cli
from zerotrain.train.plan import estimate as plan
from zerotrain.train.plan.activations import activation_bytes
from zerotrain.train.plan.estimate import Cluster, estimate, make_plan
from zerotrain.train.plan.shapes import BatchShape, count_shape, gpt_shape
from zerotrain.train.strategy import cost
from zerotrain.train.strategy.option import Option

PSI, N = 1_000_000_000, 8           # 1e9 is a multiple of 2N: no flat-buffer padding
OPTIONS = dict(plan.OPTIONS)


def strategy(name: str, precision: str = "bf16", accum_dtype: str | None = None):
    label = {v: k for k, v in plan.OPTIONS}.get(f"{name}.json", name)
    s = Option.from_json(label, paths.DS_CONFIGS / f"{name}.json", precision)
    if accum_dtype is not None and s.backend == "deepspeed":  # ZeRO's accumulation dtype (DDP accumulates in fp32)
        s = dataclasses.replace(s, settings=dataclasses.replace(s.settings, grad_accum_fp32=accum_dtype == "fp32"))
    return s


def states(name, precision="bf16", accum=1, psi=PSI, n=N, accum_dtype="bf16"):
    e = estimate(count_shape(psi), strategy(name, precision, accum_dtype), n,
                 BatchShape(micro=1, seq_len=None, accum=accum))
    return e


def test_zero_paper_mixed_precision_model_states():
    # ZeRO paper, mixed-precision Adam (K = 12), gradients kept in bf16 (DeepSpeed's own default):
    # DDP 16Ψ, ZeRO-1 4Ψ+12Ψ/N, ZeRO-2 2Ψ+14Ψ/N, ZeRO-3 16Ψ/N.
    assert states("ddp").model_states == 16_000_000_000
    assert states("zero1", accum=2).model_states == 4_000_000_000 + 1_500_000_000
    assert states("zero2").model_states == 2_000_000_000 + 1_750_000_000
    assert states("zero3").model_states == 2_000_000_000
    z2 = states("zero2")
    assert (z2.params, z2.grads, z2.optimizer) == (2_000_000_000, 250_000_000, 1_500_000_000)


def test_fp32_gradient_accumulation_under_bf16():
    # The shipped bf16 JSONs accumulate in fp32 (train/strategy/zero.py): 4 bytes per held gradient element;
    # ZeRO-1 becomes DeepSpeed's BF16_Optimizer with fp32 accumulators for every parameter
    # (+ the bf16 gradients backward writes before they are added in).
    assert strategy("zero2").settings.grad_accum_fp32 and not strategy("zero0").settings.grad_accum_fp32
    z1, z2, z3 = (states(n, accum_dtype=None) for n in ("zero1", "zero2", "zero3"))
    assert (z1.params, z1.grads, z1.optimizer) == (2 * PSI, 6 * PSI, 12 * PSI // N)
    assert (z2.params, z2.grads, z2.optimizer) == (2 * PSI, 4 * PSI // N, 12 * PSI // N)
    assert (z3.params, z3.grads, z3.optimizer) == (2 * PSI // N, 4 * PSI // N, 12 * PSI // N)


def test_what_deepspeed_allocates_beyond_the_paper():
    # ZeRO-1 reduces at the accumulation boundary only: without accumulation it holds a partition.
    assert states("zero1", accum=1).model_states == states("zero2").model_states
    # fp32 training: DeepSpeed still keeps a separate fp32 master partition (12 bytes/owned element).
    assert states("zero2", "fp32").model_states == 4_000_000_000 + 500_000_000 + 1_500_000_000
    assert states("zero3", "fp32").model_states == 500_000_000 + 500_000_000 + 1_500_000_000
    # DDP under Accelerate autocast keeps fp32 params and grads whatever the precision.
    assert states("ddp", "fp32").model_states == states("ddp", "bf16").model_states
    # Reduce buckets are "auto" (the model width squared); a bare parameter count has no width, so
    # DeepSpeed's 5e8-element default stands in: overlap_comm -> two bf16 buffers, allocated whole on CUDA.
    assert states("zero2").buffers == 2 * 500_000_000 * 2


def test_offload_moves_optimizer_states_to_the_host():
    z2o, z3o = states("zero2_offload"), states("zero3_offload")
    assert z2o.model_states == 2 * PSI                          # only the bf16 params stay on the device
    assert z2o.host == (4 + 4 + 8 + 2) * PSI // N               # master, fp32 grads, moments, bf16 staging
    accumulating = states("zero2_offload", accum=4)                 # + bf16 per-tensor accumulators
    assert accumulating.host == z2o.host + 2 * PSI // N
    assert z3o.model_states == 0
    assert z3o.host == (2 + 2 + 4 + 12) * PSI // N              # params, grads, fp32 grads, master + moments
    assert states("zero2_offload").comm == states("zero2").comm


def test_gpt_shapes_match_the_real_model():
    from zerotrain.models.gpt import GPT, PRESETS, preset
    from zerotrain.train.optim.optimizer import param_groups
    for name in ("gpt-tiny", "gpt2-124m", "gpt-1.3b", "gpt-7b"):
        assert gpt_shape(name, PRESETS[name]).num_params == PRESETS[name].num_params()
    for cfg in (preset("gpt-tiny"), preset("gpt-tiny", tie_embeddings=False, n_layer=3)):
        shape = gpt_shape("x", cfg)
        real = [[p.numel() for p in g["params"]] for g in param_groups(GPT(cfg), 0.1)]
        assert [list(g) for g in shape.groups] == real     # same tensors, groups and order as DeepSpeed sees


def test_zero12_partition_holds_whole_straddling_tensors():
    # One group of tensors [10, 6], N=2: padded to 16, partitions [0,8) and [8,16).
    assert cost._zero12_partition([(10, 6)], 2, 0) == (8, 10)
    assert cost._zero12_partition([(10, 6)], 2, 1) == (8, 16)


def test_zero3_keeps_small_tensors_whole():
    from zerotrain.models.gpt import preset
    cfg = preset("gpt-tiny", d_model=256)     # proj (65k) and tok_emb (65k) are under the 1e5 threshold
    shape = gpt_shape("x", cfg)
    e = estimate(shape, strategy("zero3", "fp32"), 2, BatchShape(1, 64))
    persistent = sum(t for t in shape.tensors if t <= 100_000)
    assert 0 < persistent < shape.num_params
    assert e.params == 4 * sum(-(-t // 2) for t in shape.tensors) + 4 * persistent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_estimate_matches_saved_tensors(dtype):
    import torch.nn.functional as F
    from zerotrain.models.gpt import GPT, preset
    cfg = preset("gpt-tiny", d_model=128, n_layer=3, seq_len=32)
    model = GPT(cfg).to(dtype).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    idx = torch.randint(0, 256, (4, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(idx).float()
        F.cross_entropy(out.view(-1, out.size(-1)), idx.view(-1))
    elem = 4 if dtype == torch.float32 else 2
    predicted = activation_bytes(cfg, BatchShape(4, 32), elem)
    # The estimate adds the head's backward transients (fp32 log-prob grad + logits) on top.
    transients = 4 * 32 * (4 + elem) * cfg.vocab_size
    assert abs(predicted - transients - sum(saved.values())) / sum(saved.values()) < 0.03


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_document_mask_is_saved_once_and_planned_once(dtype):
    """Packed rows / document-masked windows: every layer saves the same (B, 1, T, T) mask (no
    per-layer copy), and the estimate counts it once. T >> d_model so that a per-layer copy
    would be far outside the tolerance."""
    import torch.nn.functional as F
    from zerotrain.models.gpt import GPT, preset
    B, T = 2, 256
    cfg = preset("gpt-tiny", d_model=32, n_layer=3, seq_len=T)
    model = GPT(cfg).to(dtype).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, squares = {}, set()

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            if t.shape[-2:] == (T, T):
                squares.add(t.untyped_storage().data_ptr())
        return t

    idx = torch.randint(0, 256, (B, T))
    doc = (torch.arange(T) >= 100).long().expand(B, T)              # two documents per row
    pos = torch.arange(T) - 100 * doc
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(idx, position_ids=pos, doc_ids=doc).float()
        F.cross_entropy(out.view(-1, out.size(-1)), idx.view(-1))
    elem = 4 if dtype == torch.float32 else 2
    assert len(squares) == 1                                          # one mask for the 3 layers
    predicted = activation_bytes(cfg, BatchShape(B, T, document_mask=True), elem)
    assert predicted - activation_bytes(cfg, BatchShape(B, T), elem) == B * T * T * elem
    transients = B * T * (4 + elem) * cfg.vocab_size
    assert abs(predicted - transients - sum(saved.values())) / sum(saved.values()) < 0.03


def test_recommendation_moves_from_ddp_to_zero_to_offload_as_memory_shrinks():
    from zerotrain.models.gpt import PRESETS
    shape = gpt_shape("gpt-1.3b", PRESETS["gpt-1.3b"])
    batch = BatchShape(micro=1, seq_len=2048, accum=2, checkpointing=True)

    def pick(gib, devices=8):
        p = make_plan(shape, Cluster(1, devices, int(gib * 2**30), 512 * 2**30), batch)
        return p.recommended.option.label if p.recommended else None

    # 8 devices, bf16 with fp32 accumulation: DDP 16Ψ (+ autocast copies) -> ZeRO-1 2Ψ+6Ψ+12Ψ/N
    # -> ZeRO-2 2Ψ+16Ψ/N -> ZeRO-3 18Ψ/N -> offloaded.
    assert [pick(g) for g in (80, 14, 9, 6.5, 4, 1)] == [
        "DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "ZeRO-3 + param/opt offload", None]
    # One device: partitioning saves nothing, offloading the optimizer does.
    assert [pick(g, devices=1) for g in (40, 8)] == ["DDP", "ZeRO-2 + opt offload"]
    # The recommendation is the fastest option that fits with the headroom.
    p = make_plan(shape, Cluster(1, 8, 9 * 2**30, None), batch)
    fits = [r for r in p.rows if r.device_total <= 0.9 * 9 * 2**30]
    assert p.recommended is fits[0] and all(r.fits == (r in fits) for r in p.rows)


def test_cli_json_and_table(capsys):
    assert plan_cli.main(["gpt-1.3b", "--device-mem", "40GB", "--gpus-per-node", "8", "--micro-batch", "2",
                      "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [o["option"] for o in out["options"]] == [label for label, _ in plan.OPTIONS]
    assert out["world"] == 8 and out["cluster"]["device_mem"] == 40 * 10**9
    assert out["recommended"] in [o["option"] for o in out["options"] if o["fits"]]
    assert plan_cli.main(["350M", "--device-mem", "16GiB", "--gpus-per-node", "4"]) == 0
    text = capsys.readouterr().out
    assert "ZeRO-3 + param/opt offload" in text and "recommended:" in text and "activations unknown" in text


def test_cli_reads_a_run_file(tmp_path, capsys):
    run = tmp_path / "run.yaml"
    run.write_text("model: {name: gpt2-124m}\ntrain: {micro_batch_size: 4, grad_accum_steps: 2}\n"
                   "data: {seq_len: 512}\n")
    assert plan_cli.main([str(run), "--device-mem", "24GB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batch"] == {"micro": 4, "seq_len": 512, "accum": 2, "checkpointing": False, "sequence_parallel": 1,
                            "document_mask": False, "reference_copy": False, "ema_copy": False}
    assert out["model"] == "gpt2-124m"


@pytest.mark.parametrize("argv, words", [
    (["gpt-13b"], ["gpt-1.3b", "preset"]),
    (["gpt2-124m", "--device-mem", "80XB"], ["--device-mem", "80GB"]),
    (["gpt2-124m", "--gpu-per-node", "8"], ["--gpus-per-node"]),
    ([], ["needs a MODEL"]),
    (["gpt2-124m", "--node", "2"], ["unknown option '--node'", '"--nodes"']),  # no abbreviations
    (["gpt2-124m", "--nodes"], ["--nodes needs a value"]),
    (["gpt2-124m", "--nodes", "two"], ["--nodes 'two' is not a int"]),
    (["gpt2-124m", "gpt-tiny"], ["one MODEL only"]),
    (["gpt-tiny", "--seq-len", "4096"], ["context length"]),
])
def test_cli_errors_say_what_to_fix(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        plan_cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert all(w in err for w in words), err


def test_plan_is_a_zerotrain_command():
    from zerotrain.train.cli import COMMANDS
    assert COMMANDS["plan"][:2] == ("zerotrain.train.commands.plan", "main")


@pytest.mark.parametrize("model", ["gpt-tiny", "hf-llama", "hf-llama+lora", "linear"])
def test_the_runs_memory_plan_sizes_the_model_the_run_builds(model, tmp_path):
    """The run's one memory plan (train/plan/memory_plan.py) is sized before the model exists, from
    the model on the meta device: the same tensors, in the same optimizer groups, frozen and
    trained, as the model build_workload then makes (what the banner and plan/* speak of)."""
    from helpers import save_tiny
    from zerotrain.models import build_workload, resolve
    from zerotrain.train.config import load_config
    from zerotrain.train.data import build_data
    from zerotrain.train.plan.memory_check import model_shape
    from zerotrain.train.plan.shapes import module_shape
    name, _, lora = model.partition("+")
    over = [("model.lora.r", "4")] if lora else []
    if name == "hf-llama":
        name = f"hf:{save_tiny('llama', tmp_path / 'llama', 256)}"
    over += ([("data.kind", "regression"), ("data.num_samples", "64"), ("data.num_features", "5")]
             if name == "linear" else [("data.seq_len", "32"), ("data.max_bytes", "20000")])
    cfg = load_config(None, [("model.name", name), *over])
    spec = resolve(cfg.model)
    data = build_data(cfg.data, 32 if spec.family != "linear" else None, 0)
    built = build_workload(spec, data)
    meta = model_shape(spec, data)
    # The width only fills a JSON file's "auto" sizes (Option.from_json); a run's plan prices its
    # resolved JSON (Option.from_setup), whose sizes came from the same hidden_size_of as the meta width.
    assert dataclasses.replace(meta, width=None) == dataclasses.replace(
        module_shape(built.model, spec.name, meta.gpt, built.hidden_size), width=None)
    assert meta.tensors and (meta.frozen != ()) == ("lora" in model)  # LoRA: the base is frozen, the adapters trained


@pytest.mark.parametrize("name,offload", [("ddp", False), ("zero2", False), ("zero3", False),
                                          ("zero2_offload", True), ("zero3_offload", True)])
def test_ema_counts_one_fp32_copy_of_the_master_elements_a_rank_holds(name, offload):
    """train.ema keeps the average of exactly what each rank's moments cover (train/training/ema.py):
    half the moments' 8 bytes per held element, on the device, or on the host under optimizer
    offload; nothing else changes."""
    psi, n = 1_000_000, 4
    base = estimate(count_shape(psi), strategy(name, "bf16"), n, BatchShape(micro=1, seq_len=None))
    ema = estimate(count_shape(psi), strategy(name, "bf16"), n, BatchShape(micro=1, seq_len=None, ema_copy=True))
    held = psi if name == "ddp" else psi // n  # DDP holds every element; ZeRO-2/3 a 1/n share
    assert ema.master == base.master == held
    where = "host" if offload else "buffers"
    assert getattr(ema, where) - getattr(base, where) == 4 * held
    assert ema.device_total - base.device_total == (0 if offload else 4 * held)
