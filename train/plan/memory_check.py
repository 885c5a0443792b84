"""Does the run fit in device memory? The check before the model is built, and --ds-config auto.

Both ask train/plan/estimate.py for the peak of a rank (runtime + model states + buffers + the larger
of the backward and optimizer-step working sets) and compare it with the budget every rank
agrees on (train/launch/device_memory.py: the tightest over all ranks).

* The check (distributed.memory_check, made with the run's memory plan: train/plan/memory_plan.py):
  a run whose plan exceeds the budget stops before any model exists, with one line naming the limit, what the chosen strategy needs and what to use
  instead; one that fits only without the margin gets a warning. Without it the kernel kills
  the rank mid-run (exit 137) with no word of why.
* `--ds-config auto` (or `auto:<dir>`: choose among the JSONs of another directory, e.g. fp32
  copies of the shipped ones): the fastest option of train/plan/estimate.py OPTIONS whose plan leaves
  distributed.memory_margin of the budget free. One line says what it chose and why, and
  what the next-faster option would have needed; config.json records it.

The two agree by construction: the budget is measured once per rank at the same point (before
the process group and the Accelerator exist; each option's own start-up growth is the
planner's, train/strategy/cost.py startup), so an option gets one estimate whichever path asks;
an option "fits" for both only with the margin (`fits`), and every message that applies the
margin states it; the check's advice is the option auto would choose among the same JSONs
(`advise`), so it never points to one that auto then refuses.
"""

from __future__ import annotations

import importlib
import math
import socket
from dataclasses import dataclass
from pathlib import Path

import torch

from zerotrain.train import paths, process_group
from zerotrain.train.launch.device_memory import Budget, host_free, local_budget
from zerotrain.train.errors import ConfigError
from zerotrain.train.observe.report import human_bytes as hb



class DoesNotFit(ConfigError):
    """The plan for this run needs more memory per device than the budget."""


def is_auto(ds_config: str | None) -> bool:
    return bool(ds_config) and (ds_config == "auto" or ds_config.startswith("auto:"))


def auto_dir(ds_config: str) -> Path:
    d = Path(ds_config[5:]) if ds_config.startswith("auto:") else paths.DS_CONFIGS
    if not d.is_dir():
        raise ConfigError(f"--ds-config {ds_config}: {d} is not a directory of DeepSpeed JSONs")
    return d


def local_view() -> dict:
    """This rank's own view of its budget (collective-free). Measured once per run, before the
    process group and the Accelerator exist, by both the check and --ds-config auto, so that
    both see the same runtime; the memory an option's start-up adds is the planner's."""
    # The first optimizer imports it (resident memory: BENCHMARKS.md "Start-up: where a rank's first
    # seconds go"): count it now.
    importlib.import_module("torch._dynamo")
    nbytes, source, cgroup, runtime = local_budget()
    free, free_why = host_free()
    return {"bytes": nbytes, "source": source, "cgroup": cgroup, "host": socket.gethostname(), "runtime": runtime,
            "host_free": free, "host_source": free_why}


def agreed_budget(mine: dict | None = None) -> Budget:
    """The budget of the tightest rank, from every rank's local_view() (measured now if not
    given). Ranks of one node inside one memory cgroup share its limit. Collective when a
    process group exists (every rank must call it)."""
    mine = mine or local_view()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist = torch.distributed
    if process_group.size() == 1:
        return Budget(mine["bytes"], mine["source"] + (" (1 rank in it)" if mine["cgroup"] else ""), device,
                      mine["runtime"], mine.get("host_free"), mine.get("host_source", ""))
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    per_rank = []
    for v in views:
        sharing = sum(1 for w in views if v["cgroup"] and w["cgroup"] == v["cgroup"] and w["host"] == v["host"])
        why = v["source"] + (f" ({sharing} rank{'s' if sharing > 1 else ''} in it)" if v["cgroup"] else "")
        per_rank.append((v["bytes"] // max(1, sharing), why))
    share, why = min(per_rank)
    free, free_why = min((v.get("host_free", 1 << 62), v.get("host_source", "")) for v in views)
    return Budget(share, why, device, max(v["runtime"] for v in views), free, free_why)


def measure(cfg, ds_path: str | None) -> dict | None:
    """This rank's local_view() when the check or --ds-config auto will need it, else None. Call it
    before resolve_auto (train/training/build.py): the point both measure at."""
    return local_view() if cfg.distributed.memory_check or is_auto(ds_path) else None


def model_shape(spec, data):
    """The planner's view of the model (the run's models.ModelSpec) before it exists: built on the
    meta device (no memory)."""
    from zerotrain.models import meta_model
    from zerotrain.models.gpt import GPTConfig
    from zerotrain.train.plan.shapes import module_shape
    model, model_config, width = meta_model(spec, data)
    gpt = GPTConfig.from_dict({k: v for k, v in model_config.items() if k != "family"}) \
        if model_config.get("family") == "gpt" else None
    return module_shape(model, spec.name, gpt, width)


def plan_batch(cfg, batch, seq_len):
    """The planner's view of one rank's micro-batch in this run. Preference pairs (train.objective
    dpo) are one forward of 2 x micro rows (chosen and rejected); the live reference of full
    fine-tuning is a frozen copy of the model (models/preference.py), under LoRA no extra weights;
    train.dpo.reference precomputed reads log-probs with the data: no copy. train.ema keeps one
    more fp32 copy of the master elements each rank holds (train/training/ema.py)."""
    from zerotrain.train.plan.shapes import BatchShape
    dpo = cfg.train.objective == "dpo"
    return BatchShape(batch.micro * (2 if dpo else 1), seq_len, batch.accum, cfg.model.activation_checkpointing,
                      sequence_parallel=cfg.distributed.sequence_parallel,
                      document_mask=cfg.data.packing or cfg.data.document_mask,
                      reference_copy=(dpo and cfg.train.dpo.loss != "simpo" and cfg.model.lora is None
                                      and cfg.train.dpo.reference == "live"),
                      ema_copy=cfg.train.ema is not None)


def _device(budget: Budget):
    from zerotrain.train.plan.estimate import Device
    return Device(budget.device, budget.runtime)


def _why(e) -> str:
    parts = [f"runtime {hb(e.runtime)}"] if e.runtime else []
    parts += [f"model states {hb(e.model_states)}", f"buffers {hb(e.buffers)}"]
    bwd = (e.activations or 0) + e.backward_work
    parts.append(f"activations+backward {hb(bwd)}" if bwd >= e.step_work else f"optimizer step {hb(e.step_work)}")
    if e.host and e.device_kind == "cpu":
        parts.append(f"offloaded {hb(e.host)}")
    if e.snapshot and e.device_kind == "cpu":
        parts.append(f"checkpoint.async snapshot {hb(e.snapshot)}")
    return ", ".join(parts)


def fits(e, budget: Budget, margin: float) -> bool:
    """The one rule both paths use: the predicted peak leaves `margin` of the budget free."""
    return e.device_total <= (1 - margin) * budget.bytes


def with_margin(e, budget: Budget, margin: float) -> str:
    """The margin's arithmetic for a message: '2.41 GiB + 10% margin (0.26 GiB) = 2.67 GiB > 2.62 GiB'."""
    kept = margin * budget.bytes
    total = e.device_total + kept
    return (f"{hb(e.device_total)} + {margin:.0%} margin ({hb(kept)}) = {hb(total)} "
            f"{'<=' if total <= budget.bytes else '>'} {hb(budget.bytes)}")


def margin_that_runs(e, budget: Budget) -> float:
    """The largest distributed.memory_margin (in hundredths) with which `e` fits (0 if it does not fit at all)."""
    return max(0.0, math.floor(100 * (1 - e.device_total / budget.bytes)) / 100)


@dataclass
class AutoChoice:
    path: str
    label: str
    estimate: object
    next_faster: object | None
    line: str
    budget: Budget
    margin: float
    shape: object = None   # the model's ModelShape auto chose with: the run's memory plan reuses it (memory_plan.py)

    def record(self) -> dict:
        """What config.json keeps of the choice."""
        nf, budget = self.next_faster, self.budget
        return {"ds_config": self.path, "option": self.label, "predicted_peak_bytes": self.estimate.device_total,
                "budget_bytes": budget.bytes, "budget_source": budget.source, "margin": self.margin,
                "next_faster": None if nf is None else {"option": nf.option.label, "ds_config": nf.option.path,
                                                        "predicted_peak_bytes": nf.device_total}}


def _rows(shape, batch, world: int, device, configs: Path, precision: str | None = None):
    """Estimates for the OPTIONS found in `configs`, in their own precision or `precision`; under
    sequence parallelism the ZeRO ones only (a run refuses SP under plain DDP)."""
    from zerotrain.train.plan.estimate import OPTIONS, estimate
    from zerotrain.train.strategy.option import Option
    rows = []
    for label, fname in OPTIONS:
        path = configs / fname
        if path.is_file():
            s = Option.from_json(label, path, precision, shape.width)
            if batch.sequence_parallel > 1 and not s.splits_sequences:
                continue  # sequence parallelism needs ZeRO (train/launch/sequence_parallel.py)
            rows.append(estimate(shape, s, world, batch, device=device))
    return rows


def choose(ds_config: str, cfg, spec, data, batch, seq_len, world: int, budget: Budget) -> AutoChoice:
    """--ds-config auto: the fastest option whose plan leaves the margin free."""
    configs = auto_dir(ds_config)
    margin = cfg.distributed.memory_margin
    shape, device = model_shape(spec, data), _device(budget)
    rows = _rows(shape, plan_batch(cfg, batch, seq_len), world, device, configs)
    if not rows:
        raise ConfigError(f"--ds-config {ds_config}: {configs} holds none of ddp.json, zero1.json, ... zero3_offload.json")
    for i, e in enumerate(rows):
        if fits(e, budget, margin):
            nf = rows[i - 1] if i else None
            line = (f"--ds-config auto: {e.option.label} ({e.option.path}): predicted peak per rank "
                    f"{with_margin(e, budget, margin)}, {budget.source}"
                    + (f"; the faster {nf.option.label} would need {hb(nf.device_total)}" if nf else
                       "; it is the fastest option"))
            return AutoChoice(e.option.path, e.option.label, e, nf, line, budget, margin, shape)

    def sp(before):  # auto, given the flag, chooses the fastest option that fits with it: the one named
        fit = sp_fit(cfg, spec, seq_len, world, budget, before,
                     lambda trial, b: _rows(shape, plan_batch(trial, b, seq_len), world, device, configs))
        return sp_clause(fit, cfg, budget)
    tight = next((r for r in rows if r.device_total <= budget.bytes), None)
    if tight is not None:  # fits, but not with the margin: say so, and what would run it
        raise DoesNotFit(f"--ds-config auto: no option fits {hb(budget.bytes)} ({budget.source}) with the "
                         f"{margin:.0%} distributed.memory_margin: the fastest that fits without it, "
                         f"{tight.option.label}, needs {with_margin(tight, budget, margin)}; "
                         f"{_tight_fix(tight, budget, ds_config, f'--ds-config {_rel(tight.option.path)}')}"
                         f"{sp(tight.activations)}")
    least = min(rows, key=lambda r: r.device_total)
    raise DoesNotFit(f"--ds-config auto: no option fits {hb(budget.bytes)} ({budget.source}): the smallest, "
                     f"{least.option.label}, needs "
                     f"{hb(least.device_total)} per rank ({_why(least)}){sp(least.activations)}; {_advice(cfg)}")


def _tight_fix(e, budget: Budget, auto: str | None, use: str) -> str:
    """What runs an option that fits only without the margin: the same words from both paths."""
    run = f"`--distributed.memory_margin {margin_that_runs(e, budget):g}`" + (f" with --ds-config {auto}" if auto else "")
    return f"{run} would run it (or {use}, which the memory check only warns about)"


def resolve_auto(ds_path: str, cfg, spec, data, batch, seq_len, world: int,
                 view: dict | None = None) -> tuple[str, AutoChoice | None]:
    """(the JSON to use, the AutoChoice when ds_path is auto). Every rank must choose the same JSON,
    so they agree on the budget first (`view`: this rank's measure()), over a process group made
    now (Accelerate and DeepSpeed then adopt it). Collective."""
    if not is_auto(ds_path):
        return ds_path, None
    from zerotrain.train.launch.collectives import timeout_s
    from zerotrain.train.launch.distributed import init_process_group
    init_process_group(timeout_s(cfg))
    choice = choose(ds_path, cfg, spec, data, batch, seq_len, world, agreed_budget(view))
    if torch.distributed.get_rank() == 0:
        print(f"zerotrain: {choice.line}", flush=True)
    return choice.path, choice


def _advice(cfg) -> str:
    tips = []
    if not cfg.model.activation_checkpointing:
        tips.append("--model.activation_checkpointing true")
    if cfg.train.micro_batch_size > 1:
        tips.append("a smaller --train.micro_batch_size with --train.global_batch_size kept")
    tips.append("more processes or nodes, or more memory per device")
    return "try " + ", ".join(tips)


def require_fit(cfg, spec, ds, data, batch, seq_len, world: int, budget: Budget, shape=None, snapshot: int = 0):
    """The plan for the chosen strategy against the budget: (its Estimate, None) when it fits
    with the margin, (Estimate, a warning line) when it fits without, DoesNotFit otherwise.
    `shape`: the model's (model_shape), when the caller has it (the run's memory plan,
    train/plan/memory_plan.py, which calls this before the model exists). `snapshot`: the
    checkpoint.async host snapshot per rank (estimate.snapshot_bytes) the run keeps, if any."""
    from zerotrain.train.plan.estimate import estimate
    from zerotrain.train.strategy.option import Option
    shape = shape if shape is not None else model_shape(spec, data)
    pb, device = plan_batch(cfg, batch, seq_len), _device(budget)
    e = estimate(shape, Option.from_setup(ds), world, pb, device=device, snapshot=snapshot)  # the largest rank
    margin = cfg.distributed.memory_margin
    if fits(e, budget, margin):
        return e, None
    if e.device_total <= budget.bytes:
        return e, (f"warning: {ds.describe()} is predicted to need {with_margin(e, budget, margin)} per rank "
                   f"({budget.source}): it runs, but the estimate's error or the allocator's cache may not fit "
                   f"(distributed.memory_margin)")
    fix = advise(cfg, shape, pb, world, device, ds, budget, (spec, seq_len, e.activations))
    raise DoesNotFit(f"{ds.describe()} [{ds.path}] needs about {hb(e.device_total)} per rank ({_why(e)}) but "
                     f"{budget.source} allows {hb(budget.bytes)}; {fix}. (distributed.memory_check false skips this check)")


def advise(cfg, shape, pb, world: int, device, ds, budget: Budget, run: tuple | None = None) -> str:
    """What to run instead of a strategy that does not fit: exactly what --ds-config auto would
    choose among the same JSONs (their directory when it holds the option files, e.g. fp32
    copies; else the shipped ones in this run's precision), with the same margin. When none fits,
    and `run` (spec, seq_len, activations per rank) is given: the sequence-parallel size that
    would fit (sp_fit), this run's own JSON preferred."""
    from zerotrain.train.plan.estimate import OPTIONS, estimate
    from zerotrain.train.strategy.option import Option
    margin = cfg.distributed.memory_margin
    here = Path(ds.path).parent if ds.path else None
    if here is not None and sum((here / f).is_file() for _, f in OPTIONS) > 1:
        rows_at = lambda b: _rows(shape, b, world, device, here)  # noqa: E731  auto:<here> sees these very rows
        rows, auto = rows_at(pb), _auto_flag(here)
        how = lambda r: f"--ds-config {_rel(r.option.path)}"  # noqa: E731
    else:
        rows_at = lambda b: _rows(shape, b, world, device, paths.DS_CONFIGS, ds.precision)  # noqa: E731
        rows = rows_at(pb)
        same = all(Option.from_json(r.option.label, Path(r.option.path)).precision == ds.precision for r in rows)
        auto = "auto" if same else None

        def how(r):
            if Option.from_json(r.option.label, Path(r.option.path)).precision == ds.precision:
                return f"--ds-config {_rel(r.option.path)}"
            return (f"a {r.option.label} JSON with this run's {ds.precision} (like ds_configs/"
                    f"{Path(r.option.path).name} with "
                    f"{'bf16 and fp16 disabled' if ds.precision == 'fp32' else ds.precision + ' enabled'})")
    auto_hint = (f", or --ds-config {auto}" if auto else
                 ", or --ds-config auto:DIR with such copies of every shipped JSON in DIR")
    best = next((r for r in rows if fits(r, budget, margin)), None)
    if best is not None:
        return (f"{best.option.label} is the fastest option that fits with the {margin:.0%} margin "
                f"({with_margin(best, budget, margin)}): use {how(best)}{auto_hint}")
    sp = ""
    if run is not None:  # this run's own JSON first (a ZeRO one), then the fastest of the same JSONs
        own = Option.from_setup(ds)
        own = own if own.splits_sequences else None
        spec, seq_len, before = run
        fit = sp_fit(cfg, spec, seq_len, world, budget, before, lambda trial, b: (
            [estimate(shape, own, world, plan_batch(trial, b, seq_len), device=device)] if own else [])
            + rows_at(plan_batch(trial, b, seq_len)))
        sp = sp_clause(fit, cfg, budget, lambda r: "" if r.option is own else f" with {how(r)}")
    tight = next((r for r in rows if r.device_total <= budget.bytes), None)
    if tight is not None:
        return (f"no option fits with the {margin:.0%} distributed.memory_margin: the fastest that fits without it, "
                f"{tight.option.label}, needs {with_margin(tight, budget, margin)}; "
                f"{_tight_fix(tight, budget, auto, how(tight))}{sp}")
    return f"no option fits{sp}; {_advice(cfg)}"


class _ZeroJSON:
    """What train/launch/sequence_parallel.refuse_unsupported asks of a Strategy, for a ZeRO JSON: the options a
    sequence-parallel suggestion names are ZeRO ones (sp_fit.first_fit), which split sequences."""

    path = None

    @staticmethod
    def check_sequence_parallel(flag: str) -> None:
        pass


def sp_runs(cfg, spec, seq_len, world: int):
    """(N, this run's config with it, its Batch per data-parallel rank) for every sequence-parallel
    size above the run's that train/launch/sequence_parallel.py accepts for this model, sequence
    and world under a ZeRO JSON (hardware.compile aside: sp_clause says to turn it off), with a
    global batch that splits over world / N data-parallel ranks; N ascending, lazily."""
    from dataclasses import replace
    from zerotrain.train.launch import sequence_parallel as sp_
    from zerotrain.train.plan.sp_fit import sizes
    for n in sizes(cfg.distributed.sequence_parallel, world):
        trial = replace(cfg, distributed=replace(cfg.distributed, sequence_parallel=n),
                        hardware=replace(cfg.hardware, compile=False))
        try:
            sp_.refuse_unsupported(trial, spec, seq_len, _ZeroJSON)
            batch = trial.train.batch(world // n)
        except ConfigError:
            continue
        yield n, trial, batch


def sp_fit(cfg, spec, seq_len, world: int, budget: Budget, before, options):
    """The smallest size of sp_runs with which one of `options(its config, its Batch)` (Estimates,
    in order of preference) fits with the margin (train/plan/sp_fit.py), or None."""
    from zerotrain.train.plan.sp_fit import first_fit
    margin = cfg.distributed.memory_margin
    return first_fit(before, ((n, options(trial, b)) for n, trial, b in sp_runs(cfg, spec, seq_len, world)),
                     lambda e: fits(e, budget, margin))


def sp_clause(fit, cfg, budget: Budget, how=lambda r: "") -> str:
    """'; --distributed.sequence_parallel N would fit (...)' for a refusal, or '' without a fit."""
    if fit is None:
        return ""
    how_ = how(fit.estimate) + (" and --hardware.compile false" if cfg.hardware.compile else "")
    return "; " + fit.clause("--distributed.sequence_parallel",
                             with_margin(fit.estimate, budget, cfg.distributed.memory_margin), how_)


def _auto_flag(d: Path) -> str:
    return "auto" if d.resolve() == paths.DS_CONFIGS.resolve() else f"auto:{_rel(str(d))}"


def _rel(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path
