# Two commands for a fresh machine: `make run` and `make test`. Each creates .venv and installs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: run test test-fast lint system-deps clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

# System tools the sandbox needs (bubblewrap); installed with apt when missing and we are root.
system-deps:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing bubblewrap"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap) >/dev/null; \
	  else echo "warning: bubblewrap (bwrap) missing; install it for the sandbox"; fi; }

run: $(STAMP) system-deps
	$(BIN)/cadenza train

test: $(STAMP) system-deps
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not distributed and not network" $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
