# The README's two commands: `make serve` (set up and serve the default model) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODEL := weights/smollm2-135m-instruct

.PHONY: setup weights serve generate test lint bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

setup: $(VENV)/.installed

$(MODEL)/model.safetensors: | $(VENV)/.installed
	$(VENV)/bin/tinypaged weights fetch

weights: $(MODEL)/model.safetensors

serve: setup weights
	$(VENV)/bin/tinypaged serve --model $(MODEL)

generate: setup weights
	$(VENV)/bin/tinypaged generate --model $(MODEL) "The capital of France is"

test: setup weights
	$(PY) -m pytest -q tests

lint: setup
	$(VENV)/bin/ruff check tinypaged kernels weights tests benchmarks

clean:
	rm -rf $(VENV) $(MODEL)
