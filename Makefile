# `make run` and `make test` set up what is missing, then run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONFIG ?= configs/tiny.yaml

.PHONY: run test setup plan clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build on disk, never a CUDA download on a CPU machine.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/grpoflow run $(CONFIG)

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15

plan: $(STAMP)
	$(BIN)/grpoflow plan configs/seed-70b.yaml --out docs/design-70b

clean:
	rm -rf runs .pytest_cache
