#!/usr/bin/env bash
# The CUDA checks, for one GPU (an H200) with Python 3.12, torch, accelerate 1.15,
# transformers and safetensors but no DeepSpeed, no wandb and no network. ≤ 8 minutes.
#
#   bash bench/gpu_check.sh              # on the GPU machine, from the repository root
#   bash bench/gpu_check.sh --dry-run    # here, on CPU: everything shrunk, ~2 minutes
#
# Output: $OUT (default bench/results/gpu-<date>): one line per check on stdout and in
# checks.txt, `PASS name key=value ...` or `FAIL name ... -- why`, as soon as it is known;
# gpu_check.json (every figure, rewritten after each check), summary.md, logs/, runs/.
#
#   0. install  bench/wheels/*.whl (DeepSpeed and what it needs that the machine lacks; build
#               them with `bash bench/gpu_wheels.sh` on the dev machine, carry the git-ignored
#               folder) into $ZT_GPU_SITE (/tmp/site), offline; PYTHONPATH=repo:/tmp/site, so
#               the machine's own torch/accelerate/transformers are used, never shadowed.
#      env      versions, GPU, peak FLOP/s.
#   1. fp16_{ddp,zero0,zero1,zero2,zero3,fsdp2}  fp16 with dynamic loss scaling (DeepSpeed's
#               scaler, Accelerate's GradScaler for DDP, FSDP2's own on the global gradient norm:
#               not yet run on a GPU): the scale changes, an overflowing step is skipped
#               (skipped_steps > 0; the JSON starts at 2^24 so the first steps overflow), the
#               loss falls.
#      bf16_{ddp,zero0,...,zero3,fsdp2}, bf16_agree  the same small model, data and seed under each:
#               every run's loss falls, and the logged losses agree within 2% at every logged
#               step (bench/gpu_checks.py BF16_RTOL says why 2%).
#      (the small runs, up to ten at once on the one GPU (PAR): correctness, not speed)
#      ckpt_async  checkpoint.async (issue 39; not yet run on a GPU): the same small model, ZeRO-2
#               bf16, 1 process, 7 steps, a save every 2 written in the background (pinned buffers
#               reused, copies on a side stream); then a resume from step 4's save to step 7 and a
#               synchronous run of 7 steps. PASS: exit 0; saves 2, 4, 6 committed (`latest` = 6,
#               manifests verified); checkpoint/save_s (blocked, less any wait for the previous
#               write) < checkpoint/write_s at saves 4 and 6; the resumed run's first loss equal,
#               as written, to the async run's. The later resumed losses, the sync run's losses
#               and the step-6 files' sha256 against the sync run's are recorded (required in
#               --dry-run, where fp32 on CPU is deterministic).
#   2. mfu_trainer[_compiled]  GPT-2-124M (vocab 50304, 12 x 768, seq 1024) on a synthetic
#               token file, bf16, DDP, one GPU: the trainer's own MFU (metrics.jsonl) >= 50%;
#      mfu_independent[_compiled]  bench/gpu_mfu.py: the same model timed without the trainer.
#               (_compiled: hardware.compile / torch.compile; ZT_GPU_MFU_COMPILE=0 leaves them out.)
#   3. stage_<cfg>, plan_<cfg>  bench/stages.py --nproc 1 per config (ddp zero2 zero3 fsdp2 zero0
#               zero1): trainer vs the minimal deepspeed (FSDP2: fully_shard) loop (tokens/s ratio >= 0.97: the ≤ 3% overhead target), peak memory
#               vs the planner's peak.
#
# Overrides: ZT_GPU_BF16 / ZT_GPU_STAGES (config lists), ZT_GPU_SITE, ZT_GPU_DATA, PYTHON.
# Every launch has its own timeout, cut to what is left of the budget (ZT_GPU_BUDGET_S, 470 s
# from the start); a check that no longer fits is recorded as FAIL (skipped: budget).
# Exit status: 0 when every check passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-bench/results/gpu-$(date +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
LOGS=$OUT/logs RUNS=$OUT/runs CFGS=$OUT/configs
mkdir -p "$LOGS" "$RUNS" "$CFGS"
rm -f "$OUT/gpu_check.json" "$OUT/checks.txt"
export GPU_CHECK_JSON=$OUT/gpu_check.json
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONWARNINGS=ignore
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
T0=$(date +%s)

if [ $DRY = 1 ]; then
  PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
  export PATH=$(dirname "$PY"):$PATH   # the venv's ninja/torchrun, as the tests use
  # The GPU machine has no wandb: hide it here too (importlib finds nothing), so a run that
  # would import it fails the dry run as it would fail there.
  mkdir -p "$OUT/hide"
  cat > "$OUT/hide/sitecustomize.py" <<'PYEOF'
import importlib.machinery as _m
_find = _m.PathFinder.find_spec.__func__
def _hidden(cls, name, path=None, target=None):
    return None if name.split(".")[0] in ("wandb",) else _find(cls, name, path, target)
_m.PathFinder.find_spec = classmethod(_hidden)
PYEOF
  export PYTHONPATH=$PWD:$OUT/hide${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1
  BUDGET=${ZT_GPU_BUDGET_S:-420}
  PAR=2
else
  PY=${PYTHON:-python3}
  SITE=${ZT_GPU_SITE:-/tmp/site}
  export PYTHONPATH=$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}
  BUDGET=${ZT_GPU_BUDGET_S:-470}
  PAR=10
fi
CHK="$PY bench/gpu_checks.py"
DATA=${ZT_GPU_DATA:-${TMPDIR:-/tmp}/zt-gpu-check-$$}   # the synthetic token file: not in $OUT (8 MB)
[ -n "${ZT_GPU_DATA:-}" ] || trap 'rm -rf "$DATA"' EXIT
DEADLINE=$(( T0 + BUDGET ))
$CHK meta mode=$([ $DRY = 1 ] && echo dry-run || echo gpu) started="$(date '+%Y-%m-%d %H:%M:%S')" \
  out="$OUT" budget_s=$BUDGET git="$(git rev-parse --short HEAD 2>/dev/null || echo none)" > /dev/null

log() { echo "== $* ($(( $(date +%s) - T0 ))s)"; }

# limit SECS: SECS cut to the budget left (minus 10 s for the summary); status 1 when < 20 s are left.
limit() {
  local left=$(( DEADLINE - $(date +%s) - 10 ))
  [ "$left" -lt 20 ] && return 1
  echo $(( $1 < left ? $1 : left ))
}

# run NAME SECS CHECK CMD...: CMD with a timeout, output in logs/NAME.log; then `CHECK NAME`
# records the outcome, or a FAIL with the exit status and the log's error line.
run() {
  local name=$1 secs=$2 check=$3 lim rc=0; shift 3
  if ! lim=$(limit "$secs"); then
    $CHK record "$name" fail "skipped: the ${BUDGET}s budget is spent"; return 0
  fi
  timeout --kill-after=10 "$lim" "$@" > "$LOGS/$name.log" 2>&1 || rc=$?
  if [ "$rc" != 0 ]; then $CHK failed "$name" "$rc" "$lim" "$LOGS/$name.log"; else "$check" "$name"; fi
  return 0
}
# bg ...: `run ...` in the background, at most PAR at once.
bg() {
  while [ "$(jobs -rp | wc -l)" -ge "$PAR" ]; do wait -n; done
  run "$@" &
}

# ------------------------------------------------------------------------ 0. install, environment
if [ $DRY = 0 ]; then
  log install
  install() {
    ls bench/wheels/*.whl > /dev/null || { echo "bench/wheels/*.whl missing: run bash bench/gpu_wheels.sh" \
      "on the dev machine and carry bench/wheels"; return 3; }
    if $PY -m pip --version > /dev/null 2>&1; then
      $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        bench/wheels/*.whl
    else  # no pip: a wheel is a zip file; every carried one is purelib or a plain extension module
      $PY -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
        "$SITE" bench/wheels/*.whl
    fi
    $PY -c "import deepspeed, pydantic, hjson, cpuinfo, msgpack, einops; print('deepspeed', deepspeed.__version__)"
  }
  install_ok() { $CHK record "$1" pass "$(tail -n 1 "$LOGS/$1.log")" --figures "{\"site\": \"$SITE\", \
\"wheels\": \"$(cd bench/wheels && echo *.whl)\"}"; }
  export -f install; export PY SITE
  run install 150 install_ok bash -c install
  # Ten small runs share the GPU at once, unless it only takes one process at a time.
  if nvidia-smi --query-gpu=compute_mode --format=csv,noheader 2>/dev/null | grep -qi exclusive; then PAR=1; fi
fi
log env
if [ $DRY = 0 ]; then $CHK env --expect-cuda --site "$SITE"; else $CHK env --note "dry run: CPU, installed packages"; fi

# ------------------------------------------------------------------------ 1. fp16, bf16 correctness
log "fp16 and bf16 runs"
if [ $DRY = 0 ]; then
  SMALL=(--model.name gpt-tiny --model.d_model 256 --model.n_layer 4 --data.seq_len 128 --data.max_bytes 1000000
         --train.micro_batch_size 16 --train.max_steps 80 --optim.lr 1e-3 --optim.warmup_steps 10)
  EVERY=(--logging.every_steps 2) BF_EVERY=(--logging.every_steps 5) BF_PREC=bf16 BF_NOTE="" RUN_SECS=150
else
  SMALL=(--model.name gpt-tiny --data.seq_len 32 --data.max_bytes 200000 --train.micro_batch_size 8
         --train.max_steps 12 --optim.lr 3e-3 --optim.warmup_steps 3)
  EVERY=(--logging.every_steps 2) BF_EVERY=(--logging.every_steps 3) BF_PREC=fp32 RUN_SECS=150
  BF_NOTE="dry run: fp32 on CPU"
fi
QUIET=(--train.eval_every 0 --train.eval_batches 1 --train.sample_tokens 0 --logging.progress false
       --checkpoint.save_at_end false --checkpoint.export false)
FP16_CFGS="ddp zero0 zero1 zero2 zero3 fsdp2"
BF16_CFGS=${ZT_GPU_BF16:-"ddp zero0 zero1 zero2 zero3 fsdp2"}
[ $DRY = 1 ] && BF16_CFGS=${ZT_GPU_BF16:-"ddp zero0 zero3"}

check_fp16() { $CHK fp16 "$1" "$RUNS/$1"; }
check_bf16() { $CHK run "$1" "$RUNS/$1" --extra "{\"precision\": \"$BF_PREC\"}" --note "$BF_NOTE"; }
for cfg in $FP16_CFGS; do
  $CHK ds-json "ds_configs/$cfg.json" "$CFGS/${cfg}_fp16.json" --precision fp16 \
    --initial-scale-power 24 --loss-scale-window 20
done
for cfg in $BF16_CFGS; do
  $CHK ds-json "ds_configs/$cfg.json" "$CFGS/${cfg}_$BF_PREC.json" --precision $BF_PREC
done

if [ $DRY = 0 ]; then
  for cfg in $FP16_CFGS; do
    rm -rf "$RUNS/fp16_$cfg"
    bg "fp16_$cfg" $RUN_SECS check_fp16 $PY train/main.py --ds-config "$CFGS/${cfg}_fp16.json" "${SMALL[@]}" \
      "${EVERY[@]}" "${QUIET[@]}" --train.run_dir "$RUNS/fp16_$cfg"
  done
else
  # DeepSpeed (and zerotrain, for every backend) refuses fp16 on CPU: the fp16 JSONs go through zerotrain's own validation as on
  # a GPU (train/strategy/ds_config.load_ds_setup, cuda=True), and the checker reads synthetic metrics shaped like
  # DeepSpeed's (tests/test_gpu_check.py also feeds it a constant scale, which must FAIL).
  dry_fp16() {
    local cfg
    for cfg in $FP16_CFGS; do
      $CHK synth-fp16 "$RUNS/fp16_$cfg" && $CHK fp16 "fp16_$cfg" "$RUNS/fp16_$cfg" \
        --extra "{\"synthetic\": true, \"validated\": $(tail -n 1 "$LOGS/$1.log")}" \
        --note "dry run: synthetic metrics; configs/${cfg}_fp16.json validated as on a GPU"
    done
  }
  bg fp16_json 90 dry_fp16 $CHK validate-ds --cuda $(for c in $FP16_CFGS; do echo "$CFGS/${c}_fp16.json"; done) \
    -- "${SMALL[@]}"
fi
for cfg in $BF16_CFGS; do
  rm -rf "$RUNS/bf16_$cfg"
  bg "bf16_$cfg" $RUN_SECS check_bf16 $PY train/main.py --ds-config "$CFGS/${cfg}_$BF_PREC.json" "${SMALL[@]}" \
    "${BF_EVERY[@]}" "${QUIET[@]}" --train.run_dir "$RUNS/bf16_$cfg"
done
# checkpoint.async (issue 39): the small model under ZeRO-2, one process, a save every 2 steps
# written in the background (on CUDA: pinned buffers reused across saves, copies on a side
# stream; 7 steps, so that each save's write overlaps training); then a resume from step 4's
# save (written while steps 5-6 trained) and a synchronous run of the same length, side by side.
if [ $DRY = 0 ]; then
  CK=(--model.name gpt-tiny --model.d_model 256 --model.n_layer 4 --data.seq_len 128 --data.max_bytes 1000000
      --train.micro_batch_size 16 --optim.lr 1e-3 --optim.warmup_steps 2)
  CK_FLAGS=(--require-faster) CK_NOTE=""
else
  CK=(--model.name gpt-tiny --data.seq_len 32 --data.max_bytes 200000 --train.micro_batch_size 8 --optim.lr 3e-3
      --optim.warmup_steps 2)
  CK_FLAGS=(--strict-sync) CK_NOTE="dry run: fp32 on CPU, blocked vs write recorded, not compared"
fi
CK+=(--ds-config "$CFGS/ckpt_zero2_$BF_PREC.json" --train.max_steps 7 --logging.every_steps 1 "${QUIET[@]}"
     --checkpoint.keep_last 3)
$CHK ds-json ds_configs/zero2.json "$CFGS/ckpt_zero2_$BF_PREC.json" --precision $BF_PREC
ckpt_async_runs() {  # ckpt_async_runs TRAINER ARGS...: the async run, then the resume and the sync run at once
  local rc=0 pid
  rm -rf "$RUNS/ckpt_async" "$RUNS/ckpt_resume" "$RUNS/ckpt_sync"
  echo "== async run"
  $PY train/main.py "$@" --checkpoint.async true --checkpoint.every_steps 2 --train.run_dir "$RUNS/ckpt_async" \
    || return
  echo "== resume from step 4, and the synchronous run"
  $PY train/main.py "$@" --checkpoint.async true --checkpoint.every_steps 0 --train.run_dir "$RUNS/ckpt_resume" \
    --checkpoint.resume "$RUNS/ckpt_async/checkpoints/step_00000004" &
  pid=$!
  $PY train/main.py "$@" --checkpoint.async false --checkpoint.every_steps 2 --train.run_dir "$RUNS/ckpt_sync" \
    || rc=$?
  wait $pid || rc=$?
  return $rc
}
check_ckpt_async() {
  $CHK ckpt-async "$1" "$RUNS/ckpt_async" "$RUNS/ckpt_resume" "$RUNS/ckpt_sync" --steps 2,4,6 --resume-from 4 \
    "${CK_FLAGS[@]}" --note "$CK_NOTE"
}
export -f ckpt_async_runs; export PY RUNS
bg ckpt_async 240 check_ckpt_async bash -c 'ckpt_async_runs "$@"' ckpt_async_runs "${CK[@]}"
wait
$CHK agree bf16_agree $(for c in $BF16_CFGS; do echo "$c=$RUNS/bf16_$c"; done) --note "$BF_NOTE"

# ------------------------------------------------------------------------ 2. MFU, GPT-2-124M
log "MFU"
if [ $DRY = 0 ]; then
  VOCAB=50304 NTOK=4000000
  MFU_MODEL=(--model.name gpt2-124m --data.seq_len 1024 --train.micro_batch_size 32 --train.max_steps 50
             --logging.every_steps 10 --optim.warmup_steps 10)
  MFU_CHECK=(--model gpt2-124m --seq-len 1024 --skip-windows 2 --target 0.5)
  IND=(--preset gpt2-124m --seq-len 1024 --micro-batch 32 --steps 20 --warmup 5)
  MFU_TARGET=0.5 MFU_NOTE=""
else  # a tiny model on the same kind of token file; a made-up peak so that MFU is computed
  VOCAB=512 NTOK=200000 PEAK=2e11
  MFU_MODEL=(--model.name gpt-tiny --model.vocab_size 512 --data.seq_len 64 --train.micro_batch_size 4
             --train.max_steps 12 --logging.every_steps 3 --optim.warmup_steps 2 --logging.peak_flops $PEAK)
  MFU_CHECK=(--model gpt-tiny --overrides '{"vocab_size": 512}' --seq-len 64 --skip-windows 1 --target 0)
  IND=(--preset gpt-tiny --vocab-size 512 --seq-len 64 --micro-batch 4 --steps 4 --warmup 2 --device cpu
       --precision fp32 --peak-flops $PEAK)
  MFU_TARGET=0 MFU_NOTE="dry run: CPU with a made-up 2e11 FLOP/s peak, no target"
fi
$CHK tokens "$DATA/tokens.bin" --vocab $VOCAB --n $NTOK > "$LOGS/tokens.log" 2>&1 \
  || $CHK failed tokens $? 0 "$LOGS/tokens.log"
COMPILE=0
if [ $DRY = 0 ] && [ "${ZT_GPU_MFU_COMPILE:-1}" = 1 ] && $PY -c "import dataclasses, sys; from train.config import \
HardwareConfig as T; sys.exit(0 if 'compile' in {f.name for f in dataclasses.fields(T)} else 1)" 2>/dev/null; then
  COMPILE=1
fi
check_mfu() { $CHK mfu "$1" "$RUNS/$1" "${MFU_CHECK[@]}" --note "$MFU_NOTE"; }
mfu_run() {  # mfu_run NAME SECS EXTRA...
  local name=$1 secs=$2; shift 2
  rm -rf "$RUNS/$name"
  run "$name" "$secs" check_mfu $PY train/main.py --ds-config ds_configs/ddp.json "${MFU_MODEL[@]}" \
    --data.kind tokens --data.path "$DATA/tokens.bin" "${QUIET[@]}" --train.run_dir "$RUNS/$name" "$@"
}
mfu_run mfu_trainer 150
[ $COMPILE = 1 ] && mfu_run mfu_trainer_compiled 200 --hardware.compile true
check_ind() {
  $CHK mfu-independent "$1" "$OUT/gpu_mfu.json" --mode eager --target $MFU_TARGET --trainer-check mfu_trainer \
    --note "$MFU_NOTE"
  if [ $COMPILE = 1 ]; then
    $CHK mfu-independent "${1}_compiled" "$OUT/gpu_mfu.json" --mode compile --target $MFU_TARGET \
      --trainer-check mfu_trainer_compiled
  fi
}
run mfu_independent 200 check_ind $PY bench/gpu_mfu.py "${IND[@]}" \
  --modes "eager$([ $COMPILE = 1 ] && echo ,compile)" --out "$OUT/gpu_mfu.json"

# ------------------------------------------------------------------------ 3. stages: trainer vs minimal loop
log "stages"
if [ $DRY = 0 ]; then
  # GPT-2-124M's shape on byte-level text (vocab 256: 85M parameters), 1024-token sequences.
  STAGE_ARGS=(--model gpt2-124m --d-model 768 --n-layer 12 --seq-len 1024 --micro-batch 16 --max-bytes 4000000
              --steps 40 --warmup 10 --window 10 --precision json --plain-threads default)
  STAGE_CFGS=${ZT_GPU_STAGES:-"ddp zero2 zero3 fsdp2 zero0 zero1"} MIN_RATIO=0.97 STAGE_NOTE=""  # zero1 last: first cut
else
  STAGE_ARGS=(--quick --precision fp32 --plain-threads default)
  STAGE_CFGS=${ZT_GPU_STAGES:-"zero2"} MIN_RATIO=0.5 STAGE_NOTE="dry run: 2 shared CPU cores, ratio floor 0.5"
  # On CPU the peak is the rank's RSS (shared libraries included) and the planner counts what a
  # memory cgroup is charged for: not comparable, so no plan_* check (tests/test_gpu_check.py
  # runs the checker on a synthetic result).
fi
check_stage() {
  $CHK stage "$1" "$OUT/stages/${1#stage_}" --min-ratio $MIN_RATIO --note "$STAGE_NOTE"
  [ $DRY = 1 ] || $CHK plan "plan_${1#stage_}" "$OUT/stages/${1#stage_}"
}
# One process (--nproc 1): nothing oversubscribes the cores, so the plain loop's second arm
# (OMP_NUM_THREADS=1, for several ranks on a small CPU host) would only cost a launch.
for cfg in $STAGE_CFGS; do
  mkdir -p "$OUT/stages/$cfg"
  run "stage_$cfg" 150 check_stage $PY bench/stages.py --nproc 1 --configs "$cfg" "${STAGE_ARGS[@]}" \
    --timeout 70 --out "$OUT/stages/$cfg"
done

# ------------------------------------------------------------------------ summary
$CHK meta finished="$(date '+%Y-%m-%d %H:%M:%S')" elapsed_s=$(( $(date +%s) - T0 )) > /dev/null
$CHK summary "$OUT" > /dev/null
failed=$(grep -c '^FAIL' "$OUT/checks.txt")
echo "gpu_check: $(grep -c '^PASS' "$OUT/checks.txt") passed, $failed failed in $(( $(date +%s) - T0 ))s;" \
  "results in $OUT (gpu_check.json, summary.md, logs/)"
[ "$failed" = 0 ]
