# The two commands a newcomer runs: `make demo` and `make test`.
# Both install what is missing first, so they work on a fresh machine.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test lint check bench soak servers clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,dev,web]'
	touch $(STAMP)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[test,dev,web,bench]'
	touch $(BENCH_STAMP)

# The real servers the test suite starts on free loopback ports, installed where missing:
# redis-server (and redis-cli, package redis-tools, to join a throwaway Redis Cluster),
# Prometheus with promtool (it scrapes a worker and the exporter), and Debian's headless
# Chromium with its driver (the dashboard's browser tests). apt starts no service here.
# Recommended packages are left out: for these they are a desktop's (printing, power,
# notifications, Avahi, a node exporter), some hundred packages the tests never use.
SERVER_COMMANDS := redis-server:redis-server redis-cli:redis-tools prometheus:prometheus \
                   promtool:prometheus chromium:chromium chromedriver:chromium-driver
servers:
	@missing=; for pair in $(SERVER_COMMANDS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	fi
	@for pair in $(SERVER_COMMANDS); do command -v $${pair%%:*} >/dev/null 2>&1 || \
	  { echo "$${pair%%:*} could not be installed (package $${pair#*:})"; exit 1; }; done

demo: $(STAMP)
	$(PY) examples/demo.py

# Bytecode first: the suite starts some hundreds of Python processes (workers, the command
# line), and where PYTHONDONTWRITEBYTECODE is set (many containers) each one compiled the
# package anew: 0.1 s a start, 17 % of the command-line tests' time. An installed package
# has its bytecode from pip; an editable checkout gets it here (stale files are ignored).
#
# Then three pytest processes share the suite, each taking whole files (pytest-xdist): its
# tests mostly wait on leases, timeouts and processes, so two side by side left 2 cores
# half idle (506 s of CPU in a 555 s run); three took the part 449 s where two took 579 s
# on the same 2 cores. Tests marked `alone` (a latency bound, a burst, every core held)
# run after them, with nothing beside them.
test: $(STAMP) servers
	$(PY) -m compileall -q sandboxq examples
	$(PY) -m pytest -q -n 3 --dist loadfile -m "not alone"
	$(PY) -m pytest -q -m alone

# ruff (with its complexity rule), ruff format, mypy --strict, and the one-way import
# rule (import-linter; the layers are in pyproject.toml).
lint: $(STAMP)
	$(VENV)/bin/ruff check sandboxq tests examples bench
	$(VENV)/bin/ruff format --check sandboxq tests examples bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# What CI runs (.ci/run): the habits first, then every test.
check: lint test

# Every benchmark into bench/results/report.md (~7 min on 2 cores); QUICK=1 for a smoke
# check in 1-2 minutes.
bench: $(BENCH_STAMP) servers
	$(PY) bench/run_all.py $(if $(QUICK),--quick)

# The chaos suite's faults mixed, against thousands of jobs, for SOAK_MINUTES (not in CI).
SOAK_MINUTES ?= 10
# The backend model (tests/test_backend_model.py) with MODEL_EXAMPLES examples first.
MODEL_EXAMPLES ?= 2000
soak: $(STAMP) servers
	SANDBOXQ_MODEL_EXAMPLES=$(MODEL_EXAMPLES) $(PY) -m pytest -q tests/test_backend_model.py
	$(PY) tests/chaos/soak.py --minutes $(SOAK_MINUTES)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
