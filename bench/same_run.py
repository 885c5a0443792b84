"""The same seed, the same run: proof that a change to zerotrain preserved its behaviour.

Run it once on the code before a change and once after, then compare:

    (cd /path/to/old/checkout && python /path/to/bench/same_run.py --out /tmp/before)
    python bench/same_run.py --out /tmp/after --resume-from /tmp/before/resume_whole/checkpoints/step_00000010
    python bench/same_run.py --compare /tmp/before/same_run.json /tmp/after/same_run.json

Each scenario is a real launch (the deepspeed launcher, 2 CPU processes) of the checkout in the
current directory; what is kept of it is what must not change:

  make_train  `make train`'s command as it is (on a CPU machine) (examples/default.yaml, ZeRO-2 fp32, 300 steps)
  zero3       the default model, ZeRO-3 fp32, 30 steps, partitioned checkpoint and export
  sft         the built-in GPT on instruction data (data.kind sft, masked labels), DDP, 20 steps
  resume      20 steps saved every 10; then its step-10 checkpoint resumed to 20 in a new run dir
  old_ckpt    (--resume-from) a checkpoint written by ANOTHER checkout resumed here to step 20

Kept per scenario: every metrics.jsonl row's losses and gradient norm exactly as written (the
JSON text of the number), and the sha256 of every exported file and every checkpoint tensor
file. Rows of timing (tokens/s, seconds) are left out: they differ from run to run.
--compare prints the first difference of each scenario and exits 1 on any.

Nothing of zerotrain is imported here: the script works on any checkout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

KEYS = ("loss", "val/loss", "grad_norm", "loss_scale", "skipped_steps", "samples_seen", "tokens_seen", "epoch")
FP32 = "ds_configs/zero2_fp32.json"


def _launch(out: Path, name: str, args: list[str], run: str | None = None) -> Path:
    run_dir = out / (run or name)
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
           str(29500 + random.Random(name).randint(1, 400)), "train/main.py", *args,
           "--train.run_dir", str(run_dir), "--train.progress", "false", "--logging.wandb.mode", "disabled"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    (out / f"{name}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"{name}: exit {r.returncode}; see {out / (name + '.log')}")
    print(f"  {name}: {time.time() - t0:.0f} s", flush=True)
    return run_dir


def _rows(run_dir: Path) -> dict:
    """step -> {key: the number's JSON text} for the deterministic keys of metrics.jsonl."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        # The numbers' text as written (json.loads would round-trip them through floats).
        row = json.loads(line)
        texts = dict(re.findall(r'"([^"]+)": (-?[0-9][0-9.eE+-]*|NaN|Infinity|-Infinity)', line))
        kept = {k: texts[k] for k in KEYS if k in texts}
        if kept and "step" in row:
            out.setdefault(str(row["step"]), {}).update(kept)
    return out


def _hashes(d: Path) -> dict:
    """sha256 of every file of the export (weights, index, model config) and, for a safetensors
    file, of what it holds: its header with the keys in sorted order, then its data. Older
    zerotrain wrote the header's metadata in a random order (a Rust HashMap's), so two exports of
    the same weights could differ in their bytes and agree in what they hold."""
    if not d.is_dir():
        return {}
    out = {}
    for p in sorted(d.rglob("*")):
        if not p.is_file():
            continue
        data = p.read_bytes()
        out[str(p.relative_to(d))] = hashlib.sha256(data).hexdigest()
        if p.suffix == ".safetensors":
            n = int.from_bytes(data[:8], "little")
            header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True).encode()
            out[f"{p.relative_to(d)} (content)"] = hashlib.sha256(header + data[8 + n:]).hexdigest()
    return out


def _checkpoint_tensors(run_dir: Path, step: int) -> dict:
    d = run_dir / "checkpoints" / f"step_{step:08d}"
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))}


def _record(run_dir: Path, last_step: int) -> dict:
    return {"metrics": _rows(run_dir), "export": _hashes(run_dir / "export"),
            "checkpoint": _checkpoint_tensors(run_dir, last_step)}


def _sft_data(out: Path) -> Path:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "zeta", "theta", "kappa", "sigma", "omega", "lambda"]
    say = lambda k: " ".join(rng.choice(words) for _ in range(k))  # noqa: E731
    path = out / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": say(rng.randint(1, 5)), "response": say(rng.choice([1, 2, 3, 4]))})
                            + "\n" for _ in range(400)))
    return path


SCENARIOS = ("make_train", "zero3", "sft", "resume")


def run(out: Path, resume_from: str | None, only=SCENARIOS) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "same_run.json"
    res = json.loads(path.read_text()) if path.is_file() else {}
    print(f"same_run: {Path.cwd()} -> {out}", flush=True)
    if "make_train" in only:
        d = _launch(out, "make_train", ["--config", "examples/default.yaml", "--ds-config", FP32])
        res["make_train"] = _record(d, 300)
    common = ["--config", "examples/default.yaml", "--train.eval_every", "10", "--checkpoint.every_steps", "10",
              "--checkpoint.save_at_end", "true"]
    if "zero3" in only:
        zero3 = json.loads(Path("ds_configs/zero3.json").read_text())
        zero3.update(bf16={"enabled": False}, fp16={"enabled": False})  # fp32, as the tests run ZeRO-3 on CPU
        (out / "zero3_fp32.json").write_text(json.dumps(zero3, indent=1))
        d = _launch(out, "zero3", common + ["--ds-config", str(out / "zero3_fp32.json"), "--train.max_steps", "30"])
        res["zero3"] = _record(d, 30)
    if "sft" in only:
        sft = ["--model.name", "gpt-tiny", "--data.kind", "sft", "--data.path", str(_sft_data(out)),
               "--data.seq_len", "64", "--train.micro_batch_size", "4", "--train.grad_accum_steps", "2",
               "--train.max_steps", "20", "--train.eval_every", "10", "--checkpoint.every_steps", "10",
               "--ds-config", FP32]
        res["sft"] = _record(_launch(out, "sft", sft), 20)
    base = common + ["--ds-config", FP32, "--logging.every_steps", "1"]  # resumes: every step's loss
    if "resume" in only:
        whole = _launch(out, "resume_whole", base + ["--train.max_steps", "20"])
        step10 = whole / "checkpoints" / "step_00000010"
        d = _launch(out, "resume", base + ["--train.max_steps", "20", "--checkpoint.resume", str(step10)])
        res["resume"] = {"whole": _record(whole, 20), "resumed": _record(d, 20)}
    if resume_from:
        d = _launch(out, "old_ckpt", base + ["--train.max_steps", "20", "--checkpoint.resume", resume_from])
        res["old_ckpt"] = _record(d, 20)
    path.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    print(f"wrote {path}")
    return res


def _first_diff(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=lambda k: (len(k), k)):
            if k not in a or k not in b:
                return f"{path}/{k}: only in {'after' if k not in a else 'before'}"
            d = _first_diff(a[k], b[k], f"{path}/{k}")
            if d:
                return d
        return None
    return None if a == b else f"{path}: {a} != {b}"


def _split(rec):
    """(the record without the raw bytes of safetensors files that have a content hash, those bytes)."""
    if not isinstance(rec, dict):
        return rec, {}
    kept, raw = {}, {}
    for k, v in rec.items():
        if isinstance(v, dict):
            kept[k], sub = _split(v)
            raw.update({f"{k}/{s}": h for s, h in sub.items()})
        elif k.endswith(".safetensors") and f"{k} (content)" in rec:
            raw[k] = v
        else:
            kept[k] = v
    return kept, raw


def _logged(rec) -> int:
    return len(rec["metrics"]) if "metrics" in rec else sum(_logged(v) for v in rec.values() if isinstance(v, dict))


def compare(before: Path, after: Path) -> int:
    """Losses, metrics and what every export and checkpoint file holds must be identical; the
    raw bytes of safetensors files are reported beside (see _hashes)."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            continue
        (ka, ra), (kb, rb) = _split(a[name]), _split(b[name])
        d = _first_diff(ka, kb)
        same_bytes = [k for k in ra if rb.get(k) == ra[k]]
        print(f"{name:11s} {'identical' if d is None else 'DIFFERS: ' + d}  ({_logged(a[name])} logged rows; "
              f"safetensors files with the same bytes: {len(same_bytes)} of {len(ra)})")
        bad += d is not None
    if "old_ckpt" in b and "resume" in a:  # the old run's own continuation, against this checkout's resume of it
        want = {s: r for s, r in a["resume"]["whole"]["metrics"].items() if int(s) > 10}
        got = {s: r for s, r in b["old_ckpt"]["metrics"].items() if int(s) > 10}
        d = _first_diff(want, got) or _first_diff(a["resume"]["whole"]["checkpoint"], b["old_ckpt"]["checkpoint"])
        print(f"{'old_ckpt':11s} BEFORE's step-10 checkpoint resumed by AFTER, against BEFORE's own steps 11-20 "
              f"and its step-20 checkpoint tensors: {'identical' if d is None else 'DIFFERS: ' + d} "
              f"({len(want)} logged rows)")
        bad += d is not None
    return 1 if bad else 0


def rehash(out: Path) -> None:
    """Recompute the hashes of an --out folder's runs into its same_run.json (after this script
    learnt a new one)."""
    path = out / "same_run.json"
    res = json.loads(path.read_text())
    for name, rec in res.items():
        for sub, run_dir in (("", out / name),) if name != "resume" else (("whole", out / "resume_whole"),
                                                                          ("resumed", out / "resume")):
            r = rec[sub] if sub else rec
            r["export"] = _hashes(run_dir / "export")
    path.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--resume-from", help="a checkpoint directory written by another checkout (old_ckpt)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    p.add_argument("--rehash", type=Path, metavar="OUT", help="recompute the hashes of an --out folder")
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios to (re)run into --out")
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if a.rehash:
        rehash(a.rehash.resolve())
        return 0
    if not a.out:
        p.error("--out or --compare")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".cache" / "torch_extensions"))
    run(a.out.resolve(), a.resume_from, a.only.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main())
