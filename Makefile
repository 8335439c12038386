# Set-up is part of every target: a fresh clone needs only `make test` or `make serve`.
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The lock: the versions CI passed with, as pip constraints (the CPU install). Every install here
# takes them, and tests/test_lock.py fails when the virtual environment holds anything else.
LOCK := constraints.txt

$(STAMP): pyproject.toml $(LOCK)
	python3 -m venv $(VENV)
	# torch first and pinned: a looser resolve would pull a multi-GB CUDA build on CPU machines.
	$(BIN)/pip install --quiet -c $(LOCK) torch==2.13.0
	$(BIN)/pip install --quiet -c $(LOCK) -e '.[dev]'
	touch $@

.PHONY: install system-deps test lint serve lock
install: $(STAMP)

# The lock from what the virtual environment holds now: after changing a version there
# (`$(BIN)/pip install -U NAME`) and a passing `make test`. Its header comment is kept; torch's
# local label (+cpu) is dropped, so the CUDA build of the same version matches it too.
lock:
	{ sed -n '/^#/!q;p' $(LOCK); \
	  $(BIN)/pip freeze --exclude-editable | grep -v '^pagedbatch==' | sed -E 's/\+[[:alnum:].]+$$//'; \
	} > $(LOCK).new
	mv $(LOCK).new $(LOCK)

# PostgreSQL, Redis, chromium and promtool: what the tests use besides Python packages.
system-deps:
	scripts/system-deps

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# Two passes: the tests that restart PostgreSQL, Redis or S3 under real workers and time how soon
# work moves again run one at a time; the rest run on two processes (pytest-xdist), a test file
# each at a time, so that module fixtures load once.
test: lint system-deps
	$(BIN)/pytest tests/workers tests/store
	$(BIN)/pytest -n 2 --dist loadfile --ignore=tests/workers --ignore=tests/store

serve: $(STAMP)
	$(BIN)/pagedbatch serve
