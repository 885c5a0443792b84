"""Assemble a run from its config, part by part (train/training/assembly.py): the runtime ->
the data -> the strategy (DeepSpeed JSON, Accelerator, memory check) -> the model and optimizer
-> the loaders -> accelerate.prepare -> the run record (config.json) -> the services (loggers,
memory plan, checkpointer, evaluator, the run's features, restored state) -> the Trainer."""

from __future__ import annotations

from zerotrain.train.config import RunConfig
from zerotrain.train.training import assembly
from zerotrain.train.training.record import record_run
from zerotrain.train.training.trainer import Trainer


def build(cfg: RunConfig, ds_config_cli: str | None = None) -> Trainer:
    """Returns a ready Trainer. Raises UserError for anything the user can fix."""
    rt = assembly.set_up_runtime(cfg)
    data = assembly.load_data(cfg, rt)
    dist = assembly.choose_strategy(cfg, ds_config_cli, rt, data)
    model = assembly.build_model(cfg, rt, data, dist)
    loaders = assembly.make_loaders(cfg, rt, data, model)
    prepared = assembly.prepare(rt, dist, model, loaders)
    record = record_run(cfg, rt, data, dist, model, loaders)
    services = assembly.start_services(cfg, rt, data, dist, model, prepared, record)
    return Trainer(cfg=cfg, resolved_config=record, topo=dist.topo, strategy=dist.strategy, batch=rt.batch,
                   max_steps=data.max_steps, run_dir=rt.run_dir, workload=model.workload,
                   data=data.bundle, train_loader=prepared.train_loader, sampler=data.sampler,
                   loggers=services.loggers, checkpointer=services.checkpointer,
                   memory_plan=services.memory_plan, state=services.state, evaluator=services.evaluator,
                   features=services.features, elastic=rt.elastic,
                   seq_parallel=dist.sp)
