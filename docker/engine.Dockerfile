# The engine image: Tandem's engine host (vLLM in-process behind gRPC, NIXL,
# the Mooncake store connector) on vLLM's official CUDA image, whose vLLM is
# the version pyproject's `gpu` extra pins.
#   docker build -f docker/engine.Dockerfile -t ghcr.io/tandem-serving/tandem-engine:0.1.0 .
# (`make images` builds both images.) PROTO_BASE: any Debian 12 image with
# Python 3.11, where the gRPC code is generated.

ARG PROTO_BASE=python:3.11.14-slim-bookworm
ARG BASE=vllm/vllm-openai:v0.32.0
FROM ${PROTO_BASE} AS proto
RUN apt-get update && apt-get install -y --no-install-recommends make \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir grpcio-tools==1.85.1 && make proto PY=python STAMP=

FROM ${BASE}
WORKDIR /opt/tandem-src
COPY --from=proto /src /opt/tandem-src
# vLLM and torch are the image's; this adds Tandem, NIXL and Mooncake. The
# last line fails the build if the image lacks what the engine pods run
# (Ray for multi-node pools: `ray start` in the LeaderWorkerSet scripts).
RUN python3 -m pip install --no-cache-dir ".[gpu]" \
    && python3 -c "import vllm, nixl, mooncake.store, ray, services.engine.server" \
    && command -v ray
ENV PYTHONUNBUFFERED=1
# vLLM's image starts `vllm serve`; Tandem's pods name their own command.
ENTRYPOINT []
CMD ["tandem-engine", "--help"]
