#!/usr/bin/env bash
# The issue-3 quality table and the GPU checks of issues 4 and 5 on a two-GPU machine (device tool, kind
# nvidia-h200-x2), after ../shared/tools/gpu-model-parts.sh brought the GGUF over.
#   usage: run_table_gpu.sh MODEL RESULTS_DIR [SECONDS]
# GPU 0: the rest of the pre_rope table, the low post_rope budgets, StreamKL's GPU tests, a
#   cheaper-refinement variant.
# GPU 1: the Llama-3-8B-shape calibration timing, the high post_rope budgets, a --loss output+kl calibration
#   evaluated with --attention-kl (issue 5), the generate benchmark, the CUDA generate test.
# Rows of an earlier machine in ./.res (ignored by git), else the committed rows in benchmarks/results, are
# copied in first. Every step is resumable: table rows already in RESULTS_DIR are skipped, and a finished
# step leaves a done.NAME marker, so the same command on a still-warm machine continues. After SECONDS
# (default 560) everything still running is stopped and RESULTS_DIR is packed into $OUT/results.tgz.
set -u
M=$1; R=$2; LIMIT=${3:-560}
mkdir -p "$R"
export STIEFKV_RESULTS_DIR=$R PYTHONUNBUFFERED=1  # rows of bench_*.py (quality_table.py writes R/MODE.jsonl)
T="python3 -u benchmarks/quality_table.py $M $R"
step() {  # step NAME CMD...: run CMD once, to its own log; a marker when it succeeds
  local name=$1; shift
  [ -e "$R/done.$name" ] && return 0
  echo "$(date +%T) start $name" >> "$R/steps.log"
  local rc=0
  "$@" > "$R/$name.log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] && touch "$R/done.$name"
  echo "$(date +%T) end $name rc=$rc" >> "$R/steps.log"  # rc read first: $(date) would reset $?
}
gpu0() {  # two processes never share a key mode's budgets (each reads the finished rows once, at its start)
  export CUDA_VISIBLE_DEVICES=0
  step table_pre $T --key-mode pre_rope
  step table_post_low $T --key-mode post_rope --budgets 0.375,0.25
  step pytest_streamkl python3 -m pytest -q -p no:cacheprovider tests/test_streamkl.py
  step variant_pre $T --key-mode pre_rope --budgets 0.5 --rows stiefel-dp-seq \
    --extra '{"steps": 30, "step_sequences": 2}' --tag "steps 30, 2 seq/step"
}
gpu1() {
  export CUDA_VISIBLE_DEVICES=1
  step speed_8b python3 -u benchmarks/bench_calibrate_speed.py --device cuda --dtype bfloat16
  step table_post_high $T --key-mode post_rope --budgets 0.5,0.75
  step calibrate_kl_loss stiefkv calibrate "$M" --device cuda --loss output+kl -o "$R/kl-loss.safetensors"
  step eval_kl_loss stiefkv eval "$M" --device cuda --projections "$R/kl-loss.safetensors" --attention-kl \
    --kl-context 8192 --json "$R/eval-kl-loss.json"
  step generate python3 -u benchmarks/bench_generate.py
  step generate_post python3 -u benchmarks/bench_generate.py --key-mode post_rope
  step pytest_generate python3 -m pytest -q -p no:cacheprovider \
    "tests/test_inference.py::test_generate_on_gpu_triton_matches_reference"
}
[ -d .res ] && cp -rn .res/. "$R/"  # rows of an earlier machine, to continue from
for mode in pre_rope post_rope; do  # and the committed rows of earlier sessions
  [ -e "$R/$mode.jsonl" ] || cp "benchmarks/results/issue3-table-$mode.jsonl" "$R/$mode.jsonl" 2>/dev/null
done
gpu0 & gpu1 &
start=$SECONDS
while [ -n "$(jobs -r)" ] && [ $((SECONDS - start)) -lt "$LIMIT" ]; do sleep 3; done
# Only this script's children: a pattern matched against every command line also kills the device call's
# own shell whenever its text names a log (pytest_kernels.log), and then nothing comes back.
for pid in $(jobs -p); do pkill -P "$pid"; kill "$pid"; done 2>/dev/null; sleep 1
tar czf "$OUT/results.tgz" -C "$R" .
