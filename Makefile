# One command sets up and runs mnesite (make run); one sets up and runs the tests (make test).
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin

.PHONY: setup docs docs-deps java faketime iproute2 run test test-fast fault-test partition-test failover lint bench \
	bench-peers profile trace-write turn-costs cpu-by-function clean fuzz

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

setup: $(BIN)/.installed

# The documentation tools (the `docs` extra) in the same venv.
$(BIN)/.docs-installed: pyproject.toml $(BIN)/.installed
	$(BIN)/pip install -q -e '.[dev,docs]'
	touch $@

docs-deps: $(BIN)/.docs-installed

# The documentation site in site/ (mkdocs.yml; mkdocs_hooks.py draws the benchmark charts), with
# warnings as errors: a broken link, anchor, snippet or API reference fails. `make test` (CI) runs it.
docs: docs-deps
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# Spark needs a Java runtime; install Debian's when none is on the PATH.
java:
	@command -v java >/dev/null 2>&1 || { \
	  echo "java not found: installing openjdk-17-jre-headless"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q openjdk-17-jre-headless; }

# The fault test's clock-skew fault needs libfaketime; install Debian's when it is missing
# (without it that one fault is skipped with a message).
faketime:
	@command -v faketime >/dev/null 2>&1 || { \
	  echo "faketime not found: installing faketime (libfaketime)"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q faketime; } || \
	  echo "could not install faketime: the clock_skew fault will be skipped"

# The partition test puts every node in a network namespace of its own: it needs root and iproute2
# ('ip'); install Debian's when it is missing (without root or namespaces that test is skipped, saying why).
iproute2:
	@command -v ip >/dev/null 2>&1 || { \
	  echo "ip not found: installing iproute2"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q iproute2; } || \
	  echo "could not install iproute2: the partition test will be skipped"

run: setup
	$(BIN)/mnesite start --sample-data

# CI (.ci/run): every test, in two pytest runs: the fast lane's tests and the deep ones (every seed of
# every simulation) on two worker processes, then the slow (multi-process, timing-sensitive) and Spark
# tests serially, one at a time. The second run starts also when the first failed; the target fails when
# either did.
test: setup java iproute2 docs
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -m "not slow and not spark" -n 2; fast=$$?; \
	$(BIN)/pytest -m "slow or spark"; slow=$$?; \
	exit $$(( fast != 0 ? fast : slow ))

# The developers' fast lane: no multi-process, fault, Spark or deep tests (of each simulation a sample of its
# seeds, and every mutation test), on two worker processes (about 80 s on 2 CPUs). CI's `make test`
# runs them and the deep ones the same way, then the others serially.
test-fast: setup docs-deps
	$(BIN)/ruff check .
	$(BIN)/pytest -m "not slow and not spark and not deep" -q -n 2

# The long real-process fault run (tests/fault/run.py): FAULT_SEED, FAULT_DURATION_S, FAULT_CLIENTS.
FAULT_SEED ?= 1
FAULT_DURATION_S ?= 300
FAULT_CLIENTS ?= 10
fault-test: setup faketime
	$(BIN)/python -m tests.fault.run --seed $(FAULT_SEED) --duration-s $(FAULT_DURATION_S) --clients $(FAULT_CLIENTS)

# The long partition run (root: every node in a network namespace of its own; tests/fault/partitions.py):
# every network fault in shuffled rounds. PARTITION_SEED, PARTITION_DURATION_S, PARTITION_CLIENTS;
# PARTITION_JSON=FILE also writes the figures there.
PARTITION_SEED ?= 1
PARTITION_DURATION_S ?= 300
PARTITION_CLIENTS ?= 10
partition-test: setup iproute2
	$(BIN)/python -m tests.fault.run --faults partitions --schedule rounds --seed $(PARTITION_SEED) \
	  --duration-s $(PARTITION_DURATION_S) --clients $(PARTITION_CLIENTS) $(if $(PARTITION_JSON),--json $(PARTITION_JSON))

# Sequencer-kill and follower-pause figures (tests/fault/failover.py).
failover: setup
	$(BIN)/python -m tests.fault.failover --kills 20 --pauses 5

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: setup
	$(BIN)/python benchmarks/bench_commit.py

# mnesite beside etcd and Redis (installed with apt-get when missing; not in CI): 1/16/64 clients,
# 3 rounds, the systems taking turns in 1-s slices. BASELINE=tree adds mnesite-3 run from another commit's source tree. The report
# goes to BENCH_PEERS_JSON and its chart (writes/s, p50/p99, CPU per write) beside it as .png.
BENCH_PEERS_JSON ?= docs/benchmarks/peers.json
bench-peers: setup docs-deps
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/bench_peers.py $(if $(BASELINE),--baseline $(BASELINE)) --output $(BENCH_PEERS_JSON)

# py-spy profile of the sequencer and a follower under 1 and 64 clients (benchmarks/PROFILE.md).
profile: setup
	$(BIN)/python benchmarks/profile_cores.py

# The hops of a 1-client write through three cores, timed (benchmarks/PROFILE.md).
trace-write: setup
	$(BIN)/python benchmarks/trace_write.py

# A write's CPU by core and thread, its commits and context switches, at 1, 8 and 64 clients (benchmarks/PROFILE.md).
turn-costs: setup
	$(BIN)/python benchmarks/turn_costs.py $(if $(CORES),--cores $(CORES))

# A write's CPU by function of each core's loop, per write and per turn (benchmarks/PROFILE.md).
cpu-by-function: setup
	$(BIN)/python benchmarks/cpu_by_function.py $(if $(CORES),--cores $(CORES)) $(if $(CLIENTS),--clients $(CLIENTS))

clean:
	rm -rf $(VENV) site docs/benchmarks/charts bench-peers mnesite-data .pytest_cache .ruff_cache .hypothesis

# Content-level fuzzing of 3 cores + 1 replicant with 100,000 hostile messages (CI runs 2,000).
fuzz: setup
	MNESITE_FUZZ_MESSAGES=$${MNESITE_FUZZ_MESSAGES:-100000} $(BIN)/pytest tests/fuzz -q -s
