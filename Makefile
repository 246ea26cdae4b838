# The two commands a newcomer runs: `make demo` and `make test`.
# Both install what is missing first, so they work on a fresh machine.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test lint check bench soak redis-server clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev]'
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,dev,bench]'
	touch $(BENCH_STAMP)

# redis-server is needed by the test suite (it starts its own on a free port), and
# redis-cli (package redis-tools) to join a throwaway Redis Cluster.
redis-server:
	@command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || { \
	  echo "installing redis-server and redis-tools"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq redis-server redis-tools >/dev/null; }
	@command -v redis-server >/dev/null 2>&1 || { echo "redis-server could not be installed"; exit 1; }
	@command -v redis-cli >/dev/null 2>&1 || { echo "redis-cli could not be installed"; exit 1; }

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP) redis-server
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check sandboxq tests examples bench
	$(VENV)/bin/ruff format --check sandboxq tests examples bench
	$(VENV)/bin/mypy

check: lint test

# Every benchmark into bench/results/report.md (~7 min on 2 cores); QUICK=1 for a smoke
# check in 1-2 minutes.
bench: $(BENCH_STAMP) redis-server
	$(PY) bench/run_all.py $(if $(QUICK),--quick)

# The chaos suite's faults mixed, against thousands of jobs, for SOAK_MINUTES (not in CI).
SOAK_MINUTES ?= 10
soak: $(STAMP) redis-server
	$(PY) tests/chaos/soak.py --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
