"""The parts of build() (train/training/build.py), in order. Each takes the run config and the
results of the parts before it, and returns a small typed result; the run record is
train/training/record.py. ("Stage" is kept for ZeRO's stages.)"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from zerotrain.models import build_workload, hidden_size_of, partition_summary
from zerotrain.models import resolve as resolve_model
from zerotrain.train import testhooks
from zerotrain.train.checkpoint.manager import Checkpointer
from zerotrain.train.checkpoint.state import TrainState
from zerotrain.train.config import RunConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.sampler import GlobalBatchSampler
from zerotrain.train.data.sequence_length import resolve_seq_len
from zerotrain.train.strategy import Strategy, for_setup
from zerotrain.train.strategy.ds_config import load_ds_setup
from zerotrain.train.errors import ConfigError
from zerotrain.train.launch import collectives, device_env, ds_config_choice
from zerotrain.train.launch import distributed as dist_
from zerotrain.train.launch import elastic as elastic_
from zerotrain.train.launch import host_settings, hub_fetch, launcher_watch, shm_buffers
from zerotrain.train.launch import sequence_parallel as sp_
from zerotrain.train.observe import trackers
from zerotrain.train.observe.metrics import Loggers
from zerotrain.train.plan import memory_check
from zerotrain.train.plan import memory_plan as plan_
from zerotrain.train.training import hardware, rank_file
from zerotrain.train.training.loaders import Loaders, build_loaders
from zerotrain.train.training.preference_setup import (attach_reference, check_reference_compute, precomputed_reference,
                                                        preference)
from zerotrain.train.training.evaluate import Evaluator, cast_floats
from zerotrain.train.training.features import Services as FeatureServices
from zerotrain.train.training.features import build_features

if TYPE_CHECKING:
    from accelerate import Accelerator

    from zerotrain.models.spec import ModelSpec
    from zerotrain.models.workload import Workload
    from zerotrain.train.config import Batch
    from zerotrain.train.data.bundle import DataBundle
    from zerotrain.train.launch.device_memory import Budget
    from zerotrain.train.launch.distributed import Topology
    from zerotrain.train.launch.elastic import ElasticRun
    from zerotrain.train.launch.host_settings import HostSettings
    from zerotrain.train.launch.sequence_parallel import SPRun
    from zerotrain.train.plan.memory_plan import MemoryPlan


# ---------------------------------------------------------------------------- runtime

@dataclass
class Runtime:
    launcher: str
    world: int
    cuda: bool
    local_world: int                 # this node's ranks
    matmul_precision: Optional[str]  # set on CUDA (hardware.tf32)
    threads: int                     # torch's intra-op threads in this rank
    threads_from: str                # why that many (train/launch/device_env.py THREADS_FROM)
    run_dir: Path
    elastic: Optional[ElasticRun]    # torchrun's agent: this attempt of the job
    sp_size: int                     # distributed.sequence_parallel (1: off)
    batch: Batch                     # per data-parallel rank: an SP group shares its samples
    resume: str                      # checkpoint.resume, or "auto" for an elastic restart of the same job


def set_up_runtime(cfg: RunConfig) -> Runtime:
    """The launcher's world, this process's threads and TF32, the run directory, and under
    torchrun's agent whether this start is a restart of the same job."""
    launcher = dist_.normalize_env()
    launcher_watch.watch(launcher, int(os.environ["RANK"]))  # a SIGTERM to the 1-node `deepspeed` runner reaches us
    collectives.enable(cfg)  # debug.collectives: before any process group exists
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    matmul_precision = hardware.apply_tf32(cfg, cuda)
    local_world = dist_.node_layout(os.environ, int(os.environ["RANK"]), world)[2]
    run_dir = Path(cfg.train.run_dir)
    _check_run_dir(run_dir, cfg.checkpoint.export)
    elastic = _elastic_join(cfg, run_dir, world, launcher)
    # A restart of the same job resumes and keeps its global batch: derived, cfg stays as loaded.
    resume, train = elastic.layout(cfg) if elastic is not None else (cfg.checkpoint.resume, cfg.train)
    sp_size = sp_.size(cfg, world)
    batch = train.batch(world // sp_size)
    return Runtime(launcher=launcher, world=world, cuda=cuda, local_world=local_world,
                   matmul_precision=matmul_precision, threads=torch.get_num_threads(),
                   threads_from=device_env.THREADS_FROM, run_dir=run_dir, elastic=elastic,
                   sp_size=sp_size, batch=batch, resume=resume)


def _check_run_dir(run_dir: Path, export: bool):
    """On every rank, before the data and the model: the run directory can be written, and so can
    the checkpoint directory and (with checkpoint.export) the export directory where an earlier
    run left them (a read-only mount, another owner), so that a save does not fail only at its
    first step, or in a background write. A ConfigError naming the directory and the fix."""
    from zerotrain.train.checkpoint.save import unwritable
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"train.run_dir {unwritable(run_dir, e)}") from None
    for d, what in ((run_dir, "train.run_dir"), (run_dir / "checkpoints", "the checkpoint directory"),
                    (run_dir / "export", "the export directory (checkpoint.export)")):
        if d.is_dir() and (export or d.name != "export"):
            try:
                probe = d / f".write-test-{os.getpid()}"
                probe.write_text("ok")
                probe.unlink()
            except OSError as e:
                raise ConfigError(f"{what} {unwritable(d, e)}") from None


def _elastic_join(cfg: RunConfig, run_dir: Path, world: int, launcher: str) -> Optional[ElasticRun]:
    """Under torchrun's elastic agent: whether this start is a restart of the same job
    (train/launch/elastic.py), agreed by every rank over a process group made now (Accelerate and
    DeepSpeed adopt it); a restart then resumes and keeps the job's global batch. None otherwise."""
    if launcher != "torchrun" or not elastic_.active():  # (accelerate's multi-node agent: not covered yet)
        return None
    dist_.init_process_group(collectives.timeout_s(cfg))
    env = os.environ
    node_rank, _, _ = dist_.node_layout(env, int(env["RANK"]), world)
    return elastic_.ElasticRun.join(run_dir, int(env["RANK"]), world, node_rank, dist_.node_addr())


# ---------------------------------------------------------------------------- data

@dataclass
class RunData:
    spec: ModelSpec            # the model resolved once: family, context, vocabulary, the HF config
    seq_len: Optional[int]     # tokens per sample of language-model data
    bundle: DataBundle
    sampler: object            # the resumable global order: GlobalBatchSampler, MixtureSampler, StreamSampler
    max_steps: int
    hub: list                  # the Hub ids the run names, with their commits (train/launch/hub_fetch.py)


def load_data(cfg: RunConfig, rt: Runtime) -> RunData:
    """The data first: the model's vocabulary / classes / features come from it. Hub ids
    (hf:<org>/<name>[@rev]) are fetched into the cache before anything reads them."""
    fetched = hub_fetch.fetch(cfg, collectives.timeout_s(cfg), say=lambda line: print(line, flush=True))
    spec = resolve_model(cfg.model)  # the model checked and its config.json read, once for the whole build
    hardware.check_attention(spec, rt.cuda)
    seq_len = resolve_seq_len(cfg, spec)
    # sft: data.tokenizer, else an hf:<dir> model's own tokenizer, else bytes (the GPT presets)
    tokenizer = cfg.data.tokenizer or (spec.name[3:] if spec.family == "hf" else None)
    bundle = build_data(cfg.data, seq_len, cfg.train.seed, tokenizer)
    if precomputed_reference(cfg):
        attach_reference(cfg, spec, seq_len, bundle)
    sampler = _sampler(cfg, bundle, rt.batch)
    max_steps = cfg.train.epochs * sampler.steps_per_epoch if cfg.train.epochs else cfg.train.max_steps
    return RunData(spec=spec, seq_len=seq_len, bundle=bundle, sampler=sampler, max_steps=max_steps, hub=fetched)


def _sampler(cfg: RunConfig, bundle: DataBundle, b: Batch):
    """The resumable global order of the training samples. The mixture and stream samplers are
    imported by their data kinds only, as train/data/__init__.py imports their builders (start-up time)."""
    if bundle.mixture is not None:  # data.sources: the same order, positions tagged with their epoch
        from zerotrain.train.data.mixture import MixtureSampler
        return MixtureSampler(bundle.mixture, b.micro, b.world, b.accum, cfg.train.seed)
    if bundle.stream is not None:  # data.kind stream: one endless epoch, windows shuffled in groups (no train.epochs)
        from zerotrain.train.data.stream import StreamSampler
        return StreamSampler(cfg.data.shuffle_windows, b.micro, b.world, b.accum, cfg.train.seed)
    return GlobalBatchSampler(len(bundle.train), b.micro, b.world, b.accum, cfg.train.seed, tag_epoch=bundle.epoch_tagged)


# ---------------------------------------------------------------------------- strategy

@dataclass
class Distributed:
    strategy: Strategy              # the backend: plain DDP or DeepSpeed ZeRO (train/strategy/)
    choice: Optional[memory_check.AutoChoice]    # --ds-config auto: what it chose and why
    acc: Accelerator
    topo: Topology
    sp: Optional[SPRun]             # this rank's sequence-parallel group; None: off
    planned: MemoryPlan             # the run's one memory plan, and the check's (train/plan/memory_plan.py)
    budget: Optional[Budget]        # the memory every rank agreed on
    host: HostSettings              # malloc settings the check asked for
    rank_facts: dict                # this rank's ranks/rank<R>.json, written once by prepare()


def choose_strategy(cfg: RunConfig, ds_config_cli: Optional[str], rt: Runtime, data: RunData) -> Distributed:
    """The DeepSpeed JSON (or DDP), the Accelerator, this rank's place, and the memory check
    before the model exists: a plan that does not fit the device memory stops here."""
    strategy, choice, view = _ds_setup(cfg, ds_config_cli, rt, data)
    ds = strategy.ds
    shm_buffers.sweep_at_start()  # before DeepSpeed creates this job's own
    acc = strategy.build_accelerator(rt.batch, collectives.timeout_s(cfg))
    rt.threads = torch.get_num_threads()  # as OMP_NUM_THREADS set it (train/launch/device_env.py cpu_threads)
    topo = dist_.topology(rt.launcher, "nccl" if rt.cuda else "gloo")
    dist_.check_world(acc, topo)
    collectives.StackOnRequest.start_for(topo.rank)  # debug.collectives: a peer may ask for this rank's stack
    sp = sp_.SPRun.join(rt.sp_size, topo.rank, topo.world_size, data.spec.family) if rt.sp_size > 1 else None
    trackers.preflight(acc, cfg)  # a tracker's package missing, W&B online without credentials: every rank stops
    rank_facts = rank_file.rank_facts(acc, topo, strategy)
    planned = plan_.make(cfg, data.spec, ds, data.bundle, rt.batch, data.seq_len, rt.world, topo.rank, topo.device,
                         acc.is_main_process, view, choice)  # and the memory check
    # Compact malloc only where the plan would not fit without it (train/launch/host_settings.py).
    host = host_settings.apply(host_settings.decide(cfg, strategy, rt.cuda, planned.checked, planned.budget))
    return Distributed(strategy=strategy, choice=choice, acc=acc, topo=topo, sp=sp, planned=planned,
                       budget=planned.budget, host=host, rank_facts=rank_facts)


def _ds_setup(cfg: RunConfig, ds_config_cli: Optional[str], rt: Runtime, data: RunData):
    """(the Strategy, --ds-config auto's AutoChoice or None, this rank's memory view) once checked."""
    given = ds_config_cli or cfg.distributed.ds_config
    ds_path = ds_config_choice.resolve_ds_config_path(given, rt.launcher)
    if not given and rt.launcher != "accelerate" and os.environ.get("RANK", "0") == "0":
        name, why = ds_config_choice.default_ds_config()
        print(f"zerotrain: no --ds-config given: ds_configs/{name} ({why}); pass --ds-config to choose", flush=True)
    view = memory_check.measure(cfg, ds_path)  # the memory budget: one view for the check and --ds-config auto
    ds_path, choice = memory_check.resolve_auto(ds_path, cfg, data.spec, data.bundle, rt.batch, data.seq_len, rt.world, view)
    ds = load_ds_setup(ds_path, cfg, sp_.engine_batch(rt.batch, rt.sp_size), data.max_steps, cuda=rt.cuda,
                 hidden_size=hidden_size_of(data.spec, data.bundle))
    strategy = for_setup(ds)
    sp_.refuse_unsupported(cfg, data.spec, data.seq_len, strategy)
    strategy.check_run(cfg)
    if precomputed_reference(cfg):  # once the strategy is known: was the file computed as it computes?
        check_reference_compute(data.bundle, strategy, "cuda" if rt.cuda else "cpu")
    return strategy, choice, view


# ---------------------------------------------------------------------------- model and optimizer

@dataclass
class Model:
    workload: Workload               # the model (unwrapped), its loss and evaluation statistics
    raw_optimizer: torch.optim.Optimizer
    channels_last: bool


def build_model(cfg: RunConfig, rt: Runtime, data: RunData, dist: Distributed) -> Model:
    """The model, built partitioned under ZeRO-3, and its optimizer: identical initial weights
    on every rank, then a per-rank seed (dropout etc. differ per rank, deterministically)."""
    strategy, acc = dist.strategy, dist.acc
    set_seed(cfg.train.seed)
    workload = build_workload(data.spec, data.bundle, strategy.init_context())
    if dist.sp is not None:
        dist.sp.attach(workload.model)
    partitioned = strategy.partitions_parameters
    if partitioned and acc.is_main_process:
        print(f"zerotrain: {partition_summary(workload.model, dist.topo.world_size)}", flush=True)
    moe = workload.moe_info  # sparse-MoE blocks (hf: or py: models): leaves of partitioned parameters
    if moe is not None:      # before the engine hooks them
        if partitioned and not testhooks.fire("no_moe_leaf"):
            moe.leaf = strategy.make_leaf_modules(workload.model, moe.block_classes)
        if acc.is_main_process:
            print(f"zerotrain: {moe.banner(aux=workload.moe is not None)}", flush=True)
        note = strategy.expect_unused_parameters(f"this model's {moe.num_experts} experts per sparse layer can get "
                                                 f"no tokens on a rank")
        if note and acc.is_main_process:
            print(f"zerotrain: {note}", flush=True)
    if cfg.train.objective == "dpo":
        workload.preference = preference(cfg, workload, strategy, acc.device)
    channels_last = hardware.use_channels_last(cfg, strategy, workload.family, rt.cuda)
    if channels_last:
        workload.model.to(memory_format=torch.channels_last)
    if cfg.hardware.compile:
        workload.model.compile()  # in place: parameter names (checkpoints, exports) stay the same
    raw_optimizer = strategy.build_optimizer(workload.model, cfg.optim)
    set_seed(cfg.train.seed + dist.topo.rank)
    return Model(workload=workload, raw_optimizer=raw_optimizer, channels_last=channels_last)


# ---------------------------------------------------------------------------- loaders

def make_loaders(cfg: RunConfig, rt: Runtime, data: RunData, model: Optional[Model] = None) -> Loaders:
    """torch DataLoaders over the global batch sampler (train/training/loaders.py). `model`: the
    built model, which decides whether instruction data may be padded per batch (data.pad_to
    longest; SftData.pad_to says when it may not)."""
    return build_loaders(cfg, data.sampler, data.bundle, rt.batch, rt.world, rt.local_world, rt.sp_size, rt.cuda,
                         model.workload if model is not None else None)


# ---------------------------------------------------------------------------- prepare

@dataclass
class Prepared:
    """accelerate.prepare's loaders (the engine and optimizers it made are the strategy's)."""
    train_loader: DataLoader
    val_loader: Optional[DataLoader]


def prepare(rt: Runtime, dist: Distributed, model: Model, loaders: Loaders) -> Prepared:
    """accelerate.prepare (the DeepSpeed engine or the DDP wrapper), then what each rank
    records once its engine exists."""
    strategy, topo, workload = dist.strategy, dist.topo, model.workload
    loader_list = [loaders.train] + ([loaders.val] if loaders.val is not None else [])
    train_loader, *val = strategy.prepare(dist.acc, workload.model, model.raw_optimizer, *loader_list)
    # The engine exists, so DeepSpeed's CPU shm all-reduce (if used) is set up on every rank:
    # each rank unlinks its /dev/shm buffer's name now (train/launch/shm_buffers.py).
    released = shm_buffers.release_own_buffer(topo.rank, topo.world_size, strategy.uses_shm_buffers(),
                                              barrier=torch.distributed.barrier)
    facts = dist.rank_facts
    if released is not None:
        facts["shm_buffer_released"] = str(released)
    facts.update(strategy.after_prepare(workload))
    pref = workload.preference
    if pref is not None and pref.reference is not None:  # DPO's frozen copy: in the policy's precision
        pref.reference = strategy.frozen_like_policy(pref.reference)
    if dist.sp is not None:
        facts["sequence_parallel"] = dist.sp.record()
    # What the steps will run with, once every library has started (Accelerate sets a count where
    # OMP_NUM_THREADS is unset: torch was imported before train/main.py could set it).
    facts.update(torch_threads=torch.get_num_threads(), threads_from=device_env.THREADS_FROM,
                 local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "0")))
    rank_file.write_rank_file(rt.run_dir, topo, facts)
    return Prepared(train_loader=train_loader, val_loader=val[0] if val else None)


# ---------------------------------------------------------------------------- services

@dataclass
class Services:
    loggers: Loggers                      # metrics.jsonl on rank 0 (the other trackers join at Trainer.start)
    memory_plan: MemoryPlan               # the run's memory plan (choose_strategy's): banner lines, plan/*
    checkpointer: Checkpointer
    state: TrainState                     # where training starts: restored or fresh
    evaluator: Evaluator                  # the validation split's metrics
    features: list                        # the run's features (train/training/features.py), restored too


def start_services(cfg: RunConfig, rt: Runtime, data: RunData, dist: Distributed, model: Model,
                   prepared: Prepared, record: dict) -> Services:
    """Loggers, the memory plan, the checkpointer, the evaluator, the run's features (registered
    with the checkpointer), and the state the run starts from: a resumed checkpoint
    (checkpoint.resume) or initial weights (model.init_from) are restored here, features
    included."""
    acc, strategy, topo, workload = dist.acc, dist.strategy, dist.topo, model.workload
    loggers = trackers.jsonl(acc, cfg, rt.run_dir)
    # The banner's "model states" and "memory" lines; the plan is compared with mem/* at step 2.
    memory_plan = dist.planned  # made once, before the model existed (train/plan/memory_plan.py)
    # checkpoint.async whose host snapshot would not fit the memory budget: synchronous saves
    ckpt_cfg = dataclasses.replace(cfg.checkpoint, async_=False) if memory_plan.async_off else cfg.checkpoint
    checkpointer = Checkpointer(cfg=ckpt_cfg, run_dir=rt.run_dir, rank=topo.rank, world=topo.world_size,
                                strategy=strategy, workload=workload, sampler=data.sampler, batch=rt.batch,
                                model_name=cfg.model.name, log=loggers.log, resolved_config=record)
    evaluator = Evaluator(cfg=cfg, acc=acc, model=strategy.engine, workload=workload, data=data.bundle,
                          val_loader=prepared.val_loader, seq_parallel=dist.sp,
                          cast=functools.partial(cast_floats, dtype=strategy.input_dtype()))
    features = build_features(FeatureServices(cfg=cfg, holder=checkpointer.holder, evaluator=evaluator,
                                              is_main=acc.is_main_process))
    for f in features:
        if hasattr(f, "state_dict"):
            checkpointer.register(f.name, f)
    state = _restore(checkpointer, cfg, rt.resume)
    if rt.elastic is not None:
        state.wandb_run_id = rt.elastic.run_id_for(state.wandb_run_id)
        rt.elastic.started(state, rt.batch, checkpointer.resumed_from)
    if data.bundle.stream is not None:
        data.bundle.stream.resume_from(state.data_cursor)  # restart reading there, not at the stream's start
    return Services(loggers=loggers, memory_plan=memory_plan, checkpointer=checkpointer, state=state,
                    evaluator=evaluator, features=features)


def _restore(ckpt: Checkpointer, cfg: RunConfig, resume: str) -> TrainState:
    """Checkpoint resume (checkpoint.resume) or initial weights (model.init_from), before
    start(): W&B and the banner see the restored step and run id. Returns the TrainState the
    run starts from (a fresh one unless a checkpoint was resumed)."""
    if cfg.model.lora is not None and cfg.model.init_from:
        # A LoRA checkpoint holds no base: the frozen base weights come from init_from every time.
        ckpt.init_from(cfg.model.init_from)
        resumed = ckpt.resume(resume, load_optimizer=cfg.checkpoint.load_optimizer)
        return resumed if resumed is not None else TrainState()
    resumed = ckpt.resume(resume, load_optimizer=cfg.checkpoint.load_optimizer)
    if cfg.model.init_from and resumed is None:
        ckpt.init_from(cfg.model.init_from)
    return resumed if resumed is not None else TrainState()
