"""Assemble a run from its config: launcher -> DeepSpeed JSON -> Accelerator -> data ->
model -> optimizer -> prepared objects -> Trainer."""

from __future__ import annotations

import contextlib
import json
import os
import platform
from pathlib import Path

import torch

from train import paths
from train.checkpoint.state import TrainState
from train.config import RunConfig
from train.errors import ConfigError
from train.launch import host_settings, shm_buffers
from train.launch import sequence_parallel as sp_


def _init_context(ds):
    """Build the model already partitioned under ZeRO-3 (a model larger than one device's
    memory never exists whole); an ordinary construction otherwise."""
    if ds.is_deepspeed and ds.stage == 3:
        import deepspeed
        return lambda: deepspeed.zero.Init(config_dict_or_path=ds.resolved)
    return contextlib.nullcontext


def _check_run_dir(run_dir: Path):
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"train.run_dir {run_dir} is not writable ({e.strerror}); choose another directory "
                          f"with --train.run_dir") from None


def resolved_config(cfg: RunConfig, ds, batch, topo, max_steps: int, data, workload) -> dict:
    # Versions from the package metadata, not by importing: a DDP run of the GPT imports neither
    # DeepSpeed nor transformers (0.4 s each of a rank's imports here, python -X importtime).
    from importlib.metadata import version
    d = cfg.to_dict()
    d["train"]["grad_accum_steps"] = batch.accum
    d["train"]["global_batch_size"] = batch.global_size
    d["train"]["max_steps"] = max_steps
    d["data"]["seq_len"] = data.seq_len
    if data.mixture is not None:
        d["data"]["mixture"] = data.mixture.record()  # each source's sequences and samples per epoch
    d["model"]["resolved"] = workload.model_config
    if workload.moe is not None:
        d["model"]["resolved"] = {**workload.model_config, "moe": workload.moe.info.record()}
    if workload.lora is not None:
        d["model"]["lora"]["resolved"] = workload.lora  # the target modules chosen, where the base comes from
    d["distributed"]["ds_config"] = ds.path
    d["resolved"] = {
        "deepspeed_config": ds.resolved, "backend": ds.backend, "zero_stage": ds.stage, "precision": ds.precision,
        "world_size": topo.world_size, "num_nodes": topo.num_nodes, "launcher": topo.launcher,
        "device": topo.device, "comm_backend": topo.backend,
        "tokens_per_step": batch.global_size * data.items_per_sample,
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     **{name: version(name) for name in ("deepspeed", "accelerate", "transformers")}},
        "git_commit": _git_commit(),
    }
    return d


def _sweep_shm_buffers():
    """DeepSpeed's /dev/shm buffers that ended jobs left (66 MB each): removed by each node's
    local rank 0 when no running job can own them; a rank's own buffer is released at exit too."""
    import atexit
    atexit.register(shm_buffers.release_at_exit)
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    removed = shm_buffers.sweep_stale()
    if removed:
        print(f"zerotrain: removed {len(removed)} stale DeepSpeed shared-memory buffer(s) of ended jobs from "
              f"{removed[0].parent}", flush=True)


def _write_rank_info(run_dir: Path, acc, topo, ds):
    """Each rank records who it is: what launchers and tests check sharding/topology against."""
    import socket
    d = run_dir / "ranks"
    d.mkdir(parents=True, exist_ok=True)
    info = {**topo.__dict__, "hostname": socket.gethostname(), "pid": os.getpid(),
            "accelerate_process_index": acc.process_index, "accelerate_num_processes": acc.num_processes,
            "distributed_type": str(acc.distributed_type), "strategy": ds.describe(),
            "process_group_size": torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1}
    (d / f"rank{topo.rank}.json").write_text(json.dumps(info, indent=1) + "\n")


def _add_rank_info(run_dir: Path, topo, **more):
    path = run_dir / "ranks" / f"rank{topo.rank}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **more}, indent=1) + "\n")


def _git_commit():
    import subprocess
    try:
        out = subprocess.run(["git", "-C", str(paths.REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        return out.stdout.strip() if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def build(cfg: RunConfig, ds_config_cli: str | None = None):
    """Returns a ready Trainer. Raises UserError for anything the user can fix."""
    from torch.utils.data import DataLoader

    from models import build_workload, hidden_size_of
    from models import resolve as resolve_model
    from train.launch import distributed as dist_
    from train.data import build_data
    from train.data.sampler import EvalBatchSampler, GlobalBatchSampler
    from train.dsconfig import load_ds_setup
    from train.observe.metrics import JsonlLogger, Loggers
    from train.optim.optimizer import build_optimizer
    from train.training.trainer import Trainer

    launcher = dist_.normalize_env()
    world = int(os.environ["WORLD_SIZE"])
    cuda = torch.cuda.is_available()
    from train.training import hardware
    matmul_precision = hardware.apply_tf32(cfg, cuda)
    local_world = dist_.node_layout(os.environ, int(os.environ["RANK"]), world)[2]  # this node's ranks
    threads = hardware.apply_cpu_threads(cuda, local_world)
    run_dir = Path(cfg.train.run_dir)
    _check_run_dir(run_dir)
    elastic = _elastic_join(cfg, run_dir, world, launcher)  # torchrun's agent: a restart of the same job resumes
    sp_size = sp_.size(cfg, world)
    batch = cfg.train.batch(world // sp_size)  # samples per data-parallel rank: SP groups share theirs
    dp = batch.world

    spec = resolve_model(cfg.model)  # the model checked and its config.json read, once for the whole build
    # Data first: the model's vocabulary / classes / features come from it.
    ctx = spec.context
    seq_len = cfg.data.seq_len or ctx
    if cfg.data.kind in ("text", "tokens", "sft", "stream") and seq_len is None:
        raise ConfigError(f'data.kind "{cfg.data.kind}" is language-model data but model.name "{cfg.model.name}" '
                          f"is not a language model; use a GPT preset or hf:<dir>, or another data.kind")
    if ctx is not None and seq_len > ctx:
        raise ConfigError(f"data.seq_len {seq_len} exceeds the model's context length {ctx} (model.seq_len)")
    # sft: data.tokenizer, else an hf:<dir> model's own tokenizer, else bytes (the GPT presets)
    tokenizer = cfg.data.tokenizer or (spec.name[3:] if spec.family == "hf" else None)
    data = build_data(cfg.data, seq_len, cfg.train.seed, tokenizer)
    if data.mixture is not None:  # data.sources: the same order, positions tagged with their epoch
        from train.data.mixture import MixtureSampler
        sampler = MixtureSampler(data.mixture, batch.micro, dp, batch.accum, cfg.train.seed)
    elif data.stream is not None:  # data.kind stream: one endless epoch, windows shuffled in groups
        from train.data.stream import StreamSampler  # (train.epochs is refused by RunConfig)
        sampler = StreamSampler(cfg.data.shuffle_windows, batch.micro, dp, batch.accum, cfg.train.seed)
    else:
        sampler = GlobalBatchSampler(len(data.train), batch.micro, dp, batch.accum, cfg.train.seed)
    max_steps = cfg.train.epochs * sampler.steps_per_epoch if cfg.train.epochs else cfg.train.max_steps

    from train.plan import memory_check
    ds_path = dist_.resolve_ds_config_path(ds_config_cli or cfg.distributed.ds_config, launcher)
    if not (ds_config_cli or cfg.distributed.ds_config) and launcher != "accelerate" \
            and os.environ.get("RANK", "0") == "0":
        name, why = dist_.default_ds_config()
        print(f"zerotrain: no --ds-config given: ds_configs/{name} ({why}); pass --ds-config to choose", flush=True)
    view = memory_check.measure(cfg, ds_path)  # the memory budget: one view for the check and --ds-config auto
    ds_path, choice = memory_check.resolve_auto(ds_path, cfg, spec, data, batch, seq_len, world, view)  # --ds-config auto
    ds = load_ds_setup(ds_path, cfg, sp_.engine_batch(batch, sp_size), max_steps, cuda=cuda,
                         hidden_size=hidden_size_of(spec, data))
    sp_.check(cfg, spec, seq_len, ds)
    dist_.check_accelerate_precision(ds)
    hardware.check_compile(cfg, ds)

    _sweep_shm_buffers()  # before DeepSpeed creates this job's own
    from train.observe import wandb_logger
    acc = dist_.build_accelerator(ds, batch, cfg.distributed.timeout_s, log_with=wandb_logger.log_with(cfg))
    topo = dist_.topology(launcher, "nccl" if cuda else "gloo")
    dist_.check_world(acc, topo)
    sp = sp_.SPRun.join(sp_size, topo.rank, topo.world_size, spec.family) if sp_size > 1 else None
    wandb_logger.preflight(acc, cfg)  # W&B online without credentials: every rank stops here
    _write_rank_info(run_dir, acc, topo, ds)
    # Before the model exists: a plan that does not fit the device memory stops here.
    planned, budget = memory_check.preflight(cfg, spec, ds, data, batch, seq_len, world, acc.is_main_process, view,
                                             choice)
    # Compact malloc only where the plan would not fit without it (train/launch/host_settings.py).
    host = host_settings.apply(host_settings.decide(cfg, ds, cuda, planned, budget))

    from accelerate.utils import set_seed
    set_seed(cfg.train.seed)  # identical initial weights on every rank
    workload = build_workload(spec, data, _init_context(ds))
    if sp is not None:
        sp.attach(workload.model)
    if ds.is_deepspeed and ds.stage == 3 and acc.is_main_process:
        from models import partition_summary
        print(f"zerotrain: {partition_summary(workload.model, topo.world_size)}", flush=True)
    if workload.moe is not None:  # sparse-MoE blocks: ZeRO-3 leaves before the engine hooks the modules
        from models.moe import make_leaf
        if ds.is_deepspeed and ds.stage == 3:
            make_leaf(workload.model, workload.moe.info)
        if acc.is_main_process:
            print(f"zerotrain: {workload.moe.info.banner()}", flush=True)
    channels_last = hardware.use_channels_last(cfg, ds, workload.family, cuda)
    if channels_last:
        workload.model.to(memory_format=torch.channels_last)
    if cfg.train.compile:
        workload.model.compile()  # in place: parameter names (checkpoints, exports) stay the same
    raw_optimizer = build_optimizer(workload.model, cfg.optim, ds)
    set_seed(cfg.train.seed + topo.rank)  # dropout etc. differ per rank, deterministically

    workers = hardware.data_workers(cfg.data, local_world)
    train_loader = DataLoader(data.train, batch_sampler=sp_.ReplicatedBatches(sampler, sp_size, batch.micro)
                              if sp is not None else sampler,
                              generator=torch.Generator().manual_seed(cfg.train.seed),
                              **hardware.loader_options(workers, batch.accum, cuda, train=True))
    val_loader = None
    if data.val is not None and len(data.val) > 0:
        val = data.val
        if cfg.train.eval_batches is not None:
            # A real subset (not just fewer batches) so that Accelerate's end-of-set padding
            # arithmetic in gather_for_metrics sees the true number of samples.
            n = min(len(val), cfg.train.eval_batches * batch.micro * world)
            val = torch.utils.data.Subset(val, range(n))
        val_loader = DataLoader(val, batch_sampler=EvalBatchSampler(len(val), batch.micro, world),
                                **hardware.loader_options(workers, 1, cuda, train=False))
    if val_loader is not None:
        model, optimizer, train_loader, val_loader = acc.prepare(workload.model, raw_optimizer, train_loader,
                                                                 val_loader)
    else:
        model, optimizer, train_loader = acc.prepare(workload.model, raw_optimizer, train_loader)
    # The engine exists, so DeepSpeed's CPU shm all-reduce (if used) is set up on every rank:
    # each rank unlinks its /dev/shm buffer's name now (train/launch/shm_buffers.py).
    released = shm_buffers.release_own_buffer(topo.rank, topo.world_size, barrier=torch.distributed.barrier)
    if released is not None:
        _add_rank_info(run_dir, topo, shm_buffer_released=str(released))
    if ds.is_deepspeed and ds.precision != "fp32":
        workload.keep_norm_stats_fp32(model)  # 16-bit parameters, fp32 BatchNorm statistics
    if ds.is_deepspeed and ds.stage == 3:
        from models import partition_counts
        _add_rank_info(run_dir, topo, zero3=partition_counts(workload.model))
    if sp is not None:
        _add_rank_info(run_dir, topo, sequence_parallel=sp.record())

    resolved = resolved_config(cfg, ds, batch, topo, max_steps, data, workload)
    if budget is not None:
        resolved["resolved"]["memory_budget"] = {"bytes": budget.bytes, "source": budget.source,
                                                 "device": budget.device, "runtime_bytes": budget.runtime}
    if planned is not None:
        resolved["resolved"]["memory_plan"] = planned.to_dict()  # the peak the check compared with the budget
    if choice is not None:
        resolved["resolved"]["auto_ds_config"] = choice.record()
    resolved["resolved"]["host_settings"] = host.record()
    resolved["resolved"]["hardware"] = {"float32_matmul_precision": matmul_precision, "cpu_threads": threads,
                                        "channels_last": channels_last, "compile": cfg.train.compile, "data_workers": workers,
                                        **({"stream_workers": data.stream.workers} if data.stream else {})}
    sinks = []
    if acc.is_main_process:
        (run_dir / "config.json").write_text(json.dumps(resolved, indent=2, default=str) + "\n")
        if data.class_names:  # index -> class name, to read predictions of the trained classifier
            (run_dir / "classes.json").write_text(json.dumps(data.class_names, indent=1) + "\n")
        sinks.append(JsonlLogger(run_dir / "metrics.jsonl"))
    loggers = Loggers(sinks)
    from train.plan.rank_plan import rank_plan
    # The banner's "model states" and "memory" lines; the plan is compared with mem/* at step 2.
    memory = rank_plan(workload.model, cfg, ds, batch, topo, workload, data.seq_len, budget)
    from train.checkpoint.manager import Checkpointer
    checkpointer = Checkpointer(cfg=cfg.checkpoint, run_dir=run_dir, rank=topo.rank, world=topo.world_size, acc=acc,
                                model=model, raw_optimizer=raw_optimizer, ds=ds, workload=workload, sampler=sampler,
                                batch=batch, model_name=cfg.model.name, log=loggers.log, resolved_config=resolved)
    state = _restore(checkpointer, cfg)
    if elastic is not None:
        elastic.started(state, batch, checkpointer.resumed_from)
    if data.stream is not None:
        data.stream.resume_from(state.data_cursor)  # restart reading there, not at the stream's start
    return Trainer(cfg=cfg, resolved_config=resolved, topo=topo, ds=ds, batch=batch, max_steps=max_steps,
                   run_dir=run_dir, acc=acc, model=model, optimizer=optimizer, raw_optimizer=raw_optimizer,
                   workload=workload, data=data, train_loader=train_loader, sampler=sampler, val_loader=val_loader,
                   loggers=loggers, checkpointer=checkpointer, memory=memory, state=state, elastic=elastic,
                   seq_parallel=sp)


def _elastic_join(cfg: RunConfig, run_dir: Path, world: int, launcher: str):
    """Under torchrun's elastic agent: whether this start is a restart of the same job
    (train/launch/elastic.py), agreed by every rank over a process group made now (Accelerate and
    DeepSpeed adopt it); a restart then resumes and keeps the job's global batch. None otherwise."""
    from train.launch import distributed as dist_
    from train.launch import elastic as elastic_
    if launcher != "torchrun" or not elastic_.active():  # (accelerate's multi-node agent: not covered yet)
        return None
    dist_.init_process_group(cfg.distributed.timeout_s)
    env = os.environ
    node_rank, _, _ = dist_.node_layout(env, int(env["RANK"]), world)
    run = elastic_.ElasticRun.join(run_dir, int(env["RANK"]), world, node_rank, dist_.node_addr())
    run.apply(cfg)
    return run


def _restore(ckpt, cfg: RunConfig) -> TrainState:
    """Checkpoint resume (checkpoint.resume) or initial weights (model.init_from), before
    start(): W&B and the banner see the restored step and run id. Returns the TrainState the
    run starts from (a fresh one unless a checkpoint was resumed)."""
    if cfg.model.lora is not None and cfg.model.init_from:
        # A LoRA checkpoint holds no base: the frozen base weights come from init_from every time.
        ckpt.init_from(cfg.model.init_from)
        resumed = ckpt.resume(cfg.checkpoint.resume, load_optimizer=cfg.checkpoint.load_optimizer)
        return resumed if resumed is not None else TrainState()
    resumed = ckpt.resume(cfg.checkpoint.resume, load_optimizer=cfg.checkpoint.load_optimizer)
    if cfg.model.init_from and resumed is None:
        ckpt.init_from(cfg.model.init_from)
    return resumed if resumed is not None else TrainState()
