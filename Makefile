# Quick start: `make quickstart` (set up + main job on the shipped reference pair), `make test` (set up + tests).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup quickstart lint test test-fast interop mlx-check clean

$(BIN)/dflash-quant: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch 2.13 is the one served fastest on these machines; a CUDA build also works.
	$(BIN)/pip install -q "torch==2.13.0" || $(BIN)/pip install -q "torch>=2.13,<2.15"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

setup: $(BIN)/dflash-quant

quickstart: setup
	$(BIN)/dflash-quant gptq --bits 4 --output out/reference-int4 --overwrite

LINT_PATHS := dflash_quant tests benchmarks scripts

lint: setup
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)
	$(BIN)/mypy dflash_quant
	$(BIN)/lint-imports  # the layer contract in pyproject.toml: an import from a higher layer fails here

# Two workers: the suite is one core's worth of CLI runs and tiny models (OMP_NUM_THREADS=1), so two cores halve it.
# --dist loadfile: a module's tests run on one worker, so its module-scoped fixtures (CLI runs building artifacts)
# are built once, not once per worker (xdist's xdist_group marks do nothing under pytest 9: they rename nodeids
# through an attribute pytest 9 no longer reads).
# The 15 slowest tests are listed at the end: the suite must stay under ~15 minutes on 2 cores.
test: setup lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15

test-fast: setup
	$(BIN)/python -m pytest -q -n 2 -m "not slow and not gpu and not interop and not mlx"

# GPTQModel cross-check in its own environment (heavy; needs torch>=2.14.1).
interop:
	bash scripts/interop_env.sh

# Our MLX export read back by mlx[cpu] itself, in .venv-mlx (MLX_VENV=... to place it elsewhere).
mlx-check:
	bash scripts/mlx_env.sh

clean:
	rm -rf $(VENV) out
