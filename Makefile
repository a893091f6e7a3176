# Every target creates .venv when missing and installs the project into it (quick when up to date):
# the Python client (clients/python, pubsub-sidecar-client) and the sidecar, which depends on it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck proto proto-baseline emulators bench clean

# One pip command for both: the sidecar's requirement on pubsub-sidecar-client is met by the local
# folder, never looked up on a package index.
$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ./clients/python -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pubsub-sidecar demo

test: $(STAMP) lint
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check sidecar tests bench scripts clients/python
	$(VENV)/bin/mypy

typecheck: $(STAMP)
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

# After a deliberate, compatible change to proto/ (see docs/api.md, "Changing the proto").
proto-baseline: $(STAMP)
	$(PY) scripts/proto_compat.py --update

emulators: $(STAMP)
	$(VENV)/bin/pubsub-sidecar emulators

bench: $(STAMP)
	$(PY) -m bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis examples/node/node_modules
