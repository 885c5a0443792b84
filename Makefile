# zerotrain: `make train` and `make test` do all set-up on a fresh machine.
# Both create .venv if missing, install the project editable, and are quick when
# nothing changed (a stamp file tracks pyproject.toml).

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
# The exact torch pair this project is tested with (taken from the local wheel
# cache where the machine has one). Override e.g. TORCH_SPEC="torch torchvision".
TORCH_SPEC  ?= torch==2.14.1 torchvision==0.29.1
# DeepSpeed JIT-builds its CPU comm op once; keep it inside the project so every
# rank, every launcher and every venv on this checkout share one build.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
STAMP       := $(VENV)/.zerotrain-installed
# All GPUs on a GPU machine, else 2 CPU processes.
NPROC       ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU' | sed 's/^0$$/2/' || echo 2)
RUN         ?= examples/default.yaml
# bf16 on GPUs. A CPU has no bf16 matmul units here: emulated bf16 trains the default ~7x
# slower than fp32 (measured, BENCHMARKS.md), so CPU-only machines train it in fp32.
# Force either with DS_CONFIG=ds_configs/<file>.json.
HAS_GPU     := $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo yes)
DS_CONFIG   ?= $(if $(HAS_GPU),ds_configs/zero2.json,ds_configs/zero2_fp32.json)
PYTEST_ARGS ?=
# Serial by default: on 2 cores 2 pytest-xdist workers were slower (measured, docs/machine_notes.md); with more
# cores: XDIST="-n 4 --dist loadgroup" (a test module per worker at a time, tests/conftest.py).
XDIST       ?=

.PHONY: install ops train test test-all test-fast bench clean help

help:
	@echo "make train   # create .venv, install, train the default byte-level GPT ($(DS_CONFIG), $(NPROC) procs)"
	@echo "make test    # create .venv, install, run the quick tier (in-process tests + the launches in tests/conftest.py QUICK_TIER)"
	@echo "make test-all  # everything (what CI runs)"
	@echo "make bench   # stage benchmark (writes bench/results/*.json, see BENCHMARKS.md)"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	@$(PY) -m pip install -q -e '.[test]'
	@touch $@

install: $(STAMP)

# DeepSpeed's JIT ops (CPU comm op on CPU machines, CPU Adam for offload), built once.
ops: $(STAMP)
	@$(PY) -m zerotrain.train.commands.prebuild

train: ops
	$(VENV)/bin/deepspeed --num_gpus $(NPROC) train/main.py --config $(RUN) --ds-config $(DS_CONFIG)

# The quick tier: every in-process test and the launches tests/conftest.py QUICK_TIER lists.
test: ops
	$(PY) -m pytest $(XDIST) -m "not full" $(PYTEST_ARGS)

# Every test (CI): the quick tier plus every launch marked `full`.
test-all: ops
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

test-fast: ops
	$(PY) -m pytest $(XDIST) -m "not multiproc and not multinode and not soak" $(PYTEST_ARGS)

bench: ops
	$(PY) bench/stages.py

clean:
	rm -rf runs .pytest_cache
