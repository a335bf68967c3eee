# kafka-outbox developer tasks. The project's virtualenv lives in .venv/.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PG_DEFAULT_ROLE := outbox

.PHONY: venv kafka services test test-unit demo bench lint clean distclean

venv: $(STAMP)

# Re-install only when pyproject.toml changed (or the venv is missing).
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# Download Apache Kafka's jars once (cached in ~/.cache/kafka-outbox) and print where they are.
kafka: venv
	$(VPY) -m outbox.testing fetch

# Start the local PostgreSQL if it is installed and not running, and make sure role
# outbox/outbox (CREATEDB) exists. Does nothing when OUTBOX_TEST_POSTGRES points elsewhere.
services:
	@set -euo pipefail; \
	if [ -n "$${OUTBOX_TEST_POSTGRES:-}" ]; then echo "services: using OUTBOX_TEST_POSTGRES, not touching local PostgreSQL"; exit 0; fi; \
	if ! command -v pg_ctlcluster >/dev/null && ! ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1; then \
	  echo "services: PostgreSQL is not installed locally (apt-get install postgresql, or set OUTBOX_TEST_POSTGRES)"; exit 0; fi; \
	if ! pg_isready -q -h 127.0.0.1 -p 5432; then \
	  if command -v pg_lsclusters >/dev/null; then \
	    pg_lsclusters -h | while read -r ver name port status rest; do \
	      case "$$status" in online*) ;; *) echo "services: starting PostgreSQL $$ver/$$name"; pg_ctlcluster "$$ver" "$$name" start ;; esac; \
	    done; \
	  else service postgresql start; fi; \
	  for i in $$(seq 1 60); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 0.5; done; \
	  pg_isready -h 127.0.0.1 -p 5432; \
	fi; \
	sql="DO \$$\$$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$(PG_DEFAULT_ROLE)') THEN CREATE ROLE $(PG_DEFAULT_ROLE) LOGIN CREATEDB PASSWORD 'outbox'; ELSE ALTER ROLE $(PG_DEFAULT_ROLE) LOGIN CREATEDB PASSWORD 'outbox'; END IF; END \$$\$$;"; \
	if [ "$$(id -u)" = 0 ]; then runuser -u postgres -- psql -X -q -v ON_ERROR_STOP=1 -c "$$sql"; \
	elif [ "$$(id -un)" = postgres ]; then psql -X -q -v ON_ERROR_STOP=1 -c "$$sql"; \
	else sudo -n -u postgres psql -X -q -v ON_ERROR_STOP=1 -c "$$sql" || echo "services: could not ensure role $(PG_DEFAULT_ROLE) (need root or sudo)"; fi; \
	echo "services: PostgreSQL ready at postgresql://$(PG_DEFAULT_ROLE):outbox@127.0.0.1:5432/postgres"

test: venv kafka services
	$(VPY) -m pytest tests -q

test-unit: venv
	$(VPY) -m pytest tests/unit -q

demo: venv kafka services
	$(VPY) examples/demo.py

bench: venv kafka services
	$(VPY) -m benchmarks

lint: venv
	$(VPY) -m ruff check .
	$(VPY) -m mypy outbox

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache .hypothesis spark-warehouse metastore_db derby.log
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

# Also forget the downloaded Kafka jars.
distclean: clean
	rm -rf "$${XDG_CACHE_HOME:-$$HOME/.cache}/kafka-outbox"
