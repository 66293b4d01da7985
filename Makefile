# One entry point for set-up, checks and tests. Python 3.11+ and make are all it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo demo-agent demo-agent-openai test lint wheel-check soak clean

$(BIN)/.installed-demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	touch $@

$(BIN)/.installed-test: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@ $(BIN)/.installed-demo

# The demo's embedded PostgreSQL has a data directory of its own, in this checkout (removed
# by `make clean`), so an application's embedded database never holds the demo's sagas.
DEMO_PGDATA ?= $(CURDIR)/.demo-pgdata

demo: $(BIN)/.installed-demo
	env -u SAGA_DATABASE_URL SAGA_EMBEDDED_DIR='$(DEMO_PGDATA)' $(BIN)/python examples/renewal_saga.py

$(BIN)/.installed-agent: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[pydantic-ai]'
	touch $@

# A pydantic-ai refund agent, offline (a scripted model), on the demo's embedded database;
# TICKET names the ticket (run it twice with the same one: every call replays).
TICKET ?= T-$(shell date +%s)
demo-agent: $(BIN)/.installed-agent
	env -u SAGA_DATABASE_URL SAGA_EMBEDDED_DIR='$(DEMO_PGDATA)' $(BIN)/python examples/refund_agent_pydantic_ai.py --ticket '$(TICKET)'

$(BIN)/.installed-agent-openai: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[openai-agents]'
	touch $@

# The same ticket handled by an OpenAI Agents SDK agent, offline (a scripted model, no
# OpenAI key, tracing off), on the demo's embedded database; TICKET as for demo-agent.
demo-agent-openai: $(BIN)/.installed-agent-openai
	env -u SAGA_DATABASE_URL SAGA_EMBEDDED_DIR='$(DEMO_PGDATA)' $(BIN)/python examples/openai_agents_agent.py --ticket '$(TICKET)'

# The sync twins of the asyncio sources are generated (tools/async_to_sync.py): a hand
# edit, or a source changed without regenerating, fails here.
lint: $(BIN)/.installed-test
	$(BIN)/ruff check saga tests examples bench tools
	$(BIN)/ruff format --check saga tests examples bench tools
	$(BIN)/mypy saga examples tools
	$(BIN)/python tools/async_to_sync.py --check

# The suite in two phases: first the few tests marked `serial`, which read or change what
# the whole server or machine shares, one at a time; then all the others in TEST_WORKERS
# processes (pytest-xdist: one server for all of them, a fresh database per test; most
# tests wait on leases, timers and child processes, so more workers than cores pay).
# TEST_WORKERS=0 runs the second phase in this process too. PYTEST_ARGS go to both phases
# (a phase left with no test, as `PYTEST_ARGS=tests/unit` leaves the first, is no error).
TEST_WORKERS ?= 4
PYTEST_ARGS ?=

test: lint
	$(BIN)/pytest -p no:xdist -m serial $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(BIN)/pytest -n $(TEST_WORKERS) -m 'not serial' $(PYTEST_ARGS) || [ $$? -eq 5 ]

wheel-check: $(BIN)/.installed-test
	$(BIN)/pytest -q -p no:xdist tests/integration/test_wheel.py

# The long fault run: SOAK_SAGAS (default 10000) sagas under random kills and restarts.
soak: $(BIN)/.installed-test
	PYTHONPATH=tests $(BIN)/python -m faults.soak

# The documentation site (mkdocs.yml, docs/), built with --strict into site/.
$(BIN)/.installed-docs: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[docs]'
	touch $@

.PHONY: docs
docs: $(BIN)/.installed-docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) dist build .pytest_cache .mypy_cache .ruff_cache .demo-pgdata .demo-pgdata.lock

# The benchmark has an environment of its own: DBOS Transact is measured beside us,
# it is not a dependency of the project. Figures and command: docs/benchmarks.md.
BENCH_VENV ?= bench/.venv

$(BENCH_VENV)/.installed: pyproject.toml bench/requirements.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install --quiet --upgrade pip
	$(BENCH_VENV)/bin/pip install --quiet -e . -r bench/requirements.txt
	touch $@

.PHONY: bench
bench: $(BENCH_VENV)/.installed
	$(BENCH_VENV)/bin/python bench/run.py
