# The README's two commands: `make serve` (set up and serve the default model) and `make test`.
# The default model lives in the model cache ($TINYPAGED_HOME, else $XDG_CACHE_HOME/tinypaged, else
# ~/.cache/tinypaged), never in the tree.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: setup setup-test weights serve generate test lint loadtest clean

# Serving's install: the runtime dependencies alone (`make serve`, `generate`, `weights`). The test extras
# (transformers, playwright, locust, ...) go on top only for the targets that need them, each install once
# and again when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e .
	touch $@

# The test extras and Ray Serve (the `ray` extra: tests/replicas/ start Ray on the CPU).
$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[test,ray]'
	touch $@

setup: $(VENV)/.installed

setup-test: $(VENV)/.installed-test

# Phony: the model's `.complete` marker is outside the tree; the fetch itself is idempotent and quick when done.
weights: setup
	$(VENV)/bin/tinypaged weights fetch

serve: setup weights
	$(VENV)/bin/tinypaged serve

generate: setup weights
	$(VENV)/bin/tinypaged generate "The capital of France is"

# Two pytest processes: the kernel tests need TRITON_INTERPRET=1 set before triton is imported, and the
# engine tests must not run the whole model through the interpreter. (`pytest`, not `python -m pytest`:
# the latter puts the repo root on sys.path, where HF transformers would mistake kernels/ for its kernel hub.)
# Each prints its slowest tests, and each part's time against its budget (docs/testing.md): the second merges
# the first's test-budget.json and judges the whole suite.
test: setup-test weights
	rm -f test-budget.json
	$(VENV)/bin/pytest -q --durations=15 --budget-json=test-budget.json tests --ignore=tests/kernels
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q --durations=5 --budget-json=test-budget.json tests/kernels

# A short headless locust run (both user classes, 30 s) against a local server on the default model.
loadtest: setup-test weights
	$(PY) loadtest/local_server.py --max-model-len 1024 -- $(VENV)/bin/locust -f loadtest/locustfile.py \
		--headless --users 4 --spawn-rate 4 --run-time 30s --only-summary --prompt-len 16-128 --output-len 16-64

lint: setup-test
	$(VENV)/bin/ruff check tinypaged kernels weights tests benchmarks loadtest
	$(VENV)/bin/ruff format --check tinypaged kernels weights tests benchmarks loadtest

# Leaves the model cache alone: every checkout and installed copy shares it.
clean:
	rm -rf $(VENV)
