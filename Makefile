# make train: set up .venv from pyproject.toml (torch and torchvision at the tested versions of constraints.txt)
# and run the default job. make test: set up and test.
# (make test runs the test files on TEST_WORKERS pytest-xdist workers, 2 by default: a test waits on its processes'
# start-up and rendezvous much of the time, so two at once fill two cores; TEST_WORKERS=0 runs them one by one.
# It prints the 15 slowest tests; ARGS add to or override pytest's options, e.g. ARGS="-m 'not slow'".)
# make lint: ruff (lint + format check) and mypy, as CI runs them. make format: apply ruff's fixes.
# make wheelhouse: on a machine with internet, wheels of every dependency but torch for an air-gapped GPU node with
# its own torch (docs/gpu.md): PYVER (the node's Python), PLATFORM, WHEELS (the dir), FREEZE (the node's pip freeze).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TEST_WORKERS ?= 2
PYVER ?= 3.12
PLATFORM ?= manylinux_x86_64
WHEELS ?= wheelhouse
FREEZE ?=

.PHONY: train test lint format wheelhouse clean

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,hf,shards]"
	touch $@

train: $(VENV)/.installed
	$(PY) src/train.py $(ARGS)

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=15 $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

wheelhouse:
	PY=$(PYTHON) bash scripts/wheelhouse.sh $(PYVER) $(PLATFORM) $(WHEELS) $(FREEZE)

clean:
	rm -rf $(VENV) outputs multirun
