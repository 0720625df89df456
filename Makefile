# Quick start: `make run` (set up .venv, run the default simulation), `make test`.
# Another Python: `make run PYTHON=python3.12` (or a path) sets up and uses .venv-3.12.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
# The interpreter PYTHON names: itself if it runs, else (a pyenv shim for a version that is
# not active, or a bare 3.12) the one .ci/find-python finds through pyenv.
PYTHON_EXE := $(shell $(PYTHON) -c '' >/dev/null 2>&1 && echo $(PYTHON) \
	|| .ci/find-python $(PYTHON) 2>/dev/null)
PYTHON_VERSION := $(if $(PYTHON_EXE),$(shell $(PYTHON_EXE) -c \
	'import sys; print("%d.%d" % sys.version_info[:2])'))
DEFAULT_VERSION := 3.11
VENV := $(if $(filter-out $(DEFAULT_VERSION),$(PYTHON_VERSION)),.venv-$(PYTHON_VERSION),.venv)
BIN := $(VENV)/bin

# A PYTHON that does not run is an error (for `make clean` too, unless it is the default);
# a virtual environment built with another Python than PYTHON is never reused.
ifeq ($(PYTHON_VERSION),)
ifneq ($(origin PYTHON)$(filter clean,$(MAKECMDGOALS)),fileclean)
$(error PYTHON=$(PYTHON) does not run: name an installed interpreter, e.g. PYTHON=python3.12)
endif
endif
ifeq ($(filter clean,$(MAKECMDGOALS)),)
VENV_VERSION := $(shell [ -x $(BIN)/python ] && $(BIN)/python -c \
	'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
ifneq ($(VENV_VERSION),)
ifneq ($(VENV_VERSION),$(PYTHON_VERSION))
$(error $(VENV) was built with Python $(VENV_VERSION), not $(PYTHON_VERSION) (PYTHON=$(PYTHON)): \
	remove it with `make clean PYTHON=$(PYTHON)` and run again)
endif
endif
endif
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: venv run test test-quick lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON_EXE) -m venv $(VENV)
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

# Set up $(VENV) with everything the tests need, and nothing else.
venv: $(TEST_STAMP)

run: $(STAMP)
	$(BIN)/fedring simulate

test: $(TEST_STAMP)
	$(BIN)/ruff check .
	PATH="$(CURDIR)/$(BIN):$$PATH" bash tests/run.sh

# What an install must get right, in 2 to 4 minutes on 2 cores: the CLI, configuration,
# the store (SQLite, and PostgreSQL when its server runs), the in-process engine, Flower's
# Ray engine, a secure round (numba), DP accounting and DP-SGD (opacus), tracking.
QUICK_TESTS := tests/test_python_versions.py \
	tests/simulations/test_simulations_cli_tables.py \
	tests/simulations/test_simulations_config_messages.py \
	tests/dp/test_dp_config.py \
	tests/store/test_store_repository.py \
	tests/e2e/test_inprocess_engine.py \
	tests/e2e/test_engines.py::test_flower_engine_matches_inprocess_engine \
	tests/secagg_e2e/test_secagg_e2e_round.py \
	tests/dp/test_dp_accountant.py \
	tests/client/test_client_dp_sgd.py \
	tests/e2e/test_tracking.py::test_federated_figures_reach_tensorboard_and_mlflow_on_the_rounds_that_evaluated

test-quick: $(TEST_STAMP)
	PATH="$(CURDIR)/$(BIN):$$PATH" bash tests/run.sh $(QUICK_TESTS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
