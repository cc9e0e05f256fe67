# Two commands on a fresh machine: `make demo` and `make test`. Both run the idempotent
# setup step first (everything lands in .cache/, ignored by git; reruns take seconds).
SHELL := /bin/bash
CACHE := $(or $(SI_CACHE_DIR),$(CURDIR)/.cache)
VENV := $(CACHE)/venv
PY := $(VENV)/bin/python

.PHONY: setup demo eval test unit service model lint format bench bench-routing figures
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m flink_jobs.tools demo $(ARGS)

# Intent quality with the real model (flink_jobs/tools/eval_runner.py): every template arm over
# the same events, scored against what each shopper did next; bench/results/intent_quality.*.
# ARGS="--events data/complete_journey.jsonl --dataset complete_journey" for the second dataset.
eval: setup
	$(VENV)/bin/pip install -q "matplotlib>=3.8"
	$(PY) -m flink_jobs.tools eval $(ARGS)

# Two pytest-xdist workers, a test file (and the whole model tier) per worker at a time
# (tests/conftest.py: work_unit); TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

test: setup
	$(PY) -m pytest tests $(XDIST) $(ARGS)

# The three tiers (tests/conftest.py): `make test` runs them all.
unit: setup
	$(PY) -m pytest tests/unit $(XDIST) $(ARGS)

service: setup
	$(PY) -m pytest tests/service $(XDIST) $(ARGS)

model: setup
	$(PY) -m pytest tests/model $(ARGS)

# ruff, then mypy over the three packages ([tool.mypy] in pyproject.toml; its cache in
# $(CACHE)/mypy makes a rerun take seconds).
lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check . \
		&& $(VENV)/bin/mypy --cache-dir $(CACHE)/mypy

format: setup
	$(VENV)/bin/ruff format . && $(VENV)/bin/ruff check --fix .

# Every benchmark (bench/run_all.py): a table, bench/results/<name>.json and REPORT.md with
# plots. Each benchmark takes the heavy-run lock itself. Select some with
# ARGS="--only redis_upsert,pipeline_capacity"; routing (see bench-routing) needs SI_WITH_BENCH=1 setup.
bench: setup
	$(VENV)/bin/pip install -q "py-spy>=0.3" "matplotlib>=3.8"
	$(PY) -m bench.run_all $(ARGS)

# The figures table of docs/development.md, bench/results/REPORT.md and the sizing example
# of deploy/README.md, rebuilt from bench/results/*.json alone (bench/report.py): no
# benchmark runs.
figures: setup
	$(PY) -m bench.run_all --report-only

# Routing benchmark (20-45 min, host-dependent, before its pressure and replicas phases; the
# pressure phase adds an estimated 30-50 min, not timed yet; --time-limit bounds the whole
# run): our router vs round-robin vs vllm-router on three vLLM workers, then 1-3 replicas of
# some behind a spreading client; writes bench/results/routing.{json,md}. Takes the
# machine's heavy-run lock.
bench-routing:
	SI_WITH_BENCH=1 bash scripts/setup.sh
	flock /tmp/si-heavy.lock $(PY) -m bench.routing $(ARGS)

# The Amazon Managed Service for Apache Flink application zip (Flink 2.2, Python 3.12) in
# dist/; ARGS="--local" builds it for this interpreter instead. See deploy/README.md.
# Needs only the job's dependencies and the connector jars (SI_SETUP=package), in
# $SI_CACHE_DIR or .cache/: no vLLM, no model, no broker.
.PHONY: package package-deps
package-deps:
	@SI_SETUP=package bash scripts/setup.sh

package: package-deps
	$(PY) -m deploy.build_managed_flink_zip $(ARGS)

# The compose tier (tests/compose): docker-compose.yml end to end on the project's own
# Docker Engine (scripts/docker_engine.sh: its own socket and data under .cache/docker),
# images built locally where none can be pulled (deploy/compose/). Each heavy step takes
# the machine's heavy-run lock. scripts/compose_test.sh says what it does.
.PHONY: compose-test
compose-test: setup
	bash scripts/compose_test.sh $(ARGS)
