# One command sets up and runs mnesite (make run); one sets up and runs the tests (make test).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup java run test test-fast lint bench clean fuzz

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

# Spark needs a Java runtime; install Debian's when none is on the PATH.
java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "java not found: installing openjdk-17-jre-headless"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q openjdk-17-jre-headless; }

run: setup
	$(BIN)/mnesite start --sample-data

test: setup java
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest

# The fast lane: no multi-process, fault or Spark tests (about a minute).
test-fast: setup
	$(BIN)/ruff check .
	$(BIN)/pytest -m "not slow and not spark" -q

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/bench_commit.py

clean:
	rm -rf $(VENV) mnesite-data .pytest_cache .ruff_cache .hypothesis

# Content-level fuzzing of 3 cores + 1 replicant with 100,000 hostile messages (CI runs 2,000).
fuzz: setup
	MNESITE_FUZZ_MESSAGES=$${MNESITE_FUZZ_MESSAGES:-100000} $(BIN)/pytest tests/fuzz -q -s
