# One virtualenv per checkout; torch is pinned first to the CPU wheel so setup never pulls a CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0

.PHONY: venv ops lint smoke test bench clean

# Compat editable mode: the repo root goes on sys.path (a .pth file), so `python -m training.<tool>` run from a
# directory with its own data/ or model/ folder still imports this project's packages, not that folder.
$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]" --config-settings editable_mode=compat
	$(MAKE) --no-print-directory ops
	touch $@

# DeepSpeed's CPU Adam (the optimizer of deepspeed=*_offload) is a C++ op compiled on first use (~90 CPU-s, cached
# under ~/.cache/torch_extensions): built once here, as DS_BUILD_CPU_ADAM=1 would at install, so no job stalls on it.
# With the virtualenv's bin first on PATH, as the launch scripts and the tests run jobs: torch builds with the first
# `ninja` on PATH, and a build by another ninja version (the system's 1.11 vs the venv's 1.13) reads as stale and is
# rebuilt. Without a compiler the first offload job builds (and reports) it instead.
ops:
	PATH="$(CURDIR)/$(BIN):$$PATH" DS_ACCELERATOR=cpu $(BIN)/python -c "from deepspeed.accelerator import get_accelerator as a; \
	a().create_op_builder('CPUAdamBuilder').load()" >/dev/null 2>&1 || echo "warning: could not build DeepSpeed's CPU Adam now"

venv: $(BIN)/.installed

smoke: venv
	bash launch/smoke.sh $(ARGS)

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: venv lint
	DS_ACCELERATOR=cpu $(BIN)/python -m pytest

bench: venv
	$(BIN)/python -m bench.kda

clean:
	rm -rf $(VENV)
