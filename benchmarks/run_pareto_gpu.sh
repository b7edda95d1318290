#!/usr/bin/env bash
# The Pareto rows of issue 13 on one H200 (device tool), after ../shared/tools/gpu-model-parts.sh brought the
# GGUF over: three processes share the GPU (the model is small), each appending to its own RESULTS_DIR/NAME/.
#   usage: run_pareto_gpu.sh MODEL RESULTS_DIR [SECONDS] [--] NAME "bench_pareto.py ARGS" [NAME "ARGS" ...]
# Rows already in RESULTS_DIR/NAME/pareto.jsonl are skipped (bench_pareto.py resumes), so the same command on
# a still-warm machine continues. After SECONDS (default 560) everything still running is stopped; each
# process's log is RESULTS_DIR/NAME.log. At the end the first passes (safetensors) move out of RESULTS_DIR to
# PASSES_DIR (default $HOME/pareto-passes), so that what comes back is rows and logs: the device tool returns
# at most eight files a call, and on 2026-12-03 two processes' rows were left out behind them.
set -u
# SECONDS is optional: without it "--" (or the first NAME) was read as the limit, and the watchdog's
# `sleep` of it ended at once, stopping every process as it started
M=$1; R=$2; shift 2; LIMIT=560
# A number first is the limit only where a "--" or an odd count of words follows it (NAME "ARGS" come in
# pairs): a run named "2026" is a NAME, not 2026 seconds.
if [[ ${1:-} =~ ^[0-9]+$ ]] && { [ "${2:-}" = "--" ] || [ $(($# % 2)) -eq 1 ]; }; then LIMIT=$1; shift; fi
[ "${1:-}" = "--" ] && shift
mkdir -p "$R"
export PYTHONUNBUFFERED=1
pids=()
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  # shellcheck disable=SC2086  # ARGS is a word list on purpose
  python3 -u benchmarks/bench_pareto.py "$M" "$R/$name" $args >> "$R/$name.log" 2>&1 &
  pids+=($!)
done
( sleep "$LIMIT"; kill "${pids[@]}" 2>/dev/null ) &
watchdog=$!
wait "${pids[@]}"
kill "$watchdog" 2>/dev/null
passes=${PASSES_DIR:-$HOME/pareto-passes}
for f in "$R"/*/*.safetensors; do
  [ -e "$f" ] || continue
  mkdir -p "$passes/$(basename "$(dirname "$f")")" && mv "$f" "$passes/$(basename "$(dirname "$f")")/"
done
exit 0
