# One entry point for set-up, tests and the end-to-end quickstart.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast quickstart clean

$(STAMP): setup.py requirements-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-cpu.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

quickstart: $(STAMP)
	$(BIN)/python scripts/quickstart.py

clean:
	rm -rf $(VENV) .pytest_cache
