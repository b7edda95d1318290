#!/usr/bin/env bash
# Calibration-quality rows on the H200 (device tool), after ../shared/tools/gpu-model-parts.sh brought the GGUF
# to $HOME/m/model.gguf. Usage: run_quality_gpu.sh MODEL OUTDIR [ROW...]
# Each row writes its own table to OUTDIR/rowN.md as it goes (unbuffered, no pipe), so a run stopped by the
# device's time limit still returns every finished row. Rows: see the case below.
set -u
M=$1; O=$2; shift 2
Q="python3 -u benchmarks/bench_quality.py $M --key-modes pre_rope"
S='"order": "sequential", "steps": 100, "lr": 0.01'
for row in "${@:-1 2 3 4 5 6}"; do
  case $row in
    1) $Q --budgets 0.5,0.75 --method pca --allocation dp --extra '{"weighting": "output"}' ;;
    2) $Q --budgets 0.5 --method pca --allocation dp --extra '{"weighting": "update"}' ;;
    3) $Q --budgets 0.5 --method stiefel --allocation dp --extra "{$S}" ;;
    4) $Q --budgets 0.5 --method stiefel --allocation dp --extra "{${S/sequential/independent}}" ;;
    5) $Q --budgets 0.5 --method stiefel --allocation uniform --extra "{$S}" ;;
    6) $Q --budgets 0.75 --method stiefel --allocation dp --extra "{$S}" ;;
  esac > "$O/row$row.md" 2>> "$O/stderr.log"
done
