#!/usr/bin/env bash
# Set up Crucible in a virtual environment at .venv (repo root). Safe to re-run.
# torch==2.13.0 is installed FIRST, under constraints.txt, so that nothing later pulls a newer torch with
# the multi-GB CUDA stack on a CPU-only host.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "error: Crucible needs Python >= 3.11 (found $("$PYTHON" --version 2>&1)); set PYTHON=python3.11" >&2
  exit 2
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
PIP=(.venv/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt)
.venv/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[dev,swarm]"
# the dashboard test drives Debian's headless chromium (tests/helpers/observability.py): installed when we may
if ! command -v chromium >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; } \
      || echo "note: could not install chromium; the dashboard test needs it (apt-get install chromium)" >&2
  else
    echo "note: the dashboard test needs Debian's chromium: sudo apt-get install chromium" >&2
  fi
fi
.venv/bin/python -c 'import torch, hivemind, moto; print(f"crucible: ready (torch {torch.__version__}, hivemind {hivemind.__version__})")'
