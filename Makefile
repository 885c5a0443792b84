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
SHM_OP      := $(TORCH_EXTENSIONS_DIR)/deepspeed_shm_comm/deepspeed_shm_comm.so
# All GPUs on a GPU machine, else 2 CPU processes.
NPROC       ?= $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU' | sed 's/^0$$/2/' || echo 2)
RUN         ?= examples/default.yaml
DS_CONFIG   ?= ds_configs/zero2.json
PYTEST_ARGS ?=

.PHONY: install ops train test test-fast bench clean help

help:
	@echo "make train   # create .venv, install, train the default byte-level GPT (ZeRO-2, $(NPROC) procs)"
	@echo "make test    # create .venv, install, run the whole test suite"
	@echo "make bench   # stage benchmark (writes bench/results/*.json, see BENCHMARKS.md)"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install -q --upgrade pip
	@$(PY) -c "import torch, torchvision" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	@$(PY) -m pip install -q -e '.[test]'
	@touch $@

install: $(STAMP)

# No-op on GPU machines (NCCL needs no build); ~1.5-3 min once on a 2-core CPU box.
$(SHM_OP): | $(STAMP)
	@if $(PY) -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
	  echo "CUDA present: DeepSpeed's CPU comm op not needed"; \
	else \
	  echo "Building DeepSpeed's CPU shm comm op into $(TORCH_EXTENSIONS_DIR) (once)..."; \
	  $(PY) -c "from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()" >/dev/null 2>&1 \
	    || { echo "building DeepSpeed's shm comm op failed; rerun: $(PY) -c \"from deepspeed.accelerator import get_accelerator as g; g().create_op_builder('ShareMemCommBuilder').load()\""; exit 1; }; \
	fi

ops: $(STAMP) $(SHM_OP)

train: ops
	$(VENV)/bin/deepspeed --num_gpus $(NPROC) train/main.py --config $(RUN) --ds-config $(DS_CONFIG)

test: ops
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: ops
	$(PY) -m pytest -m "not multiproc and not multinode and not soak" $(PYTEST_ARGS)

bench: ops
	$(PY) bench/stages.py

clean:
	rm -rf runs .pytest_cache
