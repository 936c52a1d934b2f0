# Two commands from a clean machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.installed
TSTAMP := $(VENV)/.installed-test

.PHONY: serve test install install-test redis test-tools lint bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build here.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e .
	touch $@

$(TSTAMP): $(STAMP)
	$(PIP) install -q -e '.[test]'
	touch $@

install: $(STAMP)
install-test: $(TSTAMP)

redis:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing Debian's redis-server"; \
	    (apt-get install -y -q redis-server >/dev/null 2>&1 || (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null)); \
	  else \
	    echo "redis-server is missing: install it (Debian/Ubuntu: sudo apt-get install redis-server; macOS: brew install redis)"; exit 1; \
	  fi; }

serve: install
	$(VENV)/bin/ferry serve --host 127.0.0.1 --port 8000

# Optional peers some tests drive for real (they skip, saying why, where absent).
test-tools:
	@missing=""; for b in nginx prometheus rclone chromium; do command -v $$b >/dev/null 2>&1 || [ -x /usr/sbin/$$b ] || [ -x /usr/bin/$$b ] || missing="$$missing $$b"; done; \
	if [ -n "$$missing" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "installing Debian's$$missing (optional test peers)"; \
	  apt-get install -y -q $$missing >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q $$missing >/dev/null 2>&1) || echo "could not install$$missing; those tests will skip"; \
	fi; true

# Two workers (pytest-xdist), a test file each at a time: a file's module-scoped servers start once,
# and one worker's servers load the CPU while the other's tests wait on sockets and processes.
test: install-test redis test-tools
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

lint: install-test
	$(VENV)/bin/ruff check .

bench: install-test
	$(PY) bench/engine_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
