#!/usr/bin/env bash
# The CUDA-only checks, prepared for a single-GPU machine that has python + torch,
# accelerate, transformers and safetensors but no deepspeed (and no network):
#
#   1. install the carried wheels (bench/wheels/: deepspeed, pydantic, hjson, ... built on the
#      dev machine) and the project, all with --no-index --no-deps;
#   2. fp16 with dynamic loss scaling under ZeRO-2 and DDP (the loss scale must be logged);
#   3. bf16 under DDP and ZeRO-0/2/3 on a GPT-2-124M-class model: tokens/s, MFU, trainer
#      overhead vs the minimal deepspeed.initialize loop, model-state bytes vs the planner
#      (bench/stages.py --nproc 1);
#   4. a results table in $OUT/summary.md (+ one log per step in $OUT/logs/).
#
#   OUT=/some/dir bash bench/gpu_check.sh        # from the repository root; ~5-7 minutes
#
# Every step has its own timeout and log; a failing step is recorded and the next one runs.
# bench/wheels/ must travel with the tree (it is git-ignored: pass it in the device tool's
# `carry`). Rebuild it on the dev machine with the command in BENCHMARKS.md (GPU section).
set -euo pipefail

OUT=${OUT:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
LOGS=$OUT/logs
mkdir -p "$LOGS"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
STATUS=$OUT/steps.tsv
: > "$STATUS"
T0=$(date +%s)

# step NAME SECONDS CMD...: run with a timeout, log to $LOGS/NAME.log, record ok/FAIL and time.
step() {
  local name=$1 secs=$2; shift 2
  local t=$(date +%s) rc=0
  echo "== $name (limit ${secs}s, $(( t - T0 ))s elapsed)"
  timeout --kill-after=15 "$secs" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t ))
  if [ "$rc" = 0 ]; then
    printf '%s\tok\t%ss\n' "$name" "$dt" >> "$STATUS"
  else
    printf '%s\tFAIL (exit %s%s)\t%ss\n' "$name" "$rc" "$([ "$rc" = 124 ] && echo ', timeout')" "$dt" >> "$STATUS"
    echo "   FAILED ($rc); last lines of $LOGS/$name.log:"; tail -n 15 "$LOGS/$name.log" | sed 's/^/   | /'
  fi
  return 0
}

# ---------------------------------------------------------------- 0. what machine is this
step env 60 bash -c "nvidia-smi; $PY -V; $PY -c 'import torch, accelerate, transformers, safetensors;
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.get_device_name(0));
print(\"accelerate\", accelerate.__version__, \"transformers\", transformers.__version__)'; nproc; free -g"

# ---------------------------------------------------------------- 1. install, offline
install() {
  ls bench/wheels/*.whl > /dev/null
  local pipi="$PY -m pip install --no-index --no-deps --find-links bench/wheels"
  # Only what is missing or too old; never touch torch/transformers.
  $pipi "setuptools>=68" "typing_extensions>=4.16" "annotated-types>=0.6" "typing-inspection>=0.4.4" \
        "pydantic==2.14.4" "pydantic-core==2.50.5" hjson py-cpuinfo einops msgpack ninja psutil
  $PY -c "import accelerate, sys; sys.exit(0 if accelerate.__version__.startswith('1.15') else 1)" \
    || $pipi "accelerate==1.15.0"
  $pipi "deepspeed==0.19.8"
  $PY -m pip install --no-index --no-deps --no-build-isolation -e .
  $PY -c "import deepspeed, train.plan; print('deepspeed', deepspeed.__version__)"
}
if [ "${ZT_GPU_CHECK_INSTALL:-1}" = 1 ]; then step install 240 install; fi

# ---------------------------------------------------------------- helpers (python, written once)
cat > "$OUT/fp16_json.py" <<'PYEOF'
# ds_configs/<name>.json with fp16 (dynamic loss scaling) instead of bf16 -> argv[2]
import json, sys
d = json.load(open(sys.argv[1]))
d["bf16"] = {"enabled": False}
d.pop("data_types", None)  # fp32 gradient accumulation is the bf16 files' setting
d["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 100,
             "hysteresis": 2, "min_loss_scale": 1}
json.dump(d, open(sys.argv[2], "w"), indent=1)
PYEOF
cat > "$OUT/check_fp16.py" <<'PYEOF'
# argv[1] = run dir: the loss fell and a loss scale was logged at every interval
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if l.strip()]
train = [r for r in rows if "loss" in r and "final/loss" not in r]
scales = [r.get("loss_scale") for r in train]
print("losses", [round(r["loss"], 3) for r in train])
print("loss_scale", scales, "skipped_steps", train[-1].get("skipped_steps") if train else None)
assert train, "no training rows in metrics.jsonl"
assert all(isinstance(s, (int, float)) and s >= 1 for s in scales), "loss_scale missing from metrics.jsonl"
assert train[-1]["loss"] < train[0]["loss"] - 0.5, "fp16 loss did not fall"
print("fp16 check passed")
PYEOF
cat > "$OUT/summary.py" <<'PYEOF'
import glob, json, sys
out = sys.argv[1]
lines = ["# zerotrain GPU check", "", "## Steps", "", "| step | result | time |", "|---|---|---|"]
lines += ["| " + " | ".join(l.rstrip("\n").split("\t")) + " |" for l in open(out + "/steps.tsv")]
for name in ("fp16_zero2", "fp16_ddp"):
    try:
        lines += ["", f"## {name}", "", "```", open(f"{out}/logs/{name}.log").read()[-1500:], "```"]
    except OSError:
        pass
for f in sorted(glob.glob(out + "/stages-*.json")):
    d = json.load(open(f))
    lines += ["", "## bf16 stages (bench/stages.py)", "", open(f[:-5] + ".md").read(), "",
              "| config | MFU (trainer) | first -> last loss |", "|---|---:|---|"]
    for r in d["results"]:
        t = r["trainer"][-1]
        mfu = f"{t['mfu']:.1%}" if t.get("mfu") is not None else "-"
        lines.append(f"| {r['config']} | {mfu} | {t['first_loss']:.3f} -> {t['last_loss']:.3f} |")
open(out + "/summary.md", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF

# ---------------------------------------------------------------- 2. fp16 with loss scaling
# The CPU machine refuses fp16, so this is its only test: ZeRO-2 (DeepSpeed's loss scaler)
# and DDP (Accelerate's GradScaler).
TINY="--model.name gpt-tiny --model.d_model 128 --data.seq_len 64 --data.max_bytes 400000 \
  --train.micro_batch_size 16 --train.max_steps 60 --logging.every_steps 5 --optim.lr 3e-3 \
  --optim.warmup_steps 5 --train.eval_every 0 --train.sample_tokens 0 --train.progress false \
  --checkpoint.save_at_end false --checkpoint.export false"
for cfg in zero2 ddp; do
  $PY "$OUT/fp16_json.py" "ds_configs/$cfg.json" "$OUT/${cfg}_fp16.json"
  step "fp16_$cfg" 150 bash -c "$PY train/main.py --ds-config $OUT/${cfg}_fp16.json $TINY \
    --train.run_dir $OUT/runs/fp16_$cfg && $PY $OUT/check_fp16.py $OUT/runs/fp16_$cfg"
done

# ---------------------------------------------------------------- 3. bf16 stages: speed, MFU, memory
# GPT-2-124M shape (12 x 768, vocab 50304) on byte-level text, 1024-token sequences; each
# config runs the trainer and the minimal deepspeed.initialize loop (trainer overhead).
# (ZT_GPU_CHECK_* override the model / configs / precision for a CPU smoke run of this script.)
BENCH_MODEL=${ZT_GPU_CHECK_BENCH_ARGS:-"--model gpt2-124m --d-model 768 --n-layer 12 --seq-len 1024 \
  --micro-batch 16 --max-bytes 4000000 --steps 40 --warmup 10 --window 10"}
# shellcheck disable=SC2086  # BENCH_MODEL is a list of arguments
step bench_bf16 330 $PY bench/stages.py --nproc 1 --precision "${ZT_GPU_CHECK_PRECISION:-json}" \
  --configs "${ZT_GPU_CHECK_CONFIGS:-ddp,zero0,zero2,zero3}" $BENCH_MODEL --timeout 150 --out "$OUT"

# ---------------------------------------------------------------- 4. summary
step summary 60 $PY "$OUT/summary.py" "$OUT"
cat "$OUT/summary.md" 2>/dev/null || cat "$STATUS"
echo "gpu_check: $(( $(date +%s) - T0 ))s; results in $OUT"
