"""`zerotrain plan`: the command line of the ZeRO planner (train/plan/estimate.py does the arithmetic).

    zerotrain plan gpt-1.3b --gpus-per-node 8 --device-mem 80GB --micro-batch 8
    zerotrain plan runs/my_run.yaml --device-mem 24GiB --json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from zerotrain.train import paths
from zerotrain.train.cli_args import ArgumentParser, Value
from zerotrain.train.errors import ConfigError, did_you_mean, user_errors
from zerotrain.train.plan.estimate import GiB, Cluster, Device, Plan, make_plan
from zerotrain.train.plan.shapes import BatchShape, ModelShape, count_shape, gpt_shape
from zerotrain.train.plan.sp_fit import first_fit, sizes


def parse_count(text: str) -> Optional[int]:
    """'124M', '1.3B', '7e9', '350000000' -> int; None if it is not a count."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2)])


def parse_bytes(text: str, flag: str) -> int:
    """'80GB' (1e9), '80GiB' / '80G' (2^30), '1.5TB', '512MiB'."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*", str(text).lower())
    if not m or (not m.group(2) and (m.group(3) or m.group(4))):
        raise ConfigError(f"{flag} {text!r} is not a size; write e.g. 80GB, 80GiB or 141G")
    power = "kmgt".index(m.group(2)) + 1 if m.group(2) else 0
    decimal = m.group(4) and not m.group(3)   # "GB" is decimal like GPU datasheets; "G"/"GiB" binary
    return int(float(m.group(1)) * ((1000 if decimal else 1024) ** power))


def _gib(n: Optional[int]) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def render(plan: Plan) -> str:
    c, b, dev = plan.cluster, plan.batch, plan.device
    trained = sum(plan.shape.tensors)
    frozen = f", {trained / 1e6:,.3f}M trained" if plan.shape.frozen else ""  # LoRA: the adapters
    if plan.shape.active_params is not None:  # mixture of experts: memory follows the total, FLOPs the active
        frozen += (f", {plan.shape.active_params / 1e6:,.1f}M active per token; ZeRO-3 gathers "
                   f"{plan.shape.leaf_block / 1e6:,.2f}M at once (one MoE block)")
    head = (f"zerotrain plan: {plan.shape.name} ({plan.shape.num_params / 1e6:,.1f}M params{frozen}), "
            f"{c.nodes} node(s) x {c.devices_per_node} {'CPU rank' if dev.kind == 'cpu' else 'device'}(s) = {c.world}, "
            f"{c.device_mem / GiB:.2f} GiB/{'rank' if dev.kind == 'cpu' else 'device'}"
            + (f", {c.cpu_mem / GiB:.0f} GiB CPU/node" if c.cpu_mem else "")
            + f"\n  batch: micro {b.micro} x seq {b.seq_len} x accum {b.accum}, activation checkpointing "
            + ("on" if b.checkpointing else "off") + (", document mask" if b.document_mask else "")
            + f", {plan.rows[0].option.precision}"
            + (f", sequence parallel {b.sequence_parallel} ({b.seq_len // b.sequence_parallel} tokens of a row per "
               f"rank; ZeRO only: DDP is refused with it)" if b.sequence_parallel > 1 else "")
            + (f"\n  device: CPU (host RAM); runtime (libraries) {dev.runtime / GiB:.2f} GiB per rank"
               if dev.kind == "cpu" else ""))
    cols = ("option", "params", "grads", "optim", "buffers", "activ", "bwd+", "step+", "peak", "host/node", "comm",
            "fits")
    table = [cols]
    usable = (1 - plan.safety) * c.device_mem
    for r in plan.rows:
        fit = "NO" if not r.fits else ("yes" if r.device_total <= usable else "tight")
        table.append((r.option.label, _gib(r.params), _gib(r.grads), _gib(r.optimizer), _gib(r.buffers),
                      _gib(r.activations), _gib(r.backward_work), _gib(r.step_work), _gib(r.device_total),
                      _gib(r.host * c.devices_per_node) if r.host else "-",
                      f"{r.comm:.1f}x" if r.comm is not None else "-", fit))
    widths = [max(len(row[i]) for row in table) for i in range(len(cols))]
    lines = [head, "", "  GiB per device (host/node: offloaded states per node)"]
    for i, row in enumerate(table):
        lines.append("  " + "  ".join(v.ljust(w) if j == 0 else v.rjust(w) for j, (v, w) in enumerate(zip(row, widths))))
        if i == 0:
            lines.append("  " + "  ".join("-" * w for w in widths))
    if plan.recommended:
        r = plan.recommended
        lines.append(f"\nrecommended: {r.option.label}  (--ds-config {_rel(r.option.path)}): the fastest option "
                     f"whose {r.device_total / GiB:.2f} GiB fits in {usable / GiB:.2f} GiB ({plan.safety:.0%} headroom)")
    else:
        sp = plan.sp_fit.clause("--sequence-parallel", f"{plan.sp_fit.estimate.device_total / GiB:.2f} GiB") + "; " \
            if plan.sp_fit else ""
        lines.append(f"\nnothing fits in {usable / GiB:.2f} GiB per device ({plan.safety:.0%} headroom): "
                     + sp + _advice(plan))
    notes = sorted({n for r in plan.rows for n in r.notes})
    lines.append("\npeak = " + ("runtime + " if dev.runtime else "") + "params + grads + optim + buffers + the larger of "
                 "(activ + bwd+) and step+; bwd+: gathered ZeRO-3 params, flattened gradients, autocast copies; "
                 "step+: the optimizer step's temporaries. fits: peak within the memory (tight: within the "
                 "headroom). comm = volume per optimizer step relative to DDP's all-reduce (ZeRO paper); offload "
                 "adds PCIe traffic.")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def _advice(plan: Plan) -> str:
    tips = []
    if not plan.batch.checkpointing and plan.shape.gpt is not None:
        tips.append("--activation-checkpointing")
    if plan.batch.micro > 1:
        tips.append("a smaller --micro-batch (raise accumulation instead)")
    tips.append("more devices or nodes")
    return "try " + ", ".join(tips)


def sp_fit(plan: Plan, precision: str):
    """When nothing fits a GPT's plan: the smallest --sequence-parallel (dividing the world, the heads,
    the key/value heads and the sequence) with which a ZeRO option would (train/plan/sp_fit.py)."""
    g, b, c = plan.shape.gpt, plan.batch, plan.cluster
    if plan.recommended is not None or g is None:
        return None
    usable = (1 - plan.safety) * c.device_mem
    plans = ((n, make_plan(plan.shape, c, replace(b, sequence_parallel=n), precision, plan.safety,
                           device=plan.device).rows)
             for n in sizes(b.sequence_parallel, c.world, g.n_head, g.n_kv_head, b.seq_len))
    return first_fit(plan.rows[0].activations, plans, lambda r: r.fits and r.device_total <= usable)


def _rel(path: Optional[str]) -> str:
    if not path:
        return "-"
    try:
        return str(Path(path).resolve().relative_to(Path.cwd()))
    except ValueError:
        return path



USAGE = """usage: zerotrain plan MODEL [--nodes N] [--gpus-per-node G] [--device-mem SIZE] [--cpu-mem SIZE]
                      [--micro-batch B] [--seq-len T] [--grad-accum K] [--activation-checkpointing]
                      [--sequence-parallel N]
                      [--precision bf16|fp16|fp32] [--safety 0.1] [--device cuda|cpu] [--runtime SIZE] [--json]

MODEL is a GPT preset (gpt-tiny ... gpt-7b), a run file (.yaml/.json; its model, batch and
sequence length are used), your own model py:<module>:<factory> (built on the meta device), or
a parameter count (124M, 1.3B, 7e9). Sizes: 80GB (decimal,
as on datasheets), 80GiB or 80G (binary). Defaults: this machine's GPUs if it has any,
else 1 node x 8 devices x 80GB. Prints the peak memory per device of DDP, ZeRO-1/2/3 and the
two offload options (from ds_configs/*.json) and recommends the fastest that fits.

--device cpu plans CPU ranks (device memory = host RAM, e.g. a memory cgroup limit per rank;
--gpus-per-node then counts ranks per node): the peak includes the memory a rank owns before
its model exists (anonymous pages of the imported libraries; their shared code pages are not
charged per rank), measured by importing them once here (seconds), or --runtime SIZE.

--sequence-parallel N plans Ulysses sequence parallelism (distributed.sequence_parallel): each
rank holds 1/N of every row, so activations divide by N; the all-to-all buffers are added. When
nothing fits a GPT, the plan names the smallest N that would make a ZeRO option fit, if one does.
"""

FLAGS = {"--nodes": int, "--gpus-per-node": int, "--device-mem": str, "--cpu-mem": str, "--micro-batch": int,
         "--seq-len": int, "--grad-accum": int, "--precision": str, "--safety": float, "--device": str,
         "--runtime": str, "--sequence-parallel": int}


def measure_cpu_runtime() -> int:
    """Bytes a fresh process owns (train/device_memory.owned_bytes) once it holds what a CPU
    rank imports before its model exists."""
    import subprocess
    code = ("import torch, torch._dynamo, deepspeed, accelerate, transformers\n"
            "from zerotrain.train.launch.device_memory import owned_bytes\nprint('RSS', owned_bytes())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=paths.REPO, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RSS ")), None)
    if proc.returncode != 0 or line is None:
        raise ConfigError(f"--device cpu: could not measure a rank's runtime memory ({proc.stderr.strip()[-300:]}); "
                          f"pass --runtime SIZE (e.g. --runtime 0.9GiB)")
    return int(line.split()[1])


def parse_args(argv: list[str]) -> dict:
    """The flags given (absent ones are left out, for main's defaults), json, activation_checkpointing
    (None: the run file's) and model."""
    p = ArgumentParser("zerotrain plan", USAGE, needs_value="{flag} needs a value (see zerotrain plan --help)",
                       empty_is_missing=True, argument_default=argparse.SUPPRESS)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--json", action="store_true", default=False)
    p.add_argument("--activation-checkpointing", action="store_const", const=True, default=None)
    for flag, convert in FLAGS.items():
        p.add_argument(flag, action=Value, convert=convert)
    ns, rest = p.parse_known_args(argv)
    out = vars(ns)
    for a in rest:
        if a.startswith("-"):
            raise ConfigError(f"unknown option {a!r}{did_you_mean(a.partition('=')[0], list(FLAGS) + ['--json'])}; "
                              f"see zerotrain plan --help")
        raise ConfigError(f"one MODEL only (got {out['model']!r} and {a!r})")
    if out["model"] is None:
        raise ConfigError("zerotrain plan needs a MODEL: a GPT preset (e.g. gpt-1.3b), a run file or a parameter "
                          "count (e.g. 7B); see zerotrain plan --help")
    return out


def resolve_model(spec: str) -> tuple[ModelShape, dict]:
    """(shape, batch defaults from a run file)."""
    from zerotrain.models import gpt
    if spec in gpt.PRESETS:
        return gpt_shape(spec, gpt.PRESETS[spec]), {}
    if Path(spec).suffix in (".yaml", ".yml", ".json") or Path(spec).is_file():
        from zerotrain.models import gpt_config
        from zerotrain.train.config import load_config
        cfg = load_config(spec)
        batch = {"micro_batch": cfg.train.micro_batch_size, "grad_accum": cfg.train.grad_accum_steps or 1,
                 "activation_checkpointing": cfg.model.activation_checkpointing,
                 "sequence_parallel": cfg.distributed.sequence_parallel,
                 "document_mask": cfg.data.packing or cfg.data.document_mask}
        if cfg.model.lora is not None or cfg.model.name.startswith(("hf:", "py:")):
            # Sized from the model itself, built on the meta device: a LoRA run's optimizer state and
            # gradients are its adapters' (models/lora.py), an hf: model's shapes its config.json's,
            # a py: model's its factory's module (called with model.kwargs).
            from zerotrain.models import resolve
            from zerotrain.train.plan.memory_check import model_shape
            m = resolve(cfg.model)
            return model_shape(m, None), {**batch, "seq_len": cfg.data.seq_len or m.context}
        if cfg.model.name not in gpt.PRESETS:
            raise ConfigError(f"{spec}: model.name {cfg.model.name!r} is not a GPT preset; zerotrain plan sizes "
                              f"GPTs, hf: and py: models from the run file, other models by parameter count (e.g. "
                              f"zerotrain plan 25M)")
        gcfg = gpt_config(cfg.model, vocab_size=None)
        return gpt_shape(cfg.model.name, gcfg), {**batch, "seq_len": cfg.data.seq_len or gcfg.seq_len}
    if spec.startswith("py:"):  # your own model, its factory called without kwargs (a run file gives them)
        from zerotrain.models import resolve
        from zerotrain.models.config import ModelConfig
        from zerotrain.train.plan.memory_check import model_shape
        return model_shape(resolve(ModelConfig(name=spec)), None), {}
    n = parse_count(spec)
    if n is None or n <= 0:
        raise ConfigError(f"MODEL {spec!r} is not a GPT preset{did_you_mean(spec, gpt.PRESETS)}, a run file or a "
                          f"parameter count; presets: {', '.join(gpt.PRESETS)}")
    return count_shape(n), {}


def _local_defaults() -> tuple[int, Optional[int]]:
    try:
        import torch
        if torch.cuda.is_available():
            return torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory
    except Exception:  # noqa: BLE001 - a broken CUDA install must not stop planning
        pass
    return 8, None


def main(argv: list[str]) -> int:
    with user_errors():
        a = parse_args(argv)
        shape, run = resolve_model(a["model"])
        local_devices, local_mem = _local_defaults()
        device_mem = parse_bytes(a["device_mem"], "--device-mem") if a.get("device_mem") else (local_mem or 80 * 10**9)
        cpu_mem = parse_bytes(a["cpu_mem"], "--cpu-mem") if a.get("cpu_mem") else None
        cluster = Cluster(a.get("nodes", 1), a.get("gpus_per_node", local_devices), device_mem, cpu_mem)
        ckpt = a["activation_checkpointing"] if a["activation_checkpointing"] is not None else run.get(
            "activation_checkpointing", False)
        seq = a.get("seq_len") or run.get("seq_len") or (shape.gpt.seq_len if shape.gpt else None)
        sp = a.get("sequence_parallel") or run.get("sequence_parallel", 1)
        batch = BatchShape(a.get("micro_batch") or run.get("micro_batch", 8), seq, a.get("grad_accum") or run.get(
            "grad_accum", 1), ckpt, sequence_parallel=sp, document_mask=run.get("document_mask", False))
        for name, v in (("--nodes", cluster.nodes), ("--gpus-per-node", cluster.devices_per_node),
                        ("--micro-batch", batch.micro), ("--grad-accum", batch.accum), ("--sequence-parallel", sp)):
            if v <= 0:
                raise ConfigError(f"{name} must be a positive integer (got {v})")
        if shape.gpt is not None and seq > shape.gpt.seq_len:
            raise ConfigError(f"--seq-len {seq} exceeds {shape.name}'s context length {shape.gpt.seq_len}")
        if seq is not None and seq % sp:
            raise ConfigError(f"--sequence-parallel {sp} does not divide the sequence length {seq}; choose a divisor")
        if shape.gpt is not None and (shape.gpt.n_head % sp or shape.gpt.n_kv_head % sp):
            raise ConfigError(f"--sequence-parallel {sp} does not divide {shape.name}'s {shape.gpt.n_head} attention "
                              f"heads and {shape.gpt.n_kv_head} key/value heads; choose a divisor of both")
        precision = a.get("precision", "bf16")
        if precision not in ("bf16", "fp16", "fp32"):
            raise ConfigError(f"--precision must be bf16, fp16 or fp32 (got {precision!r})")
        safety = a.get("safety", 0.1)
        if not 0 <= safety < 1:
            raise ConfigError(f"--safety is a fraction of device memory kept free, in [0, 1) (got {safety})")
        kind = a.get("device", "cuda")
        if kind not in ("cuda", "cpu"):
            raise ConfigError(f"--device must be cuda or cpu (got {kind!r})")
        if kind == "cpu":
            runtime = parse_bytes(a["runtime"], "--runtime") if a.get("runtime") else measure_cpu_runtime()
            device = Device("cpu", runtime)
        else:
            device = Device("cuda", parse_bytes(a["runtime"], "--runtime") if a.get("runtime") else 0)
        plan = make_plan(shape, cluster, batch, precision, safety, device=device)
        plan.sp_fit = sp_fit(plan, precision)
        print(json.dumps(plan.to_dict(), indent=1) if a["json"] else render(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
