# One entry point for set-up, checks and tests. Python 3.11+ and make are all it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint typecheck unit integration wheel-check soak clean

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

demo: $(BIN)/.installed-demo
	$(BIN)/python examples/renewal_saga.py

lint: $(BIN)/.installed-test
	$(BIN)/ruff check saga tests examples
	$(BIN)/mypy saga examples

test: lint
	$(BIN)/pytest

wheel-check: $(BIN)/.installed-test
	bash tests/wheel_check.sh $(BIN)/python

# The long fault run: SOAK_SAGAS (default 10000) sagas under random kills and restarts.
soak: $(BIN)/.installed-test
	PYTHONPATH=tests $(BIN)/python -m faults.soak

clean:
	rm -rf $(VENV) dist build .pytest_cache .mypy_cache .ruff_cache
