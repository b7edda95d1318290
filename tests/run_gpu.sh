#!/usr/bin/env bash
# The CUDA tests, compiled, on a GPU machine (the device tool's image: torch 2.11, triton 3.6, transformers
# 5.17, no geoopt): the kernels (StreamKL's small and odd shapes included), the kernels' public dispatch, and
# serving (cache protocol, generate with Triton against the reference, the import rules, quantized latents, the static
# cache and captured decode).
#   usage: tests/run_gpu.sh [LOG_DIR]      (the log is also printed)
set -uo pipefail
cd "$(dirname "$0")/.."
LOG=${1:-/tmp}/pytest_gpu.log
mkdir -p "$(dirname "$LOG")"
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || echo "editable install failed: importing from the checkout" >&2
# pytest puts the checkout first on sys.path, and an editable install that adds a path entry rather than a
# finder (the device image's, 2026-12-07) maps no package-dir: stiefkv.calibrate (./calibrate) is then not
# found from here
python3 -c "import stiefkv.calibrate" 2>/dev/null || ln -sfn ../calibrate stiefkv/calibrate
workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8 -p no:benchmark)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  | tee -a "$LOG"
python3 -m pytest -q -ra -p no:cacheprovider "${workers[@]}" --durations=15 tests/test_streamkl.py \
  tests/test_lowrank_kernel.py tests/test_kernels_api.py tests/test_inference.py tests/test_cache.py tests/test_serve.py \
  tests/test_architecture.py tests/test_quant.py tests/test_band_kernel.py 2>&1 | tee -a "$LOG"
