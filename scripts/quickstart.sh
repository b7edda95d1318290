#!/usr/bin/env bash
# Set up, then the main job on the built-in default model: calibrate SmolLM2-135M at a 50 % KV budget in
# bytes with the defaults (--bits auto: ranks, bits and layouts by one knapsack over kl profiles; Stiefel
# refinement, sequential; on a CPU 32 × 512 calibration tokens of WikiText-2 validation, about 14 minutes
# on 2 cores) and evaluate it on the first 2 windows of
# 2048 tokens of WikiText-2 test (the whole test set takes ~25 minutes on 2 CPU cores: WINDOWS=all; see
# BENCHMARKS.md for whole-test-set numbers from the GPU). METHOD=pca is the PCA-uniform baseline instead (about a minute).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
STIEFKV="${VENV:-.venv}/bin/stiefkv"
export STIEFKV_DATA_DIR="${STIEFKV_DATA_DIR:-$(cd .. && pwd)/shared/data}"
mkdir -p runs
method="${METHOD:-stiefel}"
ckpt="runs/smollm2-${method}50.safetensors"
if [ "$method" = pca ]; then
  "$STIEFKV" calibrate smollm2 --method pca --allocation uniform --budget 0.5 -o "$ckpt"
else
  "$STIEFKV" calibrate smollm2 --budget 0.5 -o "$ckpt"
fi
windows=()
[ "${WINDOWS:-2}" = all ] || windows=(--windows "${WINDOWS:-2}")
"$STIEFKV" eval smollm2 --projections "$ckpt" ${windows[@]+"${windows[@]}"}
