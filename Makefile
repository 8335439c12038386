# Set-up is part of every target: a fresh clone needs only `make test` or `make serve`.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first and pinned: a looser resolve would pull a multi-GB CUDA build on CPU machines.
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $@

.PHONY: install system-deps test lint serve
install: $(STAMP)

# PostgreSQL, Redis, chromium and promtool: what the tests use besides Python packages.
system-deps:
	scripts/system-deps

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

test: lint system-deps
	$(BIN)/pytest

serve: $(STAMP)
	$(BIN)/pagedbatch serve
