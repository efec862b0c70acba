# The slim image: router, operator, KV store (Mooncake master and store
# client) and the chart's `helm test` pod. No vLLM, no CUDA.
#   docker build -f docker/tandem.Dockerfile -t ghcr.io/tandem-serving/tandem:0.1.0 .
# (`make images` builds both images.) BASE: any Debian 12 image with Python
# 3.11 (`make images-check` builds on a local one, docs/install.md#images).

ARG BASE=python:3.11.14-slim-bookworm
FROM ${BASE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# A CA bundle for pip behind a TLS-inspecting proxy (make images passes
# the host's PIP_CERT); unset, pip trusts its own.
ARG PIP_CERT
# The gRPC code is generated at build time, by the Makefile's own recipe.
RUN python -m venv /opt/tandem \
    && /opt/tandem/bin/pip install --no-cache-dir grpcio-tools==1.85.1 \
    && make proto PY=/opt/tandem/bin/python STAMP= \
    && /opt/tandem/bin/pip install --no-cache-dir ".[kvstore]" \
    && /opt/tandem/bin/pip uninstall -y grpcio-tools

FROM ${BASE}
# Mooncake's binaries load libibverbs even over TCP. Apt's package caches
# (80 MB) go too: bases other than Debian's official images keep them.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && useradd --uid 10001 --user-group --no-create-home --home-dir /nonexistent tandem
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 10001
# Pods name their command (the operator's manifests, the chart); alone, the
# image explains itself.
CMD ["tandem", "--help"]
