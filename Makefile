# One venv for everything; `make test` and `make demo` set it up on a fresh machine.
PYTHON ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow lint format bench ci clean constraints

setup: $(VENV)/.installed

$(VENV)/.installed: setup.py constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU build of torch first, so nothing below pulls a CUDA wheel
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -c constraints.txt -e ".[test,jetstream]"
	# google-jetstream's own pins pull TensorFlow and an old jax: its code only
	$(BIN)/pip install -q --no-deps -c constraints.txt "google-jetstream==0.2.2"
	touch $@

# the README's first command: the embedded default run (configs/default.yaml), report included
demo: setup
	$(BIN)/magic-jax train

test: setup
	$(BIN)/pytest -q $(PYTEST_ARGS)

# pytest exits 5 when no test carries the mark: not a failure
test-slow: setup
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS) || [ $$? -eq 5 ]

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

bench: setup
	$(BIN)/python benchmarks/loss_memory.py
	$(BIN)/python benchmarks/rollout.py
	$(BIN)/python benchmarks/verify.py

ci: lint test test-slow

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache

constraints: setup
	(echo "# Versions CI installs (pip install -c constraints.txt). Regenerate with: make constraints"; \
	 $(BIN)/pip freeze --exclude-editable | grep -viE "^(torch|magic-jax|magic_jax|google-jetstream)=") > constraints.txt
