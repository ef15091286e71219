# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# CPU machines take the local CPU wheel; a machine with CUDA keeps the torch it has (or pip's default build).
TORCH_CPU := torch==2.13.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
export HF_HUB_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: demo test install install-dev clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
ifeq ($(HAS_GPU),)
	$(BIN)/pip install -q $(TORCH_CPU)
endif
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

tiny/qwen2/kit.json: $(VENV)/.installed
	$(BIN)/verlflow make-tiny tiny/qwen2 --arch qwen2

demo: $(VENV)/.installed tiny/qwen2/kit.json
	$(BIN)/verlflow run blueprints/tiny-cpu.yaml

test: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf artifacts tiny .pytest_cache
