#!/usr/bin/env bash
# Set up (the project's .venv), then ruff and the whole test suite (CPU; kernels run under TRITON_INTERPRET=1
# inside their tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export STIEFKV_DATA_DIR="${STIEFKV_DATA_DIR:-$(cd .. && pwd)/shared/data}"
PY="${VENV:-.venv}/bin/python"
"$PY" -m ruff check .
# one pytest worker a core, at most 4 (STIEFKV_TEST_WORKERS overrides; 0 runs them in this process)
WORKERS=${STIEFKV_TEST_WORKERS:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
exec "$PY" -m pytest -q --durations=30 -n "$WORKERS" "$@"
