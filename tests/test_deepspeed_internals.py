"""Every DeepSpeed private attribute zerotrain reads (train/strategy/internals.py), checked against
real tiny engines of the installed DeepSpeed: one per optimizer class the project meets on a CPU
(ZeRO-0 fp32: the torch optimizer; ZeRO-0 bf16: FP16_UnfusedOptimizer; ZeRO-1/2:
DeepSpeedZeroOptimizer; ZeRO-3: DeepSpeedZeroOptimizer_Stage3), built in this process on a
one-process gloo group and stepped once. When an upgrade moves an attribute, the accessor fails
with one line naming it and the DeepSpeed version (the last tests prove that message)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import zerotrain.train.strategy.internals as ds

# name -> (stage, bf16)
ENGINES = {"zero0-fp32": (0, False), "zero0-bf16": (0, True), "zero1-bf16": (1, True), "zero2-bf16": (2, True),
           "zero3-bf16": (3, True)}
# ZeRO-3 keeps parameters of at most this many elements whole on every rank: the 4-element bias is
# persistent, the rest partitioned.
PERSISTENCE = 10


def _engine(stage: int, bf16: bool):
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_allow_untested_optimizer": True, "bf16": {"enabled": bf16},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": PERSISTENCE}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                                      config=config)
    x = torch.ones(1, 8, dtype=torch.bfloat16 if bf16 else torch.float32)
    engine.backward(engine(x).float().sum())
    engine.step()  # the optimizer state exists, ZeRO-1/2's fragments are linked
    return engine


@pytest.fixture(scope="module")
def engines():
    import torch.distributed as dist
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    saved = dict(os.environ)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="29517")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")  # the existing group (DeepSpeed's default probes others)
        yield {name: _engine(*how) for name, how in ENGINES.items()}
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(saved)


def _params(engine):
    return list(engine.module.parameters())


# ---------------------------------------------------------------------------- communication

def test_the_shm_all_reduce_probe_reads_an_attribute_deepspeeds_comm_backend_has(engines):
    """train/launch/shm_buffers.py releases DeepSpeed's /dev/shm buffers where ZeroStrategy says the
    op was set up (shm_comm_in_use): the attribute it reads must exist."""
    import deepspeed.comm.comm as ds_comm
    assert "shm_comm_op" in vars(ds_comm.cdb)
    assert ds.shm_comm_in_use() == (ds_comm.cdb.shm_comm_op is not None)


# ---------------------------------------------------------------------------- the engine

@pytest.mark.parametrize("name", list(ENGINES))
def test_engine_counters_round_trip(engines, name):
    e = engines[name]
    assert ds.engine_counters(e) == {"global_steps": 1, "global_samples": 1, "skipped_steps": 0}
    ds.set_engine_counters(e, global_steps=7, global_samples=56, skipped_steps=2, micro_steps=14)
    assert ds.engine_counters(e) == {"global_steps": 7, "global_samples": 56, "skipped_steps": 2}
    assert ds.skipped_steps(e) == 2 and e.micro_steps == 14
    ds.set_engine_counters(e, global_steps=1, global_samples=1, skipped_steps=0, micro_steps=1)


# ---------------------------------------------------------------------------- the loss scale

@pytest.mark.parametrize("name", ["zero0-bf16", "zero1-bf16", "zero2-bf16", "zero3-bf16"])
def test_loss_scaler_is_found_and_round_trips(engines, name):
    opt = engines[name].optimizer
    assert ds.loss_scale(opt) == 1.0  # bf16: a static scale of 1
    fields = ds.scaler_fields(ds.loss_scaler(opt))
    assert fields["cur_scale"] == 1.0
    ds.set_scaler_fields(ds.loss_scaler(opt), {**fields, "cur_scale": 4.0})
    assert ds.loss_scale(opt) == 4.0
    ds.set_scaler_fields(ds.loss_scaler(opt), fields)


# ---------------------------------------------------------------------------- ZeRO-0 bf16

def test_master_copies_of_zero0_bf16(engines):
    opt = engines["zero0-bf16"].optimizer
    assert ds.has_master_copies(opt) and not ds.has_fp32_partitions(opt)
    groups = ds.lp_groups(opt)
    flats, per_param = ds.master_copies(opt)
    assert flats is None  # FP16_UnfusedOptimizer (torch AdamW): one fp32 copy per parameter
    assert [[t.shape for t in g] for g in per_param] == [[p.shape for p in g] for g in groups]
    assert all(t.dtype == torch.float32 for g in per_param for t in g)
    assert not ds.has_master_copies(engines["zero0-fp32"].optimizer)  # the torch optimizer itself


# ---------------------------------------------------------------------------- ZeRO-1/2

@pytest.mark.parametrize("name", ["zero1-bf16", "zero2-bf16"])
def test_fragments_of_zero12(engines, name):
    e = engines[name]
    opt = e.optimizer
    assert ds.has_fp32_partitions(opt)
    groups, flats = ds.bit16_groups(opt), ds.fp32_partitions(opt)
    assert len(groups) == len(flats) and sum(f.numel() for f in flats) == sum(p.numel() for p in _params(e))
    for p in _params(e):
        m = ds.hp_mapping(p)
        assert ds.lp_fragment_range(m) == (0, p.numel())  # one rank owns every element
        start, numel = ds.hp_fragment_range(m)
        assert numel == p.numel() and 0 <= start
        assert torch.equal(ds.hp_fragment(m).to(p.dtype).view_as(p), p.detach())
    before = _params(e)[0].detach().clone()
    with torch.no_grad():
        ds.hp_fragment(ds.hp_mapping(_params(e)[0])).add_(1.0)
    ds.update_lp_params(opt)  # the fp32 partition cast into the bf16 weights
    assert torch.allclose(_params(e)[0].detach().float(), before.float() + 1.0, atol=2 ** -6)  # a bf16 ulp at 2
    with torch.no_grad():
        ds.hp_fragment(ds.hp_mapping(_params(e)[0])).sub_(1.0)
    ds.update_lp_params(opt)


# ---------------------------------------------------------------------------- ZeRO-3

def test_partitions_of_zero3(engines):
    e = engines["zero3-bf16"]
    opt = e.optimizer
    params = dict(e.module.named_parameters())
    assert all(ds.is_zero3_param(p) and ds.has_local_partition(p) for p in params.values())
    assert [n for n, p in params.items() if ds.is_persistent(p)] == ["1.bias"]
    assert {n: ds.full_shape(p) for n, p in params.items()} == {
        "0.weight": (16, 8), "0.bias": (16,), "1.weight": (4, 16), "1.bias": (4,)}
    assert {n: ds.full_numel(p) for n, p in params.items()} == {"0.weight": 128, "0.bias": 16, "1.weight": 64,
                                                               "1.bias": 4}
    assert all(ds.partition_numel(p) == ds.full_numel(p) == ds.local_partition(p).numel() for p in params.values())
    assert all(p.numel() == 0 for n, p in params.items() if n != "1.bias")  # released after the step
    subs = ds.fp32_sub_groups(opt)
    assert len(subs) == len(ds.lp_sub_groups(opt))
    for g in ds.lp_groups(opt):
        for p in g:
            assert 0 <= ds.sub_group(opt, p) < len(subs) and ds.partition_rank(opt, p) == 0
    w = params["0.weight"]
    before = ds.local_partition(w).detach().clone()
    ds.partition_all(opt)
    with torch.no_grad():
        subs[ds.sub_group(opt, w)].add_(1.0)
    ds.refresh_lp_partitions(opt)  # the fp32 partitions cast into the bf16 partitions
    assert torch.allclose(ds.local_partition(w).detach().float(), before.float() + 1.0, atol=2 ** -6)
    assert params["1.bias"].numel() == 4  # the persistent one gathered again
    with torch.no_grad():
        subs[ds.sub_group(opt, w)].sub_(1.0)
    ds.partition_all(opt)
    ds.refresh_lp_partitions(opt)


# ---------------------------------------------------------------------------- the memory probe

def test_memory_probe_finds_what_each_class_keeps(engines):
    """train/strategy/state_bytes.py's measure() asks each ZeRO optimizer for what it keeps: every name it
    lists is found on the class that keeps it (the others: offload, fp16 and BF16_Optimizer, which
    a CPU cannot build)."""
    found = {name: {n for n in (*ds.PARAM_FLATS, ds.LP_PARTITIONS, *ds.GRAD_STORES, ds.GRAD_PARTITION_BUFFER,
                                *ds.MASTER_FLATS, ds.CPU_GRADS) if ds.probe(ds.zero_optimizer(e), n) is not None}
             for name, e in engines.items()}
    stage12 = {"bit16_groups_flat", "averaged_gradients", "all_grad_tensors", "single_partition_of_fp32_groups"}
    assert found["zero1-bf16"] == found["zero2-bf16"] == stage12
    assert found["zero3-bf16"] == {"fp16_partitioned_groups_flat", "averaged_gradients",
                                   "grad_partitions_flat_buffer", "fp32_partitioned_groups_flat"}
    assert all(ds.offloads(ds.zero_optimizer(e)) == (False, False) for e in engines.values())
    assert ds.zero_optimizer(engines["zero2-bf16"]) is engines["zero2-bf16"].optimizer
    assert ds.zero_optimizer(torch.nn.Linear(1, 1)) is None
    assert all(hasattr(ds.zero_optimizer(engines[z]), "optimizer") for z in ("zero1-bf16", "zero2-bf16", "zero3-bf16"))


# ---------------------------------------------------------------------------- when an upgrade moves one

STRICT = [  # (accessor, arguments after the object, the attribute it names)
    (ds.engine_counters, (), "global_steps"),
    (ds.skipped_steps, (), "skipped_steps"),
    (lambda o: ds.set_engine_counters(o, 1, 1, 0, 1), (), "global_steps"),
    (ds.loss_scale, (), "loss_scale"),
    (ds.loss_scaler, (), "loss_scaler.cur_scale or loss_scale_config.cur_scale"),
    (ds.lp_groups, (), "fp16_groups"),
    (ds.master_copies, (), "fp32_groups"),
    (ds.bit16_groups, (), "bit16_groups or bf16_groups"),
    (ds.fp32_partitions, (), "single_partition_of_fp32_groups or fp32_groups_flat_partition"),
    (ds.hp_mapping, (), "_hp_mapping"),
    (ds.lp_fragment_range, (), "lp_fragment_address"),
    (ds.hp_fragment, (), "hp_fragment"),
    (ds.hp_fragment_range, (), "get_hp_fragment_address"),
    (ds.update_lp_params, (), "update_lp_params"),
    (ds.local_partition, (), "ds_tensor"),
    (ds.partition_numel, (), "partition_numel"),
    (ds.sub_group, (None,), "grad_position"),
    (ds.partition_rank, (None,), "_get_param_partition_rank"),
    (ds.fp32_sub_groups, (), "fp32_partitioned_groups_flat"),
    (ds.lp_sub_groups, (), "fp16_partitioned_groups_flat"),
    (ds.partition_all, (), "checkpoint_event_prologue"),
    (ds.refresh_lp_partitions, (), "fp16_partitioned_groups_flat"),
]


@pytest.mark.parametrize("accessor,args,attribute", STRICT, ids=[a for _, _, a in STRICT])
def test_a_moved_attribute_fails_in_one_line_naming_it_and_the_version(accessor, args, attribute):
    from importlib.metadata import version
    moved = SimpleNamespace()  # an object of an upgraded DeepSpeed that keeps none of them
    with pytest.raises(ds.DeepSpeedInternalsError) as e:
        accessor(moved, *args)
    assert str(e.value) == (f"DeepSpeed {version('deepspeed')}: SimpleNamespace has no attribute {attribute} "
                            f"(train/strategy/internals.py)")


def test_a_zero3_parameter_without_its_size_fails_in_one_line():
    moved = SimpleNamespace(ds_id=1, ds_shape=(2,))  # ds_numel renamed
    with pytest.raises(ds.DeepSpeedInternalsError, match=r"^DeepSpeed \S+: SimpleNamespace has no attribute "
                                                          r"ds_numel \(train/strategy/internals.py\)$"):
        ds.full_numel(moved)
    assert ds.full_shape(moved) == (2,) and ds.full_numel(torch.zeros(3)) == 3
