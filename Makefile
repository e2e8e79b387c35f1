# mini-vLLM course. Every target installs what it needs into .venv (idempotent).
#   make lab        open the course in JupyterLab
#   make test       the whole test suite (what CI runs)
PYTHON        ?= python3
VENV          := .venv
PY            := $(VENV)/bin/python
PIP           := $(PY) -m pip
# torch and triton are installed only when the venv has none, so a CUDA build
# you installed yourself (README: "Using a GPU") is kept.
TORCH_SPEC    ?= torch==2.13.0
TRITON_SPEC   ?= triton==3.9.0
PYTEST_ARGS   ?=
# One intra-op thread per process for tests and notebook runs: the tiny model
# gains nothing from more, and a notebook kernel next to pytest on 2 cores
# would otherwise oversubscribe them (up to 45x slower). Benchmarks keep the default.
TEST_ENV      := OMP_NUM_THREADS=1

NOTEBOOKS     := $(sort $(wildcard notebooks/[0-9A-Z][0-9_]*.ipynb))
SOLUTIONS     := $(sort $(wildcard solutions/[0-9][0-9]_*.ipynb))

.PHONY: help venv install-course install-test lab test test-unit test-notebooks test-browser chromium notebooks exercises bench model clean

help:
	@echo "make lab            install the course into .venv and open JupyterLab"
	@echo "make test           install test dependencies into .venv and run the whole suite (what CI runs)"
	@echo "make test-unit      only the pytest suite under tests/"
	@echo "make test-notebooks strict nbval on notebooks/ and solutions/"
	@echo "make test-browser   the real-browser widget test (headless Chromium)"
	@echo "make notebooks      regenerate exercises/ and re-execute notebooks/ and solutions/ in place"
	@echo "make bench          the benchmarks (results in benchmarks/results/)"

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel

# torch (and triton on Linux) first, only when missing.
$(VENV)/.torch: | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "$(TORCH_SPEC)"
	@if [ "$$(uname -s)" = "Linux" ]; then \
	  $(PY) -c "import triton" 2>/dev/null || $(PIP) install "$(TRITON_SPEC)"; fi
	touch $@

$(VENV)/.course: pyproject.toml constraints.txt $(VENV)/.torch
	$(PIP) install -c constraints.txt -e ".[course]"
	touch $@

$(VENV)/.test: pyproject.toml constraints.txt $(VENV)/.torch
	$(PIP) install -c constraints.txt -e ".[test]"
	touch $@ $(VENV)/.course

venv install-course: $(VENV)/.course
install-test: $(VENV)/.test

# (--allow-root only when you are root, e.g. in a container: Jupyter refuses otherwise)
lab: $(VENV)/.course
	$(VENV)/bin/jupyter lab $$([ "$$(id -u)" = 0 ] && echo --allow-root) notebooks/00_welcome.ipynb

test: test-unit test-notebooks

# The unit suite includes the real-browser widget test (tests/browser), which
# needs Debian's chromium: installed here with apt when missing.
test-unit: $(VENV)/.test chromium
	$(TEST_ENV) $(PY) -m pytest tests $(PYTEST_ARGS)

test-browser: $(VENV)/.test chromium
	$(PY) -m pytest tests/browser -v

chromium:
	bash scripts/ensure_chromium.sh

# Strict nbval: every committed output must be what the code produces now
# (tests/nbval_sanitize.cfg masks addresses and timings only).
test-notebooks: $(VENV)/.test
	@if [ -n "$(NOTEBOOKS)$(SOLUTIONS)" ]; then \
	  $(TEST_ENV) $(PY) -m pytest --nbval -p no:cacheprovider --nbval-sanitize-with tests/nbval_sanitize.cfg \
	    --nbval-cell-timeout=900 $(NOTEBOOKS) $(SOLUTIONS); \
	else echo "no notebooks yet"; fi

exercises: $(VENV)/.test
	$(PY) -m mini_vllm.course.build exercises

notebooks: exercises
	$(TEST_ENV) $(PY) -m mini_vllm.course.build execute $(NOTEBOOKS) $(SOLUTIONS)

bench: $(VENV)/.test
	$(PY) -m mini_vllm bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build .pytest_cache
