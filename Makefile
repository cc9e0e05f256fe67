# Two commands on a fresh machine: `make demo` and `make test`. Both run the idempotent
# setup step first (everything lands in .cache/, ignored by git; reruns take seconds).
SHELL := /bin/bash
VENV := $(or $(SI_CACHE_DIR),$(CURDIR)/.cache)/venv
PY := $(VENV)/bin/python

.PHONY: setup demo test unit integration lint format
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m flink_jobs demo $(ARGS)

test: setup
	$(PY) -m pytest tests $(ARGS)

unit: setup
	$(PY) -m pytest tests -m "not integration" $(ARGS)

integration: setup
	$(PY) -m pytest tests -m integration $(ARGS)

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .
