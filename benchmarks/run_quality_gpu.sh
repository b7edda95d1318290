#!/usr/bin/env bash
# The quality rows of BENCHMARKS.md that were produced on the H200 (device tool), after
# ../shared/tools/gpu-model-parts.sh brought the GGUF to $HOME/m/model.gguf. Usage: run_quality_gpu.sh MODEL OUTDIR
set -u
M=$1; O=$2
Q="python3 benchmarks/bench_quality.py $M --key-modes pre_rope"
rows() { grep -E '^\||^#|windows' | grep -v '^|---' ; }
{
$Q --budgets 0.5,0.75 --method pca --allocation dp --extra '{"weighting": "output"}'
$Q --budgets 0.5 --method pca --allocation dp --extra '{"weighting": "update"}'
$Q --budgets 0.5 --method stiefel --allocation dp --extra '{"order": "sequential", "steps": 100, "lr": 0.01}'
$Q --budgets 0.5 --method stiefel --allocation dp --extra '{"order": "independent", "steps": 100, "lr": 0.01}'
$Q --budgets 0.5 --method stiefel --allocation uniform --extra '{"order": "sequential", "steps": 100, "lr": 0.01}'
$Q --budgets 0.75 --method stiefel --allocation dp --extra '{"order": "sequential", "steps": 100, "lr": 0.01}'
} 2>&1 | rows | tee "$O/quality3.md"
