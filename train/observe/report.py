"""What the main process prints: the start-up banner and the end-of-run summary."""

from __future__ import annotations


def human(n: float, unit: str = "") -> str:
    for div, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.2f}{suffix}{unit}"
    return f"{n:.0f}{unit}"


def human_bytes(n: float) -> str:
    for div, suffix in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if abs(n) >= div:
            return f"{n / div:.2f} {suffix}"
    return f"{n:.0f} B"


def count_params(model) -> tuple[int, int]:
    """(total, trainable) unique parameters, also under ZeRO-3 partitioning (ds_numel)."""
    seen, total, trainable = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = getattr(p, "ds_numel", p.numel())
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def banner(t) -> str:
    topo, strategy, b, data = t.topo, t.strategy, t.batch, t.data
    total, trainable = count_params(t.model)
    lines = [
        "zerotrain " + "-" * 60,
        f"  world        {topo.world_size} process(es) on {topo.num_nodes} node(s), launcher {topo.launcher}, "
        f"{topo.device} / {topo.backend}" + _threads_text(t),
        f"  strategy     {strategy.describe()}   [{strategy.path}]",
        *([f"  precision    {strategy.precision} ({strategy.ds.precision_why})"] if strategy.ds.precision_why else []),
        f"  model        {t.cfg.model.name}: {human(total)} params ({human(trainable)} trainable)" + _lora_text(t)
        + _attention_text(t) + _own_code_text(t) + _hub_text(t),
        f"  data         {data.describe}: "
        + ("an endless stream" if data.stream is not None else f"{len(data.train)} train samples")
        + _validation_text(t),
        f"  batch        micro {b.micro} x accum {b.accum} x world {b.world} = global {b.global_size} samples"
        + (f" = {b.global_size * data.items_per_sample} tokens/step" if data.items_per_sample > 1 else ""),
        f"  schedule     {t.max_steps} steps "
        + ("(a stream: no epochs)" if data.stream is not None else f"({t.sampler.steps_per_epoch} per epoch)")
        + f", lr {t.cfg.optim.lr:g} "
        f"{t.cfg.optim.schedule}, warmup {t.cfg.optim.warmup_steps}",
    ]
    if t.memory_plan is not None:  # the run's memory plan (train/plan/memory_plan.py MemoryPlan)
        if t.memory_plan.text:
            lines.append(f"  model states {t.memory_plan.text} per rank (estimated)")
        lines.append(f"  memory       {_memory_text(t.memory_plan, _library_bytes(t))}")
        if t.memory_plan.async_off:  # checkpoint.async's snapshot would not fit (train/plan/memory_plan.py)
            lines.append(f"  checkpoint   {t.memory_plan.async_off}")
    host = t.resolved_config.get("resolved", {}).get("host_settings") or {}
    if host.get("banner"):  # a host setting that costs step time is on (train/launch/host_settings.py)
        lines.append(f"  {host['banner']}")
    if t.state.step:
        lines.append(f"  resumed      at step {t.state.step} ({human(t.state.tokens_seen)} tokens seen)")
    for feature in getattr(t, "features", ()):  # train.ema, train.early_stop: what each does, where it stands
        lines.extend(f"  {line}" for line in feature.banner())
    lines.append(f"  run dir      {t.run_dir}")
    lines.append(f"  full config: {t.run_dir / 'config.json'}")
    for line in t.tracker_lines:  # rank 0: where W&B / TensorBoard / MLflow data goes, or why W&B is off
        lines.append(f"  {line}")
    return "\n".join(lines)


def _validation_text(t) -> str:
    """The data line's tail: the validation samples, or that the run has none to evaluate."""
    data = t.data
    if t.cfg.train.eval_batches == 0:
        return ", no validation (train.eval_batches 0)"
    if data.val is None or len(data.val) == 0:
        return "" if "no validation" in data.describe else ", no validation"
    return f", {len(data.val)} val"


def _threads_text(t) -> str:
    """On a CPU: torch's threads per rank (OMP_NUM_THREADS: train/launch/device_env.py cpu_threads)."""
    threads = t.resolved_config.get("resolved", {}).get("hardware", {}).get("cpu_threads")
    return f", {threads} torch thread(s) per rank" if t.topo.device == "cpu" and threads else ""


def _attention_text(t) -> str:
    """An hf: model's attention implementation (model.attn_implementation or its config.json's)."""
    impl = t.workload.model_config.get("attn_implementation") if t.workload.family == "hf" else None
    return f", attention {impl}" if impl else ""


def _hub_text(t) -> str:
    """A model from the Hub: the commit its revision resolved to (config.json: model.resolved.hub)."""
    hub = t.workload.model_config.get("hub") if t.workload.family == "hf" else None
    return f", from the Hub {hub['id']}@{hub['revision']} = commit {hub['commit']}" if hub else ""


def _own_code_text(t) -> str:
    """Code that is not zerotrain's: a py: factory's loss, an hf: directory's own modeling code."""
    m = t.cfg.model
    if m.family == "hf" and m.trust_remote_code:
        return ", trust_remote_code: runs the directory's own modeling code"
    if t.workload.family == "py":
        return f", your factory, loss {t.workload.model_config.get('loss')}"
    return ""


def _lora_text(t) -> str:
    lora = t.workload.lora
    if lora is None:
        return ""
    return f", LoRA r={lora['r']} alpha={lora['alpha']:g} on {','.join(lora['target_modules'])}, base frozen"


def _library_bytes(t) -> int | None:
    """On a CPU: rank 0's resident library code now (RssFile), which the estimate leaves out."""
    if t.topo.device != "cpu":
        return None
    from zerotrain.train.observe.metrics import file_backed_bytes
    return file_backed_bytes() or None


def _memory_text(memory_plan, library: int | None = None) -> str:
    """The planner's peak per rank (`memory_plan`: a MemoryPlan) against the memory check's budget
    (train/plan/memory_check.py), and what that peak counts: on a GPU the tensors the rank
    allocates; on a CPU the memory the rank owns (the runtime's heap, model states, activations,
    buffers), not the shared library code (`library`: its resident bytes, RssFile) that `top`'s
    RES adds. The measured peak follows in each log row (peak_mem_bytes) and the summary."""
    budget = memory_plan.budget
    if budget is None:
        return "budget not checked (distributed.memory_check false)"
    e = memory_plan.estimate
    peak = e.device_total if e is not None else None
    if peak is None:
        return f"budget {human_bytes(budget.bytes)} per rank: {budget.source}"
    share = f" ({100 * peak / budget.bytes:.0f}%)" if budget.bytes > 0 else ""
    if getattr(e, "device_kind", "cuda") == "cpu":
        counts = (f"the memory a rank owns, not the {human_bytes(library) + ' of ' if library else ''}shared "
                  f"library code that top's RES adds")
    else:
        counts = "tensors, not the CUDA context or the allocator's cache"
    return (f"estimated peak {human_bytes(peak)} of {human_bytes(budget.bytes)} per rank{share}: "
            f"{budget.source}; counts {counts}")


def _measured_text(t, peak: int) -> str:
    """The summary's memory line: the measured peak (the worst rank's) beside the estimate."""
    e = t.memory_plan.estimate if t.memory_plan is not None else None
    est = f"; estimated {human_bytes(e.device_total)}" if e is not None else ""
    if t.topo.device == "cpu":
        from zerotrain.train.observe.metrics import file_backed_bytes
        lib = file_backed_bytes()
        return (f"peak RSS {human_bytes(peak)} per rank (the worst rank, shared library code included"
                + (f": {human_bytes(lib)} on rank 0" if lib else "") + f"){est}"
                + (" without the library code" if e is not None else ""))
    return f"peak {human_bytes(peak)} of GPU tensors per rank (the worst rank){est}"


def duration(seconds: float) -> str:
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s % 60:02d}s" if m else f"{seconds:.1f}s")


def progress_line(m: dict, step: int, max_steps: int) -> str:
    """The plain-text progress line printed per logging interval when there is no tqdm bar."""
    parts = [f"step {step}/{max_steps}", f"loss {m['loss']:.4f}", f"lr {m['lr']:.3g}"]
    if "tokens_per_s" in m:
        parts.append(f"{human(m['tokens_per_s'])} tok/s")
    else:
        parts.append(f"{m['samples_per_s']:.1f} samples/s")
    if "mfu" in m:
        parts.append(f"mfu {100 * m['mfu']:.1f}%")
    parts.append(f"eta {duration(m['step_time_s'] * (max_steps - step))}")
    return "  ".join(parts)


def summary(t, result: dict, elapsed: float, sample: str | None, exported: str | None, ckpt: str | None) -> str:
    st = t.state
    step0, samples0, tokens0 = t.start_counts
    lm = t.data.items_per_sample > 1
    done = st.tokens_seen - tokens0 if lm else st.samples_seen - samples0
    lines = ["zerotrain done " + "-" * 55,
             f"  {st.step - step0} steps in {duration(elapsed)}, {human(done)} {'tokens' if lm else 'samples'}"
             f" ({human(done / max(elapsed, 1e-9))}/s on average, evaluation included)"
             + (f"; resumed at step {step0}, now {st.step}" if step0 else "")
             + (f" ({t.stop.message})" if t.stop is not None else "")]
    if "loss" in result:
        lines.append(f"  final train loss {result['loss']:.4f}")
    val = {k: v for k, v in result.items() if k.startswith("val/") and k != "val/samples"}
    if val:
        lines.append("  validation   " + ", ".join(f"{k[4:]} {v:.4f}" for k, v in val.items()))
    peak = t.log.peak_mem if getattr(t, "log", None) is not None else 0
    if peak:
        lines.append("  memory       " + _measured_text(t, peak))
    lost = t.stop is not None and t.stop.name == "save_failed"
    if ckpt or lost:
        lines.append(f"  checkpoint   {ckpt or 'none'}"
                     + (" (the last good one: the run's last save failed; exit code 2)" if lost else ""))
    el = getattr(t, "elastic", None)
    if el is not None and el.restarts:
        lines.append(f"  elastic      {el.restarts} restart{'s' if el.restarts != 1 else ''} of job {el.run_id}, "
                     f"{el.steps_recomputed} step{'s' if el.steps_recomputed != 1 else ''} recomputed, now "
                     f"{el.world} process(es) on {len(el.nodes)} node(s)")
    if exported:
        lines.append(f"  weights      {exported}")
    if "jsonl" in t.cfg.logging.trackers:
        lines.append(f"  metrics      {t.run_dir / 'metrics.jsonl'}  (plot: zerotrain plot {t.run_dir})")
    if t.wandb:
        lines.append(f"  wandb        {t.wandb.location}")
    if sample is not None:
        lines.append("  sample:\n" + "\n".join("    | " + s for s in sample.splitlines()[:12]))
    return "\n".join(lines)
