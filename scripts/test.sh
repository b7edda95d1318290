#!/usr/bin/env bash
# Set up, then the whole test suite (CPU; kernels run under TRITON_INTERPRET=1 inside their tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export STIEFKV_DATA_DIR="${STIEFKV_DATA_DIR:-$(cd .. && pwd)/shared/data}"
exec python3 -m pytest -q "$@"
