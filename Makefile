# make train: set up .venv from pyproject.toml and run the default job. make test: set up and test.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $@

train: $(VENV)/.installed
	$(PY) src/train.py $(ARGS)

test: $(VENV)/.installed
	OMP_NUM_THREADS=1 $(PY) -m pytest $(ARGS)

clean:
	rm -rf $(VENV) outputs multirun
