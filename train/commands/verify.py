"""`zerotrain verify RUN_FILE`: are this run's numbers the same under its strategy and world as
in one fp32 process? Before a long run, on the user's own model, data and settings.

It launches the training program itself (train/main.py: the same build and the same step as
`zerotrain train`, no second loop) K steps twice, each with debug.param_checksum on and a log line
every step:
  - the reference: 1 process, plain PyTorch in fp32, the same global batch (the accumulation
    steps times the data-parallel world) and so the same samples in each step (the sampler's
    global order does not depend on the world size: tests/test_stages.py, tests/test_fit.py);
  - the run checked: the chosen strategy file (--strategy, else the run file's) on N
    processes (torchrun).
Then it compares, step by step, the three numbers every strategy reports the same way: the
loss (mean over the global batch), the global gradient norm before clipping (Strategy.step's)
and the checksum of the parameters the step left (Strategy.param_checksum), prints a table
and the first step and quantity beyond the tolerance, and exits 0 (agree) or 1 (diverge).

The rounding floor: where a step is beyond the fixed band, verify measures how far this run's own
rounding carries it before it judges. It launches the reference a second time with only the
summation order changed (another number of CPU intra-op threads, so other reduction blocks in
the matmuls and convolutions, and each step's micro-batches in reverse order:
debug.reverse_micro_batches) and takes the two references' difference per step and quantity as
the floor; from step 2 on a step's tolerance is then max(band, FLOOR_FACTOR x floor). Step 1
is always judged by the band alone (the same weights and data went in, nothing amplified yet;
every planted bug shows there), so a step-1 divergence launches nothing more. For a bf16/fp16
run the floor reference is the checked JSON itself on 1 process (what that precision alone does
to the run, against the fp32 reference). A model whose first AdamW steps amplify rounding
(ResNet-18 with BatchNorm: x10-100 a step) thus passes where the strategy computes the same
thing, while a real bug, a factor on the gradient or the update from the step where it starts,
stays far above a floor of rounding. A run within the band costs no extra launch.

--matrix checks every shipped strategy (ds_configs/: DDP, ZeRO-1/2/3, offload, FSDP2) in fp32 on 1 and
N processes, and on N processes with the accumulation doubled at the same global batch, against
one reference, a row per combination (combinations() lists them). What the run file itself uses
(LoRA, packing, sequence parallelism) stays on in every row and is named in it; a GPT run file
also gets ZeRO-2 and ZeRO-3 rows with sequence parallelism 2 (--only filters the rows). docs/troubleshooting.md says what a
divergence in each quantity points to.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from zerotrain.train import paths
from zerotrain.train.args import parse_overrides
from zerotrain.train.cli_args import ArgumentParser, Value
from zerotrain.train.errors import ConfigError, UserError, user_errors

USAGE = """usage: zerotrain verify RUN_FILE [--strategy F] [--nproc N] [--steps K] [--matrix] [--keep DIR]
                        [--master-port P] [--section.key VALUE ...]

Runs RUN_FILE's model, data, batch and optimizer settings for K optimizer steps twice: as a
1-process fp32 reference with the same global batch, and under the DeepSpeed JSON F (default:
the run file's distributed.ds_config) on N processes. Before step 1 it compares the optimizer's
parameter groups (which parameters decay, lr, betas, eps, weight decay); after each step the
loss, the global gradient norm, a checksum of the update theta_t - theta_0 (relative to the
update's own size) and a checksum of the parameters; it prints a table and the first step and
quantity that differ beyond the tolerance, and exits 0 (agree) or 1 (differ). A bf16/fp16 JSON
is also checked as an fp32 copy of itself (same strategy, fp32 band): what the 16-bit band is
too wide to see.

  --strategy F    the strategy file to check (a ds_configs JSON: ddp.json plain DDP, zero*.json
                  DeepSpeed, fsdp2*.json FSDP2); --ds-config F is the same flag
  --nproc N       processes of the run checked (default 2)
  --steps K       optimizer steps (default 3)
  --matrix        instead: every shipped strategy (DDP, ZeRO-1/2/3, offload, FSDP2) in fp32 on 1 and
                  N processes and on N with the accumulation doubled (same global batch), plus
                  sequence parallelism 2 (ZeRO-2, ZeRO-3) for a GPT model; the run file's own LoRA,
                  packing and SP stay on in every row. One row each (2 to 3 launches a strategy:
                  minutes per row on a small CPU machine)
  --only S        with --matrix: only the rows whose name contains S (e.g. zero3, accum, sp2)
  --keep DIR      keep the runs (metrics.jsonl, logs) in DIR (default: a temporary directory,
                  removed at the end)
  --master-port P the rendezvous port of the multi-process launches (default: a free one)
  --section.key V a run-file override applied to both runs (e.g. --train.grad_accum_steps 2)
  --debug         tracebacks instead of one-line errors

Tolerances (relative): fp32 1e-5 (grad_norm: at least 2^-24 x sqrt(parameters), the size of an
fp32 norm's own rounding on CPU); bf16 and fp16 runs are compared with the bands in
docs/troubleshooting.md. Where a step after the first is beyond its band, one more 1-process
launch measures the run's rounding floor (the reference again, summed in another order; for a
bf16/fp16 run 1-process DDP in that precision, never the checked JSON) and that step's
tolerance becomes max(band, 4 x floor):
the table's floor and tolerance columns. Checkpoints, exports, evaluation and samples are off in both runs;
train.max_steps is K (so the LR schedule is that of a K-step run, the same in both).
"""

QUANTITIES = ("loss", "grad_norm", "update", "param_checksum")
# What a bf16/fp16 run is compared in: its 16-bit weights quantize the update itself (an update of
# lr ~1e-4 on a weight of ~0.02 is a few bf16 steps), so the update is compared in its fp32 copy.
HALF_QUANTITIES = ("loss", "grad_norm", "param_checksum")
# Relative tolerance per precision of the run checked; the reference is always fp32.
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2, "fp16": 1e-2}  # bf16, fp16: docs/troubleshooting.md#zerotrain-verify
# A step's tolerance, where the fixed band fails: max(band, FLOOR_FACTOR x the two fp32 references'
# difference). 4: the run checked rounds in yet another order, so its distance from the reference
# is a second sample of the same amplified rounding, not the same number (measured:
# docs/troubleshooting.md#zerotrain-verify).
FLOOR_FACTOR = 4
CHECKSUM = "debug/param_checksum"
UPDATE = "debug/update_checksum"
MAIN = Path(__file__).resolve().parent.parent / "main.py"  # the training program: train/main.py

def matrix_strategies() -> tuple[tuple[str, bool], ...]:
    """(ds_configs file name without .json, splits sequences) of every registered backend's
    planner options, fastest first (train/strategy/registry.py): the matrix's strategies."""
    import zerotrain.train.strategy.registry as registry
    return tuple((o.name, registry.for_option_file(o.file).splits_sequences) for o in registry.planner_options(every=True))


@dataclass
class Options:
    run_file: str
    ds_config: str | None
    nproc: int
    steps: int
    matrix: bool
    keep: str | None
    only: str | None
    debug: bool
    overrides: list
    master_port: int | None = None


@dataclass
class Result:
    """One launch: its name, where it ran, and per step {quantity: value}."""
    name: str
    run_dir: Path
    ok: bool
    log: Path
    steps: dict
    precision: str = "fp32"
    n_params: int = 0  # from the run's memory plan (fp32 reference: parameter bytes / 4)
    threads: int = 0  # torch's CPU intra-op threads (config.json; 0: not recorded)
    groups: list | None = None  # the optimizer's parameter groups before step 1 (param_groups.json)


def parse(argv: list[str]) -> Options:
    p = ArgumentParser("zerotrain verify", USAGE)
    p.add_argument("run_file", nargs="?")
    p.add_argument("--strategy", "--ds-config", dest="ds_config", action=Value)
    p.add_argument("--nproc", action=Value, convert=int, default=2)
    p.add_argument("--steps", action=Value, convert=int, default=3)
    p.add_argument("--keep", action=Value)
    p.add_argument("--matrix", action="store_true")
    p.add_argument("--only", action=Value)
    p.add_argument("--master-port", action=Value, convert=int)
    p.add_argument("--debug", action="store_true")
    known, rest = p.parse_known_args(argv)
    if not known.run_file or known.run_file.startswith("-"):
        raise ConfigError("zerotrain verify needs a run file, e.g. zerotrain verify examples/default.yaml")
    if known.nproc < 1 or known.steps < 1:
        raise ConfigError(f"--nproc and --steps must be >= 1 (got {known.nproc}, {known.steps})")
    if known.only and not known.matrix:
        raise ConfigError("--only filters the rows of --matrix; add --matrix or drop --only")
    if known.master_port is not None and not 1 <= known.master_port <= 65535:
        raise ConfigError(f"--master-port {known.master_port}: a TCP port is 1-65535; pick a free one, or drop "
                          f"the flag for a free one")
    if known.ds_config and known.ds_config.split(":")[0] != "auto" and not Path(known.ds_config).is_file():
        raise ConfigError(f"--ds-config {known.ds_config}: no such file; name a strategy file (ds_configs/*.json; --strategy is the same flag)")
    return Options(known.run_file, known.ds_config, known.nproc, known.steps, known.matrix, known.keep,
                   known.only, known.debug, parse_overrides(rest), known.master_port)


def main(argv: list[str]) -> int:
    debug = "--debug" in argv
    with user_errors(debug):
        opts = parse(argv)
        from zerotrain.train.config import load_config
        cfg = load_config(opts.run_file, opts.overrides)  # a bad run file: one line now, not in a launch
        work = Path(opts.keep) if opts.keep else Path(tempfile.mkdtemp(prefix="zerotrain-verify-"))
        work.mkdir(parents=True, exist_ok=True)
        try:
            plan = _Plan(opts, cfg, work)
            if opts.matrix:
                return plan.matrix()
            return plan.single()
        finally:
            if not opts.keep:  # the runs' logs and metrics: kept only where --keep asks
                shutil.rmtree(work, ignore_errors=True)
    return 2


class _Plan:
    """The launches of one verify and their comparison."""

    def __init__(self, opts: Options, cfg, work: Path):
        self.opts, self.cfg, self.work = opts, cfg, work
        self.sp = cfg.distributed.sequence_parallel
        # Dropout draws other masks for the same samples under another layout (rank, micro-batch),
        # so the runs would part at step 1 for that alone: both run without it, and verify says so.
        lora = getattr(cfg.model, "lora", None)
        self.no_dropout = {k: v for k, v in (("model.dropout", getattr(cfg.model, "dropout", 0.0)),
                                             ("model.lora.dropout", getattr(lora, "dropout", 0.0))) if v}
        if self.no_dropout:
            print("verify: " + ", ".join(f"{k} {v}" for k, v in self.no_dropout.items()) + " set to 0 in every run: "
                  "dropout draws other masks for the same samples on another layout, so the numbers are "
                  "compared without it", flush=True)

    def single(self) -> int:
        ref = self.reference()
        json_name = self.opts.ds_config or self.cfg.distributed.ds_config or self.machine_default()
        got = self.launch("checked", self.opts.ds_config, self.opts.nproc)
        label = f"{got.name} x{self.opts.nproc}"
        checks = [(got, label)]
        if got.precision != "fp32" and got.ok:
            # The 16-bit band (1e-2) is far wider than a wrong LR, decay or update: the same
            # strategy in fp32 is judged by the fp32 band, the update compared too (its floor, if
            # needed, is the reference again: never a run of the checked code path).
            copy = self.fp32_copy(self.opts.ds_config)
            if copy is None:
                print(f"verify: {json_name} is not a file (--ds-config auto?): no fp32 copy checked; name the JSON "
                      f"with --strategy to check it in fp32 too", flush=True)
            else:
                twin = self.launch("checked_fp32", copy, self.opts.nproc)
                checks.append((twin, f"{twin.name} x{self.opts.nproc} as fp32"))
        print(f"zerotrain verify: {self.opts.run_file}, {self.opts.steps} steps; reference: 1 process, DDP (fp32); "
              f"checked: {label}, {json_name}" + (", and its fp32 copy" if len(checks) > 1 else ""))
        failed = False
        for res, lab in checks:
            rows, first, floor, groups = self.judge(ref, res)
            print(table(rows, lab))
            if groups:
                print(f"FAIL: the optimizer's parameter groups differ before step 1 ({lab}): {groups}")
            print(verdict(first, res, lab, ref, floor, json_name + (" as fp32" if res is not got else "")))
            failed = failed or first is not None or bool(groups)
        if len(checks) > 1 and not failed:
            band = TOLERANCE.get(got.precision, TOLERANCE["fp32"])
            print(f"  ({got.precision}'s band {band:g} cannot see a strategy error smaller than that: the fp32 copy "
                  f"is what rules out a wrong LR, decay or update, down to {TOLERANCE['fp32']:g})")
        return 1 if failed else 0

    @staticmethod
    def machine_default() -> str:
        """The JSON a run that names none uses (ds_configs/zero2*.json for this machine)."""
        from zerotrain.train.launch.ds_config_choice import default_ds_config
        return str(paths.DS_CONFIGS / default_ds_config()[0])

    def judge(self, ref: Result, got: Result):
        """One checked run against the reference: (table rows, first divergence or None, the
        floor reference if one was measured, the parameter-group difference or "")."""
        qs = QUANTITIES if got.precision == "fp32" else HALF_QUANTITIES
        rows, first = compare(ref, got, self.opts.steps, quantities=qs)
        floor = self.floor_if_needed(ref, got, first)
        if floor is not None:
            rows, first = compare(ref, got, self.opts.steps, floor, quantities=qs)
        return rows, first, floor, group_difference(ref.groups, got.groups) if got.ok else ""

    def matrix(self) -> int:
        rows = [c for c in combinations(self.cfg, self.opts.nproc) if not self.opts.only or self.opts.only in c.name]
        if not rows:
            raise ConfigError(f"--only {self.opts.only}: no row of the matrix has that in its name; the rows: "
                              + ", ".join(c.name for c in combinations(self.cfg, self.opts.nproc)))
        ref = self.reference()
        print(f"zerotrain verify --matrix: {self.opts.run_file}, {self.opts.steps} steps, fp32, "
              f"against 1 process DDP (fp32); {len(rows)} rows", flush=True)
        failed, floor = 0, None
        for c in rows:
            got = self.launch(c.name, self.fp32_json(c.strategy), c.world, accum_factor=c.accum_factor, sp=c.sp)
            _, first = compare(ref, got, self.opts.steps)
            floor = floor or self.floor_if_needed(ref, got, first)  # measured once, for every row
            if first is not None and floor is not None and got.ok:
                _, first = compare(ref, got, self.opts.steps, floor)
            groups = group_difference(ref.groups, got.groups) if got.ok else ""
            failed += first is not None or bool(groups)
            label = f"{c.name}: {got.name} x{c.world}{c.note}"
            line = verdict(first, got, label, ref, floor, str(paths.DS_CONFIGS / f"{c.strategy}.json") + " in fp32")
            print(f"  {label:<60} " + (f"FAIL: the optimizer's parameter groups differ before step 1: {groups}; "
                                       if groups else "") + line, flush=True)
        return 1 if failed else 0

    # ------------------------------------------------------------------ launches
    def reference(self) -> Result:
        ref = self.launch("reference", self.fp32_json("ddp"), 1)
        if not ref.ok:
            raise UserError(f"the 1-process fp32 reference run of {self.opts.run_file} failed (its log: {ref.log}); "
                            f"fix what it says (zerotrain train --config {self.opts.run_file} shows the same) and "
                            f"verify again")
        return ref

    def floor_if_needed(self, ref: Result, got: Result, first) -> Result | None:
        """The rounding-floor reference (module docstring), launched only where the fixed band
        failed in a run that completed, after step 1; None otherwise (step 1 is judged by the band
        alone: compare)."""
        if first is None or not got.ok or first[0] == 1:
            return None
        step, q = first[0], first[1]
        # fp32: the trusted path (1-process fp32 DDP) again. bf16/fp16: 1-process DDP in that
        # precision, so the floor is how far this precision alone carries the run from fp32, from a
        # code path other than the one checked (a 1-process run of the checked JSON shares its bugs).
        half = got.precision != "fp32"
        what = f"1-process DDP in {got.precision}" if half else "the reference again"
        print(f"verify: step {step} {q} is beyond the fixed band; measuring this run's rounding floor: {what}, "
              f"summed in another order (one more 1-process launch)", flush=True)
        threads = ref.threads or 1
        floor = self.launch(f"floor_{got.precision}", self.precision_json("ddp", got.precision), 1, floor=True,
                            env={"OMP_NUM_THREADS": str(1 if threads > 1 else 2)})
        if not floor.ok:
            print(f"verify: the floor reference failed (its log: {floor.log}); judging against the fixed band only")
            return None
        return floor

    def fp32_json(self, base: str) -> str:
        """A shipped JSON with bf16 and fp16 off, written into the work dir."""
        return self.precision_json(base, "fp32")

    def precision_json(self, base: str, precision: str) -> str:
        """A shipped JSON in `precision` (fp32, bf16, fp16), written into the work dir."""
        return self.copy_in(paths.DS_CONFIGS / f"{base}.json", precision, f"{base}_{precision}.json")

    def fp32_copy(self, ds_config: str | None) -> str | None:
        """The checked JSON (else the run file's) with bf16 and fp16 off: the same strategy in
        fp32; None where that JSON is not a file (--ds-config auto)."""
        src = Path(ds_config or self.cfg.distributed.ds_config or self.machine_default())
        if not src.is_file():
            src = paths.DS_CONFIGS / src.name
        if not src.is_file():
            return None
        return self.copy_in(src, "fp32", f"{src.stem}_as_fp32.json")

    def copy_in(self, src: Path, precision: str, name: str) -> str:
        data = json.loads(Path(src).read_text())
        data["bf16"] = {"enabled": precision == "bf16"}
        data["fp16"] = {"enabled": True} if precision == "fp16" else {"enabled": False}
        out = self.work / name
        out.write_text(json.dumps(data, indent=1))
        return str(out)

    def launch(self, name: str, ds_config: str | None, world: int, accum_factor: int = 1, sp: int | None = None,
               floor: bool = False, env: dict | None = None) -> Result:
        run_dir = self.work / name
        args = ["--config", self.opts.run_file, *(["--ds-config", ds_config] if ds_config else []),
                *[f"--{k}={v}" for k, v in self.opts.overrides], *self.fixed(run_dir, world, accum_factor, sp),
                *(["--debug.reverse_micro_batches=true"] if floor else [])]
        if world == 1:
            cmd = [sys.executable, str(MAIN), *args]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                   "--master_addr", "127.0.0.1", "--master_port", str(self.opts.master_port or _free_port()),
                   str(MAIN), *args]
        log = self.work / f"{name}.log"
        print(f"verify: running {name} ({world} process{'es' if world > 1 else ''}), log {log}", flush=True)
        with open(log, "w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}).returncode
        if rc != 0:
            tail = log.read_text().strip().splitlines()[-5:]
            print(f"verify: {name} exited {rc}; the end of {log}:\n  " + "\n  ".join(tail), flush=True)
        return read_result(name, run_dir, rc == 0, log)

    def fixed(self, run_dir: Path, world: int, accum_factor: int = 1, sp: int | None = None) -> list[str]:
        """What both runs set: K steps, a log line and a checksum every step, nothing saved or
        evaluated, full fp32 matmuls, and the same global batch (the world's share of it). Both
        start fresh (checkpoint.resume none, whatever the run file says). The run checked has
        debug.collectives on: ranks that part ways are named in seconds, not after a hang.
        accum_factor (the matrix's accumulation rows): the micro-batch divided by it and the
        accumulation multiplied, the same global batch (and so, BatchNorm aside, the same step).
        sp: the sequence-parallel degree of this run (None: the run file's)."""
        out = {"train.max_steps": self.opts.steps, "train.eval_every": 0, "train.eval_batches": 1,
               "train.sample_tokens": 0, "logging.every_steps": 1, "logging.progress": "false",
               "logging.trackers": "jsonl", "checkpoint.every_steps": 0, "checkpoint.every_minutes": 0,
               "checkpoint.save_at_end": "false", "checkpoint.export": "false", "checkpoint.resume": "none",
               "debug.param_checksum": "true", "hardware.tf32": "false", "train.run_dir": str(run_dir)}
        out.update({k: 0 for k in self.no_dropout})
        if self.cfg.train.epochs:
            out["train.epochs"] = "null"
        run_sp = 1 if world == 1 else (self.sp if sp is None else sp)
        if world == 1 or run_sp != self.sp:
            out["distributed.sequence_parallel"] = run_sp
        if world > 1:
            out["debug.collectives"] = "true"
        if accum_factor > 1:
            micro = self.cfg.train.micro_batch_size
            if micro % accum_factor:
                raise UserError(f"the matrix's accumulation rows split train.micro_batch_size {micro} into "
                                f"{accum_factor}; use an even micro-batch (or --only to skip the accum rows)")
            out["train.micro_batch_size"] = micro // accum_factor
        if self.cfg.train.global_batch_size is None:  # else each run derives its accumulation from it
            accum = self.cfg.train.grad_accum_steps or 1
            dp_checked = max(1, self.opts.nproc // self.sp)  # the data-parallel ranks of the run checked
            dp = max(1, world // run_sp)
            out["train.grad_accum_steps"] = accum * dp_checked // dp * accum_factor
        return [f"--{k}={v}" for k, v in out.items()]


@dataclass
class Combination:
    """One row of --matrix: a shipped strategy (ds_configs/NAME.json, in fp32) on `world`
    processes, the micro-batch split `accum_factor` ways into more accumulation steps (the same
    global batch), sequence parallelism `sp` (None: the run file's)."""
    strategy: str
    world: int
    accum_factor: int = 1
    sp: int | None = None
    note: str = ""

    @property
    def name(self) -> str:
        return (f"{self.strategy}_w{self.world}" + (f"_accum{self.accum_factor}" if self.accum_factor > 1 else "")
                + (f"_sp{self.sp}" if self.sp else ""))


def combinations(cfg, nproc: int) -> list[Combination]:
    """The matrix's rows: every shipped strategy on 1 and nproc processes and, on nproc, with the
    accumulation doubled at the same global batch (an even micro-batch); for a GPT model on an
    even nproc, ZeRO-2 and ZeRO-3 with sequence parallelism 2 as well (SP needs a ZeRO JSON; the
    ZeRO-3 row covers gathered parameters). The
    run file's own LoRA, packing and sequence parallelism are in every row (named in its note)."""
    uses = [what for what, on in (("lora", getattr(cfg.model, "lora", None) is not None),
                                  ("packing", getattr(cfg.data, "packing", False)),
                                  (f"sp{cfg.distributed.sequence_parallel}", cfg.distributed.sequence_parallel > 1))
            if on]
    note = f" ({', '.join(uses)})" if uses else ""
    worlds = sorted({1, nproc})
    accum = nproc > 1 and cfg.train.micro_batch_size % 2 == 0
    out = []
    for name, splits in matrix_strategies():
        refused = cfg.distributed.sequence_parallel > 1 and not splits  # sequence parallelism needs a ZeRO JSON
        out += [Combination(name, w, note=note) for w in worlds if not (refused and w > 1)]
        if accum and not refused:
            out.append(Combination(name, nproc, 2, note=note))
    from zerotrain.models.config import GptModel
    if isinstance(cfg.model, GptModel) and nproc % 2 == 0 and cfg.distributed.sequence_parallel == 1:
        out += [Combination(name, nproc, sp=2, note=note) for name in ("zero2", "zero3")]
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_result(name: str, run_dir: Path, ok: bool, log: Path) -> Result:
    """Per step: the log line's loss and grad_norm, the checksum row's param_checksum."""
    steps: dict = {}
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    for r in rows:
        s = r.get("step")
        if "loss" in r:
            steps.setdefault(s, {}).update(loss=r["loss"], grad_norm=r.get("grad_norm"))
        if CHECKSUM in r:
            steps.setdefault(s, {}).update(param_checksum=r[CHECKSUM], checksum_scale=math.sqrt(r[CHECKSUM + "_sq"]))
        if UPDATE in r:
            steps.setdefault(s, {}).update(update=r[UPDATE])
            if "debug/update_sq" in r:  # a 1-process run: the update's own scale
                steps[s]["update_scale"] = math.sqrt(r["debug/update_sq"])
    label, precision = name, "fp32"
    rank0 = run_dir / "ranks" / "rank0.json"
    if rank0.exists():
        label = json.loads(rank0.read_text()).get("strategy", name)
    cfg, n_params, threads = run_dir / "config.json", 0, 0
    if cfg.exists():
        resolved = json.loads(cfg.read_text()).get("resolved", {})
        threads = (resolved.get("hardware") or {}).get("cpu_threads") or 0
        precision = resolved.get("precision", "fp32")
        param_bytes = ((resolved.get("memory_plan") or {}).get("device_bytes") or {}).get("params") or 0
        n_params = param_bytes // (4 if precision == "fp32" else 2)
    groups_file = run_dir / "param_groups.json"
    groups = json.loads(groups_file.read_text())["groups"] if groups_file.exists() else None
    return Result(label, run_dir, ok, log, steps, precision, n_params, threads, groups)


def group_difference(ref: list | None, got: list | None) -> str:
    """What differs between two runs' optimizer parameter groups (param_groups.json) before step
    1: the number of groups, the parameters in each (which decay), lr, betas, eps, weight decay.
    "" where they agree or a run did not record them."""
    if ref is None or got is None:
        return ""
    if len(ref) != len(got):
        return f"{len(ref)} groups in the reference, {len(got)} in the run checked"
    out = []
    for i, (a, b) in enumerate(zip(ref, got)):
        if a["names"] != b["names"]:
            moved = sorted(set(a["names"]) ^ set(b["names"]))
            out.append(f"group {i} (weight_decay {a['weight_decay']}) holds other parameters: "
                       + (", ".join(moved[:4]) + (" ..." if len(moved) > 4 else "") if moved else "another order"))
        for key in ("lr", "betas", "eps", "weight_decay"):
            if a.get(key) != b.get(key):
                out.append(f"group {i} {key} {a.get(key)} in the reference, {b.get(key)} in the run checked")
    return "; ".join(out)


def tolerance(q: str, got: Result, ref: Result) -> float:
    """The relative band of quantity q for `got`'s precision. fp32 grad_norm: at least 2^-24 x
    sqrt(parameters), the size of an fp32 norm's own rounding on CPU: a norm over ZeRO partitions
    and one over whole tensors part by about that much with the same gradient (measured:
    docs/troubleshooting.md#zerotrain-verify)."""
    tol = TOLERANCE.get(got.precision, TOLERANCE["fp32"])
    if q == "grad_norm" and got.precision == "fp32":
        tol = max(tol, 2.0 ** -24 * math.sqrt(ref.n_params))
    return tol


def rel_diff(a, b, scale=None) -> float:
    """|a - b| relative to the larger of them, or to `scale` where given."""
    if a is None or b is None:
        return math.inf  # a step or a number one run lacks
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b else math.inf
    scale = scale or max(abs(a), abs(b))
    return 0.0 if scale == 0 else abs(a - b) / scale


def compare(ref: Result, got: Result, steps: int, floor: Result | None = None, quantities=QUANTITIES):
    """The table's rows (step, quantity, reference, checked, floor, tolerance, rel. diff, within)
    and the first row beyond its tolerance (None: they agree). The tolerance is the band of
    `got`'s precision, or, where the rounding-floor reference `floor` is given, max(band,
    FLOOR_FACTOR x the two references' difference at that step) from step 2 on (floor None in the
    row: not measured; step 1 is always judged by the band: no rounding has been amplified there,
    and every bug of the distribution shows from the first step it is in). A step either run lacks
    (it failed) is a divergence at that step. The update (theta_t - theta_0) is relative to the
    reference update's own size: a wrong decay or LR is a fraction of the update, where it is a
    hair of the parameters."""
    rows, first = [], None
    for step in range(1, steps + 1):
        for q in quantities:
            theirs = ref.steps.get(step, {})
            a, b = theirs.get(q), got.steps.get(step, {}).get(q)
            # The checksum relative to its size for random signs (Strategy.param_checksum): the
            # typical relative change of one parameter (update: of the update), whatever the sum's
            # cancellation.
            scale = {"param_checksum": theirs.get("checksum_scale"), "update": theirs.get("update_scale")}.get(q)
            d = rel_diff(a, b, scale)
            tol, fl = tolerance(q, got, ref), None
            if floor is not None:
                fl = rel_diff(a, floor.steps.get(step, {}).get(q), scale)
                if step > 1 and math.isfinite(fl):  # step 1: the same weights and data went in, nothing amplified yet
                    tol = max(tol, FLOOR_FACTOR * fl)
            row = (step, q, a, b, fl, tol, d, d <= tol)
            rows.append(row)
            if first is None and not row[-1]:
                first = row
    return rows, first


def _num(v) -> str:
    return "-" if v is None else f"{v:.9g}"


def table(rows, label: str) -> str:
    lines = [f"{'step':>4}  {'quantity':<15} {'reference':>18} {label[:28]:>28} {'floor':>9} {'tolerance':>9} "
             f"{'rel. diff':>10}"]
    for step, q, a, b, fl, tol, d, ok in rows:
        lines.append(f"{step:>4}  {q:<15} {_num(a):>18} {_num(b):>28} {'-' if fl is None else f'{fl:.2e}':>9} "
                     f"{tol:>9.2e} {d:>10.2e}{'' if ok else '  <-- beyond tolerance'}")
    return "\n".join(lines)


def verdict(first, got: Result, label: str, ref: Result | None = None, floor: Result | None = None,
            json_name: str = "") -> str:
    what = ("two fp32 references summed in different orders" if floor is None or floor.precision == "fp32" else
            f"the fp32 reference against 1-process DDP in {floor.precision}, summed in another order")
    named = f" ({json_name})" if json_name else ""
    floored = "" if floor is None else (f"; the fixed band alone failed, so from step 2 on the tolerance is "
                                        f"max(band, {FLOOR_FACTOR} x the rounding floor: {what})")
    if first is None:
        tol = TOLERANCE.get(got.precision, TOLERANCE["fp32"])
        g = tolerance("grad_norm", got, ref) if ref is not None else tol
        extra = f", grad_norm within {g:.1e} (an fp32 norm's rounding)" if g > tol else ""
        qs = "loss, grad_norm, update and param_checksum" if got.precision == "fp32" else \
            "loss, grad_norm and param_checksum"
        return (f"OK: {qs} agree at every step within {tol:g} relative ({got.precision}){extra}{floored}; "
                f"the optimizer's parameter groups agree" + (f"; checked{named}" if named else ""))
    step, q, a, b, fl, tol, d, _ = first
    why = "" if got.ok else f" ({label} failed: see {got.log})"
    return (f"FAIL: first divergence at step {step}, {q}: reference {_num(a)} vs {_num(b)}, relative difference "
            f"{d:.2e} > {tol:.3g} ({got.precision}){why}{floored}; docs/troubleshooting.md#zerotrain-verify says "
            f"what it points to" + (f"; checked{named}" if named else ""))
