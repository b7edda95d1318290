#!/usr/bin/env bash
# Set up, then the main job on the built-in default model: calibrate SmolLM2-135M at a 50 % KV budget (PCA,
# 16 × 512 calibration tokens of WikiText-2 validation) and evaluate it on the first 2 windows of
# 2048 tokens of WikiText-2 test (the whole test set takes ~25 minutes on 2 CPU cores; drop --windows
# for it, or see BENCHMARKS.md for whole-test-set numbers from the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export STIEFKV_DATA_DIR="${STIEFKV_DATA_DIR:-$(cd .. && pwd)/shared/data}"
mkdir -p runs
stiefkv calibrate smollm2 --method pca --allocation uniform --budget 0.5 --num-sequences 16 --seq-len 512 -o runs/smollm2-pca50.safetensors
stiefkv eval smollm2 --projections runs/smollm2-pca50.safetensors --windows "${WINDOWS:-2}"
