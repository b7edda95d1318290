#!/usr/bin/env bash
# The kernels' GPU checks (issues 4 and 5) on a two-GPU machine (device tool, kind nvidia-h200-x2), and a
# --loss output+kl calibration when MODEL is given (after ../shared/tools/gpu-model-parts.sh).
#   usage: run_checks_gpu.sh RESULTS_DIR [SECONDS] [MODEL]
# GPU 0: the compiled CUDA tests of both kernels and of generate, then bench_generate.py in both key modes.
# GPU 1: bench_attention.py (decode with its config sweep, prefill, host time per call), bench_streamkl.py with
# the compiled reference wherever it fits, then (with MODEL) the calibration and its evaluation.
# Each step logs to RESULTS_DIR/NAME.log and the benchmarks append their rows to RESULTS_DIR/*.jsonl (copy them
# into benchmarks/results/); after SECONDS (default 540) whatever still runs is stopped and RESULTS_DIR is packed
# into $OUT/results.tgz. The device tree has no .git: pass STIEFKV_COMMIT etc. (benchmarks/utils.py).
set -u
R=$1; LIMIT=${2:-540}; M=${3:-}
mkdir -p "$R"
export STIEFKV_RESULTS_DIR=$R PYTHONUNBUFFERED=1
step() {  # step NAME CMD...: run CMD to its own log, and note its start, end and exit status
  local name=$1; shift
  echo "$(date +%T) start $name" >> "$R/steps.log"
  local rc=0
  "$@" > "$R/$name.log" 2>&1 || rc=$?
  echo "$(date +%T) end $name rc=$rc" >> "$R/steps.log"  # rc read first: $(date) would reset $?
}
gpu0() {  # compilation dominates these tests: spread them over workers where pytest-xdist is installed
  export CUDA_VISIBLE_DEVICES=0
  # (-p no:benchmark: pytest-benchmark in the device image aborts a session that runs under xdist)
  local workers=(); python3 -c "import xdist" 2>/dev/null && workers=(-n 8 -p no:benchmark)
  step pytest_kernels python3 -m pytest -q -p no:cacheprovider "${workers[@]}" tests/test_streamkl.py \
    tests/test_lowrank_kernel.py "tests/test_inference.py::test_generate_on_gpu_triton_matches_reference"
  step generate python3 -u benchmarks/bench_generate.py
  step generate_post python3 -u benchmarks/bench_generate.py --key-mode post_rope
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  step bench_attention python3 -u benchmarks/bench_attention.py --tables decode prefill sweep host
  # issue 5's table: the torch.compile'd reference wherever it fits. It needs ~3.5x less memory than eager, so
  # beyond the shapes where eager fitted (timed 2026-11-30) it may fit at 16k x 32 heads and at 32k x 8 heads.
  step streamkl_compiled python3 -u benchmarks/bench_streamkl.py --lengths 16384 32768 --eager-max-n 16384 \
    --compile-shapes all --compile-dynamic --budget-s 300
  [ -n "$M" ] || return 0
  step calibrate_kl_loss stiefkv calibrate "$M" --device cuda --loss output+kl -o "$R/kl-loss.safetensors"
  step eval_kl_loss stiefkv eval "$M" --device cuda --projections "$R/kl-loss.safetensors" --json "$R/eval-kl-loss.json"
}
gpu0 & gpu1 &
start=$SECONDS
while [ -n "$(jobs -r)" ] && [ $((SECONDS - start)) -lt "$LIMIT" ]; do sleep 3; done
# Only this script's children: a pattern matched against every command line also kills the device call's
# own shell whenever its text names a log (pytest_kernels.log), and then nothing comes back.
for pid in $(jobs -p); do pkill -P "$pid"; kill "$pid"; done 2>/dev/null; sleep 1
tar czf "$OUT/results.tgz" -C "$R" --exclude='*.safetensors' .
