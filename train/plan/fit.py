"""Does the run fit in device memory? The check before the model is built, and --ds-config auto.

Both ask train/plan/estimate.py for the peak of a rank (runtime + model states + buffers + the larger
of the backward and optimizer-step working sets) and compare it with the budget every rank
agrees on (train/launch/device_memory.py: the tightest over all ranks).

* The check (distributed.memory_check): a run whose plan exceeds the budget stops before any
  model exists, with one line naming the limit, what the chosen strategy needs and the fastest
  option that fits; one within the margin gets a warning. Without it the kernel kills the
  rank mid-run (exit 137) with no word of why.
* `--ds-config auto` (or `auto:<dir>`: choose among the JSONs of another directory, e.g. fp32
  copies of the shipped ones): the fastest option of train/plan.OPTIONS whose plan leaves
  distributed.memory_margin of the budget free. One line says what it chose and why, and
  what the next-faster option would have needed; config.json records it.
"""

from __future__ import annotations

import importlib
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from train import paths
from train.launch.device_memory import Budget, local_budget
from train.errors import ConfigError, UserError
from train.observe.report import human_bytes as hb



class DoesNotFit(ConfigError):
    """The plan for this run needs more memory per device than the budget."""


def is_auto(ds_config: str | None) -> bool:
    return bool(ds_config) and (ds_config == "auto" or ds_config.startswith("auto:"))


def auto_dir(ds_config: str) -> Path:
    d = Path(ds_config[5:]) if ds_config.startswith("auto:") else paths.DS_CONFIGS
    if not d.is_dir():
        raise ConfigError(f"--ds-config {ds_config}: {d} is not a directory of DeepSpeed JSONs")
    return d


# Growth of a CPU rank's memory between a bare process group and the Accelerator with DeepSpeed's
# communication set up (measured 42 MiB): --ds-config auto decides before them.
STARTUP_ALLOWANCE = 48 * 2 ** 20


def agreed_budget(before_accelerator: bool = False) -> Budget:
    """The budget of the tightest rank. Ranks of one node inside one memory cgroup share its
    limit. Collective when a process group exists (every rank must call it)."""
    importlib.import_module("torch._dynamo")  # the first optimizer imports it (~150 MiB resident): count it now
    nbytes, source, cgroup, runtime = local_budget()
    if runtime and before_accelerator:
        runtime += STARTUP_ALLOWANCE
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Budget(nbytes, source + (" (1 rank in it)" if cgroup else ""), device, runtime)
    mine = {"bytes": nbytes, "source": source, "cgroup": cgroup, "host": socket.gethostname(), "runtime": runtime}
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    per_rank = []
    for v in views:
        sharing = sum(1 for w in views if v["cgroup"] and w["cgroup"] == v["cgroup"] and w["host"] == v["host"])
        why = v["source"] + (f" ({sharing} rank{'s' if sharing > 1 else ''} in it)" if v["cgroup"] else "")
        per_rank.append((v["bytes"] // max(1, sharing), why))
    share, why = min(per_rank)
    return Budget(share, why, device, max(v["runtime"] for v in views))


def model_shape(spec, data):
    """The planner's view of the model (the run's models.ModelSpec) before it exists: built on the
    meta device (no memory)."""
    from models import meta_model
    from models.gpt import GPTConfig
    from train.plan.estimate import module_shape
    model, model_config, width = meta_model(spec, data)
    gpt = GPTConfig.from_dict({k: v for k, v in model_config.items() if k != "family"}) \
        if model_config.get("family") == "gpt" else None
    return module_shape(model, spec.name, gpt, width)


def _plan_batch(cfg, batch, seq_len):
    from train.plan.estimate import Batch
    return Batch(batch.micro, seq_len, batch.accum, cfg.model.activation_checkpointing)


def _device(budget: Budget):
    from train.plan.estimate import Device
    return Device(budget.device, budget.runtime)


def _why(e) -> str:
    parts = [f"runtime {hb(e.runtime)}"] if e.runtime else []
    parts += [f"model states {hb(e.model_states)}", f"buffers {hb(e.buffers)}"]
    bwd = (e.activations or 0) + e.backward_work
    parts.append(f"activations+backward {hb(bwd)}" if bwd >= e.step_work else f"optimizer step {hb(e.step_work)}")
    if e.host and e.device_kind == "cpu":
        parts.append(f"offloaded {hb(e.host)}")
    return ", ".join(parts)


@dataclass
class Choice:
    path: str
    label: str
    estimate: object
    next_faster: object | None
    line: str
    budget: Budget
    margin: float

    def record(self) -> dict:
        """What config.json keeps of the choice."""
        nf, budget = self.next_faster, self.budget
        return {"ds_config": self.path, "option": self.label, "predicted_peak_bytes": self.estimate.device_total,
                "budget_bytes": budget.bytes, "budget_source": budget.source, "margin": self.margin,
                "next_faster": None if nf is None else {"option": nf.strategy.label, "ds_config": nf.strategy.path,
                                                        "predicted_peak_bytes": nf.device_total}}


def _rows(shape, batch, world: int, device, configs: Path, precision: str | None = None):
    """Estimates for the OPTIONS found in `configs`, in their own precision or `precision`."""
    from train.plan.estimate import OPTIONS, estimate, strategy_from_json
    rows = []
    for label, fname in OPTIONS:
        path = configs / fname
        if path.is_file():
            rows.append(estimate(shape, strategy_from_json(label, path, precision, shape.width), world, batch,
                                 device=device))
    return rows


def choose(ds_config: str, cfg, spec, data, batch, seq_len, world: int, budget: Budget) -> Choice:
    """--ds-config auto: the fastest option whose plan leaves the margin free."""
    configs = auto_dir(ds_config)
    margin = cfg.distributed.memory_margin
    rows = _rows(model_shape(spec, data), _plan_batch(cfg, batch, seq_len), world, _device(budget), configs)
    if not rows:
        raise ConfigError(f"--ds-config {ds_config}: {configs} holds none of ddp.json, zero1.json, ... zero3_offload.json")
    usable = (1 - margin) * budget.bytes
    for i, e in enumerate(rows):
        if e.device_total <= usable:
            nf = rows[i - 1] if i else None
            line = (f"--ds-config auto: {e.strategy.label} ({e.strategy.path}): predicted peak {hb(e.device_total)} "
                    f"per rank fits {hb(budget.bytes)}, {budget.source}, with {margin:.0%} headroom "
                    f"({hb(usable)} usable)"
                    + (f"; the faster {nf.strategy.label} would need {hb(nf.device_total)}" if nf else
                       "; it is the fastest option"))
            return Choice(e.strategy.path, e.strategy.label, e, nf, line, budget, margin)
    least = min(rows, key=lambda r: r.device_total)
    raise DoesNotFit(f"--ds-config auto: no option fits {hb(budget.bytes)} ({budget.source}): the smallest, "
                     f"{least.strategy.label}, needs "
                     f"{hb(least.device_total)} per rank ({_why(least)}); {_advice(cfg)}")


def resolve_auto(ds_path: str, cfg, spec, data, batch, seq_len, world: int) -> tuple[str, Choice | None]:
    """(the JSON to use, the Choice when ds_path is auto). Every rank must choose the same JSON,
    so they agree on the budget first, over a process group made now (Accelerate and DeepSpeed
    then adopt it). Collective."""
    if not is_auto(ds_path):
        return ds_path, None
    from train.launch.distributed import init_process_group
    init_process_group(cfg.distributed.timeout_s)
    choice = choose(ds_path, cfg, spec, data, batch, seq_len, world, agreed_budget(before_accelerator=True))
    if torch.distributed.get_rank() == 0:
        print(f"zerotrain: {choice.line}", flush=True)
    return choice.path, choice


def preflight(cfg, spec, ds, data, batch, seq_len, world: int, is_main: bool):
    """The memory check before the model exists (distributed.memory_check): (the Estimate it
    compared, the agreed Budget), or (None, None) when it is off. Raises DoesNotFit; prints the
    warning of a tight fit. A model the planner cannot size trains unchecked, with a note.
    Collective."""
    if not cfg.distributed.memory_check:
        return None, None
    budget = agreed_budget()
    try:
        planned, warning = check(cfg, spec, ds, data, batch, seq_len, world, budget)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - the planner is advisory for models it does not know
        planned, warning = None, f"note: memory check skipped, the planner cannot size this model ({e})"
    if warning and is_main:
        print(f"zerotrain: {warning}", flush=True)
    return planned, budget


def _advice(cfg) -> str:
    tips = []
    if not cfg.model.activation_checkpointing:
        tips.append("--model.activation_checkpointing true")
    if cfg.train.micro_batch_size > 1:
        tips.append("a smaller --train.micro_batch_size with --train.global_batch_size kept")
    tips.append("more processes or nodes, or more memory per device")
    return "try " + ", ".join(tips)


def check(cfg, spec, ds, data, batch, seq_len, world: int, budget: Budget):
    """The plan for the chosen strategy against the budget: (its Estimate, None) when it fits
    with the margin, (Estimate, a warning line) when it fits without, DoesNotFit otherwise."""
    from train.plan.estimate import estimate, strategy_from_setup
    shape = model_shape(spec, data)
    pb, device = _plan_batch(cfg, batch, seq_len), _device(budget)
    e = estimate(shape, strategy_from_setup(ds), world, pb, device=device)  # the largest rank
    margin = cfg.distributed.memory_margin
    if e.device_total <= (1 - margin) * budget.bytes:
        return e, None
    if e.device_total <= budget.bytes:
        return e, (f"warning: {ds.describe()} is predicted to need {hb(e.device_total)} per rank, within "
                   f"{margin:.0%} of the {hb(budget.bytes)} allowed ({budget.source}); the estimate's error or the "
                   f"allocator's cache may not fit")
    fits = [r for r in _rows(shape, pb, world, device, paths.DS_CONFIGS, ds.precision)
            if r.device_total <= budget.bytes]
    if fits:
        from train.plan.estimate import strategy_from_json
        best = fits[0]
        name = Path(best.strategy.path).name
        same = strategy_from_json(best.strategy.label, Path(best.strategy.path)).precision == ds.precision
        how = (f"use --ds-config {_rel(best.strategy.path)}" if same else
               f"use a {best.strategy.label} JSON with this run's {ds.precision} (like ds_configs/{name} with "
               f"{'bf16 and fp16 disabled' if ds.precision == 'fp32' else ds.precision + ' enabled'})")
        suggestion = (f"{best.strategy.label} is the fastest option that fits ({hb(best.device_total)}): {how}, "
                      f"or --ds-config auto")
    else:
        suggestion = f"no shipped option fits; {_advice(cfg)}"
    raise DoesNotFit(f"{ds.describe()} [{ds.path}] needs about {hb(e.device_total)} per rank ({_why(e)}) but "
                     f"{budget.source} allows {hb(budget.bytes)}; {suggestion}. (distributed.memory_check false "
                     f"skips this check)")


def _rel(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path
