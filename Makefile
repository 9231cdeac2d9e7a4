# make train: set up .venv from pyproject.toml and run the default job. make test: set up and test.
# (make test prints its 15 slowest tests; ARGS add to or override pytest's options, e.g. ARGS="-m 'not slow'".)
# make lint: ruff (lint + format check) and mypy, as CI runs them. make format: apply ruff's fixes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test lint format clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

train: $(VENV)/.installed
	$(PY) src/train.py $(ARGS)

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest --durations=15 $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) outputs multirun
