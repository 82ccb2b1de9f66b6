# Two commands work on a fresh machine from nothing: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tightfit-installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	# torch first and pinned: a bare `torch` would pull a CUDA build of several GB.
	$(PY) -m pip install -q -c requirements/constraints.txt torch
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
