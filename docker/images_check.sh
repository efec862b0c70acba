#!/usr/bin/env bash
# `make images-check`: build the slim image (docker/tandem.Dockerfile) and the
# CPU engine image (docker/engine-cpu.Dockerfile) on a local Debian 12 base,
# then run them and check, inside the built images:
#   1. the router (slim image) answers /health in front of the CPU engine,
#   2. `tandem operator --help` works as the image's non-root user, and the
#      slim image holds no vllm, torch or matplotlib,
#   3. the CPU engine serves a chat through the router (python -m tandem.smoke,
#      run in the slim image).
# No registry image is pulled: the base is a Debian 12 root file system made
# by mmdebstrap from Debian's packages (Python 3.11, as python:3.11-slim-bookworm)
# and imported with podman. Images are built with `buildah bud --isolation
# chroot` and run with `buildah run --isolation chroot`, which shares the
# host's network, so the services talk over host loopback.
# Needs root (or sudo) for apt-get, buildah and podman; installs mmdebstrap,
# buildah and podman when missing.
#
# Environment: PIP_CERT (a CA bundle pip trusts, passed into the builds),
# TORCH_WHEELS (a folder holding torch's +cpu wheel, mounted into the CPU
# build instead of PyTorch's index; default: $PIP_FIND_LINKS),
# REBUILD_BASE=1 (make the base again even if it exists).
set -euo pipefail

BASE=localhost/tandem-base:bookworm
SLIM=localhost/tandem:check
ENGINE=localhost/tandem-engine-cpu:check
WORK=$(mktemp -d /tmp/tandem-images-check.XXXXXX)
MODEL=/opt/tandem-cache/models/SmolLM2-135M-Instruct  # where the CPU image bundles it
TOOLS="mmdebstrap buildah podman"
SUMMARY=()

SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
note() { echo "images-check: $*"; }
summary() { SUMMARY+=("$*"); note "$*"; }

missing=""
for tool in $TOOLS; do command -v "$tool" >/dev/null || missing="$missing $tool"; done
if [ -n "$missing" ]; then
  note "installing$missing (apt-get)"
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing; }; then
    echo "images-check: needs$missing (Debian/Ubuntu packages) and root or sudo to install them" >&2
    exit 1
  fi
fi

pids=()
containers=()
cleanup() {
  for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
  sleep 2
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  for c in "${containers[@]}"; do $SUDO buildah rm "$c" >/dev/null 2>&1 || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# -- build --------------------------------------------------------------------
if [ "${REBUILD_BASE:-0}" = 1 ] || ! $SUDO buildah inspect --type image "$BASE" >/dev/null 2>&1; then
  SECONDS=0
  $SUDO mmdebstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
    bookworm "$WORK/rootfs.tar"
  $SUDO podman import "$WORK/rootfs.tar" "$BASE" >/dev/null
  summary "built $BASE in ${SECONDS}s"
else
  summary "reusing $BASE (REBUILD_BASE=1 makes it again)"
fi

flags=(--isolation chroot --layers --build-arg "BASE=$BASE")
if [ -n "${PIP_CERT:-}" ]; then
  flags+=(--volume "$PIP_CERT:/etc/pip-ca.crt:ro" --build-arg PIP_CERT=/etc/pip-ca.crt)
fi
torch_flags=()
TORCH_WHEELS=${TORCH_WHEELS-${PIP_FIND_LINKS:-}}
if [ -n "$TORCH_WHEELS" ]; then
  torch_flags=(--volume "$TORCH_WHEELS:/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels --build-arg TORCH_INDEX=)
fi

# Both at once (mostly downloads and unpacking); each one's log in $WORK.
build() {  # NAME DOCKERFILE FLAGS...
  local name=$1 dockerfile=$2 start=$SECONDS
  shift 2
  if $SUDO buildah bud "${flags[@]}" "$@" -f "$dockerfile" -t "$name" . >"$WORK/$dockerfile.log" 2>&1; then
    echo "built $name in $((SECONDS - start))s (cached layers reused)" >"$WORK/$dockerfile.done"
  else
    tail -n 60 "$WORK/$dockerfile.log" >&2
  fi
}
mkdir -p "$WORK/docker"
note "building $SLIM and $ENGINE (logs: $WORK/docker/*.log)"
build "$SLIM" docker/tandem.Dockerfile &
slim_build=$!
build "$ENGINE" docker/engine-cpu.Dockerfile "${torch_flags[@]}" &
engine_build=$!
wait $slim_build $engine_build
for dockerfile in docker/tandem.Dockerfile docker/engine-cpu.Dockerfile; do
  [ -f "$WORK/$dockerfile.done" ] || { echo "images-check: FAIL building $dockerfile" >&2; exit 1; }
  summary "$(cat "$WORK/$dockerfile.done")"
done
while read -r line; do
  summary "size $line"
done < <($SUDO buildah images --format '{{.Name}}:{{.Tag}} {{.Size}}' | grep tandem)

# -- run ----------------------------------------------------------------------
engine=$($SUDO buildah from "$ENGINE"); containers+=("$engine")
router=$($SUDO buildah from "$SLIM"); containers+=("$router")
client=$($SUDO buildah from "$SLIM"); containers+=("$client")
# The router tokenizes with the engine's model: the CPU image's own copy.
model_dir="$($SUDO buildah mount "$engine")$MODEL"
run() { $SUDO buildah run --isolation chroot "$@"; }

grpc=$(free_port); metrics=$(free_port); nixl=$(free_port); http=$(free_port)
SECONDS=0
# Each server in a process group of its own, which cleanup stops whole.
setsid $SUDO buildah run --isolation chroot --env VLLM_CPU_KVCACHE_SPACE=1 \
  --env VLLM_CPU_OMP_THREADS_BIND=nobind --env OMP_NUM_THREADS=1 "$engine" -- \
  tandem-engine --host 127.0.0.1 --grpc-port "$grpc" --metrics-port "$metrics" \
  --nixl-port "$nixl" --dtype float32 --enforce-eager --max-model-len 2048 \
  >"$WORK/engine.log" 2>&1 &
pids+=($!)
# Its HTTP port answers while vLLM still loads; the host logs when gRPC serves.
until grep -q "engine ready" "$WORK/engine.log"; do
  if ! kill -0 "${pids[0]}" 2>/dev/null || [ $SECONDS -gt 900 ]; then
    tail -n 40 "$WORK/engine.log" >&2; echo "images-check: FAIL the CPU engine did not come up" >&2; exit 1
  fi
  sleep 3
done
summary "CPU engine (tandem-engine, vllm-cpu, bundled SmolLM2) serving in ${SECONDS}s"

SECONDS=0
setsid $SUDO buildah run --isolation chroot --volume "$model_dir:/models/model:ro" "$router" -- \
  tandem-router --host 127.0.0.1 --port "$http" --engine "127.0.0.1:$grpc" --model /models/model \
  >"$WORK/router.log" 2>&1 &
pids+=($!)
until health=$(curl -fsS "http://127.0.0.1:$http/health" 2>/dev/null); do
  if ! kill -0 "${pids[1]}" 2>/dev/null || [ $SECONDS -gt 600 ]; then
    tail -n 40 "$WORK/router.log" >&2; echo "images-check: FAIL the router did not answer /health" >&2; exit 1
  fi
  sleep 2
done
summary "PASS router (slim image) /health in ${SECONDS}s: $health"

out=$(run "$client" -- sh -c 'echo "uid $(id -u)"; tandem operator --help')
uid=$(echo "$out" | sed -n 's/^uid //p')
if [ "$uid" = 0 ] || ! echo "$out" | grep -q "usage: tandem operator"; then
  echo "$out" >&2; echo "images-check: FAIL tandem operator --help as non-root (uid $uid)" >&2; exit 1
fi
summary "PASS tandem operator --help as uid $uid (slim image)"

# The slim image stays slim: no engine, no torch, no plotting.
heavy=$(run "$client" -- python -c 'import importlib.util as u
print(" ".join(m for m in ("vllm", "torch", "matplotlib") if u.find_spec(m)))')
if [ -n "$heavy" ]; then
  echo "images-check: FAIL the slim image holds $heavy" >&2; exit 1
fi
summary "PASS the slim image has no vllm, torch or matplotlib"

SECONDS=0
reply=$(run "$client" -- python -m tandem.smoke --url "http://127.0.0.1:$http" --timeout-s 300) || {
  echo "$reply" >&2; tail -n 40 "$WORK/router.log" "$WORK/engine.log" >&2
  echo "images-check: FAIL chat through the router" >&2; exit 1
}
summary "PASS chat through the router to the CPU engine in ${SECONDS}s: $reply"

echo
echo "images-check summary:"
printf '  %s\n' "${SUMMARY[@]}"
