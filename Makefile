# Every target creates .venv when missing and installs the project into it (quick when up to date).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck proto emulators bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pubsub-sidecar demo

test: $(STAMP) lint
	$(PY) -m pytest -q -p no:cacheprovider

lint: $(STAMP)
	$(VENV)/bin/ruff check sidecar tests bench scripts

# Not yet part of lint/test: sidecar/store*, runtime, engine and deadletter are being reworked.
typecheck: $(STAMP)
	$(VENV)/bin/mypy

proto: $(STAMP)
	$(PY) scripts/gen_proto.py

emulators: $(STAMP)
	$(VENV)/bin/pubsub-sidecar emulators

bench: $(STAMP)
	$(PY) -m bench --quick

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
