# Two entry points used by the README quick start and by CI (.ci/run calls `make test`).
# `make setup` is idempotent: it re-installs only when pyproject.toml changes.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-stamp

.PHONY: setup serve test lint

$(STAMP): pyproject.toml scripts/setup.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(BIN)/dspark serve

# pytest exits 5 when it collected nothing: treated as a failure, like any other non-zero code.
# lint-imports checks the one-way layers of pyproject.toml ([tool.importlinter]) in this checkout, and mypy its
# packages ([tool.mypy]), before any test runs.
test: $(STAMP)
	$(BIN)/ruff check .
	PYTHONPATH=$(CURDIR) $(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/python -m pytest -q; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "no tests were collected" >&2; exit 1; fi; exit $$rc

lint: $(STAMP)
	$(BIN)/ruff check .
	PYTHONPATH=$(CURDIR) $(BIN)/lint-imports
	$(BIN)/mypy
