#!/usr/bin/env bash
# Issue 15's compressed-context rows on one H200 (device tool), after ../shared/tools/gpu-model-parts.sh
# brought the GGUF over: several bench_compaction.py processes share the GPU (the model is small), each
# appending to RESULTS_DIR/NAME/compaction.jsonl, one method after another, so that every finished method
# keeps its row when the time is up.
#   usage: run_compaction_gpu.sh MODEL RESULTS_DIR SECONDS "ARGS" -- NAME "METHODS" "VARIANTS" [NAME ...]
set -u
M=$1; R=$2; LIMIT=$3; COMMON=$4; shift 4; [ "${1:-}" = "--" ] && shift
mkdir -p "$R"
export PYTHONUNBUFFERED=1
pids=()
while [ $# -ge 3 ]; do
  name=$1; methods=$2; variants=$3; shift 3
  (
    for m in ${methods//,/ }; do
      # shellcheck disable=SC2086  # COMMON is a word list on purpose
      STIEFKV_RESULTS_DIR="$R/$name" python3 -u benchmarks/bench_compaction.py "$M" $COMMON --methods "$m" \
        --variants "" >> "$R/$name.log" 2>&1
    done
    IFS=$'\n'
    for v in $(tr , '\n' <<< "$variants"); do
      unset IFS
      # shellcheck disable=SC2086
      STIEFKV_RESULTS_DIR="$R/$name" python3 -u benchmarks/bench_compaction.py "$M" $COMMON --methods "" \
        --variants "$v" >> "$R/$name.log" 2>&1
    done
  ) &
  pids+=($!)
done
( sleep "$LIMIT"; pkill -f bench_compaction.py ) &
watchdog=$!
wait "${pids[@]}"
kill "$watchdog" 2>/dev/null
exit 0
