# syntax=docker/dockerfile:1
# pubsub-sidecar container image.
#
#   docker build -t pubsub-sidecar:0.1.0 .
#   docker run --rm -v "$PWD/sidecar.yaml:/etc/pubsub-sidecar/sidecar.yaml:ro" pubsub-sidecar:0.1.0
#
# Two stages: the builder turns the project and its dependencies into wheels and installs them in a
# virtualenv; the final image gets only that virtualenv, on the same base image (so the venv's
# interpreter path exists), with no compiler, no pip and no build files. Every dependency ships
# manylinux wheels (grpcio, protobuf, pydantic-core), so the builder needs no compiler either.
# Runs as uid/gid 10001, the user the Kubernetes manifests in k8s/ run as.
#
# For `docker build` users. The image built and smoke-tested on this project's machines (which run
# no Docker engine), and pinned by digest in k8s/overlays/example, is `make image`'s
# (scripts/image/): the same runtime settings (scripts/image/Containerfile; a test keeps the two
# the same) on Debian bookworm's python3.11 with hash-locked dependencies. docs/image.md.

FROM python:3.11-slim AS builder
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
# pyproject.toml reads README.md for the package description.
COPY pyproject.toml README.md ./
COPY sidecar ./sidecar
COPY bench ./bench
# The sidecar depends on the Python client distribution (it holds the generated gRPC code); naming
# both folders in one `pip wheel` makes pip take the client from here, not from a package index.
COPY clients/python ./clients/python
RUN pip wheel --wheel-dir /wheels ./clients/python . \
 && python -m venv /opt/pubsub-sidecar \
 && /opt/pubsub-sidecar/bin/pip install --no-index --find-links /wheels pubsub-sidecar \
 && /opt/pubsub-sidecar/bin/pip uninstall --yes pip

FROM python:3.11-slim
# No .pyc writes (the root filesystem is read-only in Kubernetes); logs leave at once.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/pubsub-sidecar/bin:$PATH
RUN groupadd --system --gid 10001 sidecar \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin sidecar
COPY --from=builder /opt/pubsub-sidecar /opt/pubsub-sidecar
USER 10001:10001
# 9090: /healthz /readyz /metrics (the `http:` address of the config). The gRPC API listens where
# the config's `listen:` says: a Unix socket in Kubernetes, or a TCP port such as 50051.
EXPOSE 9090
ENTRYPOINT ["pubsub-sidecar"]
CMD ["run", "--config", "/etc/pubsub-sidecar/sidecar.yaml"]
