# Quick start: `make run` (set up .venv, run the default simulation), `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned: the range in pyproject.toml is then already satisfied
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,postgres]'
	touch $(STAMP)

# The tests also exercise the optional experiment tracking (TensorBoard, MLflow);
# `make run` does not need it.
$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,postgres,tracking]'
	touch $(TEST_STAMP)

run: $(STAMP)
	$(BIN)/fedring simulate

test: $(TEST_STAMP)
	$(BIN)/ruff check .
	PATH="$(CURDIR)/$(BIN):$$PATH" bash tests/run.sh

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
