#!/usr/bin/env bash
# Build bench/wheels/: the wheels bench/gpu_check.sh installs, offline, on a GPU machine that
# has Python 3.12 with torch, accelerate 1.15, transformers, safetensors, numpy, pyyaml, tqdm
# and packaging, but no DeepSpeed (and no network). Run on the dev machine (needs the package
# registry), from the repository root:
#
#   bash bench/gpu_wheels.sh            # -> bench/wheels/*.whl (git-ignored): 12 wheels, 5.7 MiB
#
# Carried: DeepSpeed (its sdist, built here into a py3-none-any wheel; its CUDA ops are
# JIT-built on first use, and zerotrain uses none of them on a GPU: torch AdamW, NCCL) and the
# packages it needs that such a machine lacks. Never torch/accelerate/transformers: installed
# with `pip install --target`, a carried copy would shadow the machine's own build.
# Compiled wheels (pydantic-core, msgpack, ninja, psutil) are the CPython 3.12 manylinux
# x86_64 builds, whatever Python runs this script. Versions = what .venv runs and is tested
# with; one version of each package (stale files are removed).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=bench/wheels
PY=${PYTHON:-.venv/bin/python}
DEEPSPEED=deepspeed==0.19.8
# pure Python or cp312 manylinux wheels from the registry
PINS=(
  hjson==3.1.0 py-cpuinfo==9.0.0 einops==0.8.2 msgpack==1.2.4 ninja==1.13.2 psutil==7.2.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
)
PLAT=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)

mkdir -p "$DEST"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1

# 1. the registry's wheels, for CPython 3.12 on manylinux x86_64
for spec in "${PINS[@]}"; do
  $PY -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$DEST" "$spec"
done

# 2. DeepSpeed: a wheel if the registry has one, else its sdist built into a pure-Python wheel
if ! ls "$DEST"/deepspeed-${DEEPSPEED#*==}-*.whl > /dev/null 2>&1; then
  $PY -m pip download -q --no-deps --only-binary=:all: "${PLAT[@]}" -d "$DEST" "$DEEPSPEED" 2>/dev/null \
    || DS_BUILD_OPS=0 $PY -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$DEEPSPEED"
fi

# 3. one version of each package: drop wheels of a package whose version is not pinned above
keep=("$DEEPSPEED" "${PINS[@]}")
$PY - "$DEST" "${keep[@]}" <<'PYEOF'
import re, sys
from pathlib import Path
dest, pins = Path(sys.argv[1]), sys.argv[2:]
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
want = {norm(p.split("==")[0]): p.split("==")[1] for p in pins}
bad = []
for w in sorted(dest.glob("*.whl")):
    name, version = w.name.split("-")[:2]
    if want.get(norm(name)) != version:
        w.unlink()
        print(f"gpu_wheels: removed {w.name} (not a pinned version)")
    elif not any(t in w.name for t in ("-py3-none-", "-cp312-", "-abi3-")):  # pure, or built for 3.12
        bad.append(w.name)
have = {norm(w.name.split("-")[0]) for w in dest.glob("*.whl")}
missing = sorted(set(want) - have)
if bad or missing:
    sys.exit(f"gpu_wheels: wrong wheels {bad} / missing {missing}")
PYEOF

ls -l "$DEST"/*.whl | awk '{printf "%8.0f KiB  %s\n", $5 / 1024, $NF}'
total=$(du -cb "$DEST"/*.whl | tail -n 1 | cut -f1)
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $(( total / 1024 )) KiB in $DEST"
if [ "$total" -gt $(( 64 * 1024 * 1024 )) ]; then
  echo "gpu_wheels: over the 64 MiB the device tool carries" >&2; exit 1
fi
