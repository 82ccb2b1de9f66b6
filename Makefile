# Two commands work on a fresh machine from nothing: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tightfit-installed
# Where pip finds torch. Empty: the machine's configured index (this project's CI machine
# serves a CPU build from local disk; PyPI's Linux wheel of the pinned version is the CUDA
# build). A CPU-only machine on PyPI passes PyTorch's CPU index, e.g.
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_INDEX ?=

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, at the pinned version, from TORCH_INDEX when given (see above)
	$(PY) -m pip install -q -c requirements/constraints.txt $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) torch
	$(PY) -m pip install -q -c requirements/constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: setup
	$(VENV)/bin/tightfit train

test: setup
	$(PY) -m ruff check tightfit tests benchmarks
	$(PY) -m pytest -q

lint: setup
	$(PY) -m ruff check tightfit tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
