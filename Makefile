# Two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# --no-compile: pip byte-compiles every installed module one by one (torch alone: 134 s to install here, 19 s
# without). WARM compiles what verlflow's processes import instead (infra/warm_bytecode.py: ~7,000 modules by
# importing them, ~21 s on 2 cores; compileall of the whole venv, twice, took 60 s).
PIP := $(BIN)/pip install -q --no-compile
WARM := $(BIN)/python infra/warm_bytecode.py
# Python caches what it compiles on a first import, but not where PYTHONDONTWRITEBYTECODE is set (this machine and
# CI set it): every process -- each rank of each stage job, each flow run -- then compiled torch, transformers and
# verl from source again, twice a rank's import time. Make's recipes (the demo, the tests) cache what they compile.
export PYTHONDONTWRITEBYTECODE :=
# CPU machines take the local CPU wheel; a machine with CUDA keeps the torch it has (or pip's default build).
TORCH_CPU := torch==2.13.0
# ... and, for the tests, Triton (a CUDA build of torch brings its own): its interpreter runs the engine's kernels
# and its compiler builds them for the H200 (tests/test_triton_kernels.py)
TRITON_CPU := triton==3.6.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo yes)
export HF_HUB_OFFLINE := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export DO_NOT_TRACK := 1

.PHONY: postgres demo test test-unit test-all install install-dev clean chromium slurm

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(PIP) --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
ifeq ($(HAS_GPU),)
	$(PIP) $(TORCH_CPU)
endif
	$(PIP) -e .
	$(WARM)
	touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e '.[dev]'
ifeq ($(HAS_GPU),)
	$(PIP) $(TRITON_CPU) || echo "no Triton wheel for this machine: tests/test_triton_kernels.py will be skipped"
endif
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

tiny/qwen2/kit.json: $(VENV)/.installed
	$(BIN)/verlflow make-tiny tiny/qwen2 --arch qwen2

tiny/agent/kit.json: $(VENV)/.installed
	$(BIN)/verlflow make-tiny tiny/agent --arch qwen2 --task calculator

# The whole pipeline as a Prefect flow run (a temporary server unless PREFECT_API_URL is set); the history stays
# in ~/.prefect, so `$(BIN)/prefect server start` shows it afterwards.
demo: $(VENV)/.installed tiny/qwen2/kit.json
	$(BIN)/verlflow run blueprints/tiny-cpu.yaml --prefect

# tests/test_ui.py drives headless Chromium (Debian's package); installed here, never by the tests.
chromium:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium; }; } || \
		echo "chromium missing and not root: tests/test_ui.py will be skipped"

# tests/test_slurm.py starts a real Slurm cluster (munged, slurmctld, two slurmd) from Debian's packages.
slurm:
	@command -v slurmctld >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge; }; }; } || \
		echo "Slurm missing and not root with apt-get: tests/test_slurm.py will be skipped"

# tests/test_postgres.py runs Prefect's server on a real PostgreSQL cluster (Debian's package, run as `postgres`).
postgres:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || \
		{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql; }; }; } || \
		echo "PostgreSQL missing and not root with apt-get: tests/test_postgres.py will be skipped"

# The tiers (tests/conftest.py): each test file is `unit`, `stages` or `system`. `make test-unit` is the inner loop:
# no torchrun job, no server.
test-unit: $(VENV)/.installed-dev
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m unit tests

# Two workers, each taking whole files (a file's module fixtures, e.g. the Slurm cluster, are made once): most
# stage jobs are one rank importing torch on one core, so a second worker fills the other. (Three were ~60 s
# faster, but the UI's Run form then missed its 120 s once: Chromium and the server starved.) The 60 slowest last.
test: $(VENV)/.installed-dev chromium slurm postgres
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=60 -m "not slow" tests

# Everything, the `@pytest.mark.slow` tests too: second whole pipelines for stories `make test` covers (each names one).
test-all: $(VENV)/.installed-dev chromium slurm postgres
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests

clean:
	rm -rf artifacts tiny .pytest_cache
