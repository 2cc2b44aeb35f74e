# Everything the project needs is installed by these targets into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test test-slow lint format bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## The main job: a short local collaboration on loopback.
run: $(STAMP)
	$(BIN)/python -m examples.sahajbert

## The default test suite (under 10 minutes on 2 cores), with lint and format checks.
test: $(STAMP) lint
	$(BIN)/python -m pytest -q

## The slow tests too (long simulations, real-process runs).
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m ''

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
