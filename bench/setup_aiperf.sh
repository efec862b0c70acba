#!/usr/bin/env bash
# Create aiperf's own virtual environment (aiperf pins dependencies that clash
# with vLLM's): `bench/setup_aiperf.sh [VENV_DIR]`, default .tandem/venv-aiperf
# (gitignored). Idempotent: does nothing when the pinned version is installed.
set -euo pipefail
AIPERF_VERSION="${AIPERF_VERSION:-0.13.0}"
cd "$(dirname "$0")/.."
VENV="${1:-.tandem/venv-aiperf}"
PYTHON="${PYTHON:-python3}"
if [ -x "$VENV/bin/aiperf" ] && "$VENV/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('aiperf') != '$AIPERF_VERSION')" 2>/dev/null; then
  echo "aiperf $AIPERF_VERSION already in $VENV"
  exit 0
fi
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -U pip
"$VENV/bin/python" -m pip install -q "aiperf==$AIPERF_VERSION"
"$VENV/bin/aiperf" --version >/dev/null 2>&1 || "$VENV/bin/aiperf" --help >/dev/null
echo "aiperf $AIPERF_VERSION installed in $VENV"
