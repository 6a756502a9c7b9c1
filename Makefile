# One venv for everything; `make test` and `make demo` set it up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow test-tpu gpu-test lint format bench ci clean constraints ablations campaign

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, so nothing below pulls a CUDA wheel
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -c constraints.txt -e ".[train,test,jetstream]"
	# google-jetstream's own pins pull TensorFlow and an old jax: its code only
	$(BIN)/pip install -q --no-deps -c constraints.txt "google-jetstream==0.2.2"
	touch $@

# the README's first command: the embedded default run (configs/default.yaml), report included
demo: setup
	$(BIN)/magic-jax train

# The default suite in parallel (pytest-xdist, up to 4 workers), then the tests marked
# `serial` (sandbox limits, process checks) alone; pytest exits 5 when a selection holds no test.
test: setup
	$(BIN)/pytest -q -n auto --maxprocesses=4 -m "not slow and not heavy and not serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/pytest -q -m "serial and not slow and not heavy" $(PYTEST_ARGS) || [ $$? -eq 5 ]

# The `heavy` tests (default-suite tests of 10 s or more) in parallel as `make test` would run
# them, then the `slow` ones two at a time (a file's tests on one worker, so its fixtures run
# once), with the 25 longest named (what CI's time goes to), then the slow `serial` ones alone;
# pytest exits 5 when no test carries the mark: not a failure
test-slow: setup
	$(BIN)/pytest -q -n auto --maxprocesses=4 -m "heavy and not slow" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	MAGIC_JAX_TEST_FAST_COMPILE=0 $(BIN)/pytest -q -n 2 --dist loadfile -m "slow and not serial" \
	  --durations=25 $(PYTEST_ARGS) || [ $$? -eq 5 ]
	MAGIC_JAX_TEST_FAST_COMPILE=0 $(BIN)/pytest -q -m "slow and serial" $(PYTEST_ARGS) || [ $$? -eq 5 ]

# `magic-jax plan` compiles for TPU slices here through libtpu; jax[tpu] lives in its own
# venv so that .venv stays the CPU build.
TPU_VENV ?= .venv-tpu

$(TPU_VENV)/.installed: setup.py constraints.txt
	$(PYTHON) -m venv $(TPU_VENV)
	$(TPU_VENV)/bin/pip install -q --upgrade pip
	$(TPU_VENV)/bin/pip install -q -c constraints.txt -e ".[tpu]" pytest
	touch $@

test-tpu: $(TPU_VENV)/.installed
	$(TPU_VENV)/bin/pytest -q tests/plan_test.py tests/tpu_decode_test.py tests/tpu_update_test.py $(PYTEST_ARGS)

# The GPU tests, in an existing environment that has jax[cuda] (a GPU image may bring
# its own Python and jax, lack grain / tensorflow-datasets / math-verify, and have no
# network): the package goes in without its dependencies and without build isolation.
GPU_PYTHON ?= python3
gpu-test:
	$(GPU_PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	JAX_PLATFORMS=cuda,cpu $(GPU_PYTHON) -m pytest -q -m gpu tests/gpu_test.py $(PYTEST_ARGS)

# The runs behind notebooks/: every missing (ablation arm, seed), resumable, about 1.5 min per
# default-world run and 3-4 min per carry-world run on 2 cores; then notebooks/figures/ (one PNG
# per ablation and summary.md).
ablations: setup
	$(BIN)/python -m magic_jax.experiments.ablations run
	$(BIN)/python -m magic_jax.experiments.ablations figures

# The fault campaign (tests/campaign.py): the tiny run on a flaky bucket (the GCS emulator
# behind tests/faultproxy.py, 5% of requests failing), killed 10 times per seed at random
# points and resumed, then compared with a clean run; ~8 min per seed on 2 cores.
CAMPAIGN_ARGS ?= --seeds 0-4 --kills 10
campaign: setup
	$(BIN)/python tests/campaign.py $(CAMPAIGN_ARGS)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python benchmarks/loss_memory.py
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/verify.py
	$(BIN)/python benchmarks/product_floor.py

ci: lint test test-slow test-tpu

clean:
	rm -rf $(VENV) $(TPU_VENV) build *.egg-info .pytest_cache .ruff_cache .mypy_cache

constraints: setup
	(echo "# Versions CI installs (pip install -c constraints.txt). Regenerate with: make constraints"; \
	 $(BIN)/pip freeze --exclude-editable | grep -viE "^(torch|magic-jax|magic_jax|google-jetstream)=") > constraints.txt
