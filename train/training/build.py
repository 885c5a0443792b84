"""Assemble a run from its config, in named stages (train/training/stages.py): the runtime ->
the data -> the strategy (DeepSpeed JSON, Accelerator, memory check) -> the model and optimizer
-> the loaders -> accelerate.prepare -> the run record (config.json) -> the services (loggers,
memory plan, checkpointer, restored state) -> the Trainer."""

from __future__ import annotations

from zerotrain.train.config import RunConfig
from zerotrain.train.training import stages
from zerotrain.train.training.record import record_run
from zerotrain.train.training.trainer import Trainer


def build(cfg: RunConfig, ds_config_cli: str | None = None) -> Trainer:
    """Returns a ready Trainer. Raises UserError for anything the user can fix."""
    rt = stages.set_up_runtime(cfg)
    data = stages.load_data(cfg, rt)
    dist = stages.choose_strategy(cfg, ds_config_cli, rt, data)
    model = stages.build_model(cfg, rt, data, dist)
    loaders = stages.make_loaders(cfg, rt, data, model)
    prepared = stages.prepare(rt, dist, model, loaders)
    record = record_run(cfg, rt, data, dist, model, loaders)
    services = stages.start_services(cfg, rt, data, dist, model, record)
    return Trainer(cfg=cfg, resolved_config=record, topo=dist.topo, strategy=dist.strategy, batch=rt.batch,
                   max_steps=data.max_steps, run_dir=rt.run_dir, workload=model.workload,
                   data=data.bundle, train_loader=prepared.train_loader, sampler=data.sampler,
                   val_loader=prepared.val_loader, loggers=services.loggers, checkpointer=services.checkpointer,
                   memory_plan=services.memory_plan, state=services.state, elastic=rt.elastic,
                   seq_parallel=dist.sp)
