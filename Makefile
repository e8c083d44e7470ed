# Quick start: `make demo` (runs the engine on the embedded default model), `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow bench clean

$(STAMP): pyproject.toml requirements-ci.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -r requirements-ci.txt
	$(BIN)/pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/sessionserve demo

# Redis-backed session-store tests run against a real redis-server on a free port (.ci/with-redis).
test: $(STAMP)
	.ci/with-redis $(BIN)/python -m pytest -q tests

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow tests

bench: $(STAMP)
	$(BIN)/python bench/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache build src/*.egg-info
