"""The same seed, the same run: proof that a change to zerotrain preserved its behaviour.

Run it once on the code before a change and once after, then compare:

    (cd /path/to/old/checkout && python /path/to/bench/same_run.py --out /tmp/before)
    python bench/same_run.py --out /tmp/after --fixtures /tmp/before/fixtures \\
        --resume-from /tmp/before/resume_whole/checkpoints/step_00000010
    python bench/same_run.py --compare /tmp/before/same_run.json /tmp/after/same_run.json

Each scenario is a real launch (the deepspeed launcher, 2 CPU processes) of the checkout in the
current directory; what is kept of it is what must not change:

  make_train  `make train`'s command as it is (on a CPU machine) (examples/default.yaml, ZeRO-2 fp32, 300 steps)
  zero3       the default model, ZeRO-3 fp32, 30 steps, partitioned checkpoint and export
  sft         the built-in GPT on instruction data (data.kind sft, masked labels), DDP, 20 steps
  resume      20 steps saved every 10; then its step-10 checkpoint resumed to 20 in a new run dir
  sft_hf      a tiny local Hugging Face Llama and BPE tokenizer (made here with save_pretrained, seeded,
              into <out>/fixtures) on instruction data, ZeRO-2 fp32, 20 steps, every step logged, fp32 export
  resume_auto 20 steps whole, and 20 steps whose rank 1 is killed once step 10 is saved
              (ZEROTRAIN_INJECT_KILL, train/testhooks.py), relaunched in the same run dir with
              --checkpoint.resume auto; every step logged
  old_ckpt    (--resume-from) a checkpoint written by ANOTHER checkout resumed here to step 20

Kept per scenario: every metrics.jsonl row's losses and gradient norm exactly as written (the
JSON text of the number), the sha256 of every exported file and every checkpoint tensor
file, and of the generated inputs. Rows of timing (tokens/s, seconds) are left out: they differ
from run to run. --compare prints the first difference of each scenario and exits 1 on any; it
also checks that AFTER's resumes continued exactly (resume_auto, old_ckpt). Pass --fixtures
BEFORE/fixtures so both sides train on the same bytes (their hashes are compared anyway).

Nothing of zerotrain is imported here: the script works on any checkout. Run it with the
project's venv python: its `deepspeed` launcher runs the launches.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# The progress bar's switch moved from train. to logging. in zerotrain 0.2; this script runs any checkout.
QUIET_BAR = ["--logging.progress" if Path("train/config/moved.py").exists() else "--train.progress", "false"]

KEYS = ("loss", "val/loss", "grad_norm", "loss_scale", "skipped_steps", "samples_seen", "tokens_seen", "epoch")
FP32 = "ds_configs/zero2_fp32.json"
WORDS = ["alpha", "beta", "gamma", "delta", "zeta", "theta", "kappa", "sigma", "omega", "lambda"]


def _launch(out: Path, name: str, args: list[str], run: str | None = None, env: dict | None = None,
            expect_fail: bool = False) -> Path:
    run_dir = out / (run or name)
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
           str(29500 + random.Random(name).randint(1, 400)), "train/main.py", *args,
           "--train.run_dir", str(run_dir), *QUIET_BAR, "--logging.wandb.mode", "disabled"]
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env={**os.environ, **(env or {})})
    (out / f"{name}.log").write_text(r.stdout + r.stderr)
    if (r.returncode != 0) != expect_fail:
        sys.exit(f"{name}: exit {r.returncode}{' (a failure was expected)' if expect_fail else ''}; "
                 f"see {out / (name + '.log')}")
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
    """sha256 of every file under d (the export: weights, index, model config; the fixtures) and, for a safetensors
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
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    path = out / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": say(rng.randint(1, 5)), "response": say(rng.choice([1, 2, 3, 4]))})
                            + "\n" for _ in range(400)))
    return path


def _hf_fixtures(d: Path) -> None:
    """A tiny random Llama (seed 0) and a byte-level BPE tokenizer trained on fixed text, saved
    with save_pretrained into d/llama, and 400 seeded prompt/response records in d/sft_hf.jsonl
    (made as tests/helpers.py's save_tiny and make_tokenizer make theirs)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(200)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(str(d / "llama"))
    fast.save_pretrained(str(d / "llama"))
    say = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    (d / "sft_hf.jsonl").write_text("".join(
        json.dumps({"prompt": say(rng.randint(1, 6)), "response": say(rng.randint(1, 5))}) + "\n" for _ in range(400)))


def _fixtures(out: Path, given: Path | None) -> Path:
    """The generated inputs: copied from --fixtures (another run's, so both sides read the same
    bytes), else made here."""
    d = out / "fixtures"
    if d.exists():
        shutil.rmtree(d)
    if given:
        shutil.copytree(given, d)
    else:
        d.mkdir(parents=True)
        _hf_fixtures(d)
    return d


SCENARIOS = ("make_train", "zero3", "sft", "resume", "sft_hf", "resume_auto")
# The run dirs of a scenario's record: {sub-record ("" = the record itself): run dir name}.
RUN_DIRS = {"resume": {"whole": "resume_whole", "resumed": "resume"},
            "resume_auto": {"whole": "resume_auto_whole", "resumed": "resume_auto"}}


def run(out: Path, resume_from: str | None, only=SCENARIOS, fixtures: Path | None = None) -> dict:
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
    if "sft_hf" in only:
        fx = _fixtures(out, fixtures)
        d = _launch(out, "sft_hf", [
            "--model.name", f"hf:{fx / 'llama'}", "--data.kind", "sft", "--data.path", str(fx / "sft_hf.jsonl"),
            "--data.seq_len", "32", "--data.val_fraction", "0.1", "--train.micro_batch_size", "4",
            "--train.grad_accum_steps", "2", "--train.max_steps", "20", "--train.eval_every", "10",
            "--train.sample_tokens", "0", "--optim.lr", "5e-4", "--logging.every_steps", "1",
            "--checkpoint.every_steps", "10", "--checkpoint.export", "true", "--checkpoint.export_dtype", "fp32",
            "--ds-config", FP32], env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        res["sft_hf"] = {**_record(d, 20), "inputs": _hashes(fx)}
    if "resume_auto" in only:
        each = base + ["--train.max_steps", "20"]
        whole = _launch(out, "resume_auto_whole", each)
        killed = _launch(out, "resume_auto_killed", each, run="resume_auto", env={"ZEROTRAIN_INJECT_KILL": "1:10"},
                         expect_fail=True)
        saved = sorted(p.name for p in (killed / "checkpoints").glob("step_*"))
        if saved != ["step_00000010"]:
            sys.exit(f"resume_auto: the killed run left {saved}, not step_00000010 alone; "
                     f"see {out / 'resume_auto_killed.log'}")
        d = _launch(out, "resume_auto_relaunched", each + ["--checkpoint.resume", "auto"], run="resume_auto")
        res["resume_auto"] = {"whole": _record(whole, 20), "resumed": _record(d, 20)}
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


def _continued(whole: dict, resumed: dict) -> str | None:
    """The first difference between a resume from step 10 and the whole run: steps 11-20 and the step-20 tensors."""
    after10 = lambda m: {s: r for s, r in m.items() if int(s) > 10}  # noqa: E731
    return _first_diff(after10(whole["metrics"]), after10(resumed["metrics"])) or \
        _first_diff(whole["checkpoint"], resumed["checkpoint"])


def compare(before: Path, after: Path) -> int:
    """Losses, metrics and what every export and checkpoint file holds must be identical; the
    raw bytes of safetensors files are reported beside (see _hashes)."""
    a, b = json.loads(before.read_text()), json.loads(after.read_text())
    bad = 0
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            print(f"{name:11s} only in {'AFTER' if name not in a else 'BEFORE'}: not compared")
            continue
        (ka, ra), (kb, rb) = _split(a[name]), _split(b[name])
        d = _first_diff(ka, kb)
        same_bytes = [k for k in ra if rb.get(k) == ra[k]]
        print(f"{name:11s} {'identical' if d is None else 'DIFFERS: ' + d}  ({_logged(a[name])} logged rows; "
              f"safetensors files with the same bytes: {len(same_bytes)} of {len(ra)})")
        bad += d is not None
    if "old_ckpt" in b and "resume" in a:  # the old run's own continuation, against this checkout's resume of it
        d = _continued(a["resume"]["whole"], b["old_ckpt"])
        print(f"{'old_ckpt':11s} BEFORE's step-10 checkpoint resumed by AFTER, against BEFORE's own steps 11-20 "
              f"and its step-20 checkpoint tensors: {'identical' if d is None else 'DIFFERS: ' + d}")
        bad += d is not None
    if "resume_auto" in b:  # AFTER's own kill and --checkpoint.resume auto, against its whole run
        d = _continued(b["resume_auto"]["whole"], b["resume_auto"]["resumed"])
        print(f"{'resume_auto':11s} AFTER killed at step 10 and resumed with auto, against its whole run's steps "
              f"11-20 and step-20 checkpoint tensors: {'identical' if d is None else 'DIFFERS: ' + d}")
        bad += d is not None
    return 1 if bad else 0


def rehash(out: Path) -> None:
    """Recompute the hashes of an --out folder's runs into its same_run.json (after this script
    learnt a new one)."""
    path = out / "same_run.json"
    res = json.loads(path.read_text())
    for name, rec in res.items():
        for sub, run_dir in RUN_DIRS.get(name, {"": name}).items():
            r = rec[sub] if sub else rec
            r["export"] = _hashes(out / run_dir / "export")
        if name == "sft_hf":
            rec["inputs"] = _hashes(out / "fixtures")
    path.write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--resume-from", help="a checkpoint directory written by another checkout (old_ckpt)")
    p.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    p.add_argument("--rehash", type=Path, metavar="OUT", help="recompute the hashes of an --out folder")
    p.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios to (re)run into --out")
    p.add_argument("--fixtures", type=Path, help="another run's <out>/fixtures (sft_hf's inputs), used instead of new")
    a = p.parse_args(argv)
    if a.compare:
        return compare(*a.compare)
    if a.rehash:
        rehash(a.rehash.resolve())
        return 0
    if not a.out:
        p.error("--out or --compare")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path.cwd() / ".cache" / "torch_extensions"))
    unknown = set(a.only.split(",")) - set(SCENARIOS)
    if unknown:
        p.error(f"--only: no scenario {', '.join(sorted(unknown))} (there are {', '.join(SCENARIOS)})")
    run(a.out.resolve(), a.resume_from, a.only.split(","), a.fixtures.resolve() if a.fixtures else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
