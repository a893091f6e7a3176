# Every target creates .venv when missing and installs the project into it (quick when up to date):
# the Python client (clients/python, pubsub-sidecar-client) and the sidecar, which depends on it.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint format typecheck check-tools proto proto-baseline emulators bench clean

# tests/k8s render k8s/ with the real kustomize (`kubectl kustomize`, kustomize v5, embedded in
# kubectl since 1.27). The machine image ships kubectl as the `kubectl` package of google-cloud-cli;
# Debian's own kubernetes-client is kubectl 1.20 with kustomize v2, too old for `patches:`.
KUSTOMIZE_MIN_MAJOR := 5

# One pip command for both: the sidecar's requirement on pubsub-sidecar-client is met by the local
# folder, never looked up on a package index.
$(STAMP): pyproject.toml clients/python/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ./clients/python -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/pubsub-sidecar demo

test: $(STAMP) lint check-tools
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile

check-tools:
	@version=$$( (kubectl version --client 2>/dev/null | sed -n 's/^Kustomize Version: v\([0-9]*\)\..*/\1/p'; \
		kustomize version 2>/dev/null | sed -n 's/.*v\([0-9]*\)\..*/\1/p') | sort -n | tail -1); \
	if [ -z "$$version" ] || [ "$$version" -lt $(KUSTOMIZE_MIN_MAJOR) ]; then \
		echo "check-tools: tests/k8s need kustomize >= v$(KUSTOMIZE_MIN_MAJOR): kubectl >= 1.27 (\`kubectl kustomize\`," \
			"the \`kubectl\` package of google-cloud-cli) or a standalone kustomize on PATH;" \
			"found kustomize major version: $${version:-none}." >&2; \
		exit 1; \
	fi; echo "check-tools: kustomize v$$version"

lint: $(STAMP)
	$(VENV)/bin/ruff check sidecar tests bench scripts clients/python
	$(VENV)/bin/ruff format --check sidecar tests bench scripts clients/python
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format sidecar tests bench scripts clients/python

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

# The container image (docs/image.md): scripts/image/build.sh builds it with buildah FROM scratch,
# out of Debian bookworm's packages and the locked wheels (no base image, no daemon), smoke-tests
# it against the emulators in a read-only chroot as uid 10001, writes build/image/digest and
# build/image/sbom.cdx.json and pins the digest in k8s/overlays/example. Needs root. podman and
# buildah come from Debian's packages, installed here when missing.
.PHONY: image image-tools
image: $(STAMP) image-tools
	scripts/image/build.sh

image-tools:
	@missing=""; for tool in podman buildah; do command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
		echo "image-tools: installing$$missing with apt-get"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends$$missing; \
	fi
