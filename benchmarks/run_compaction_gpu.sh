#!/usr/bin/env bash
# Issue 15's compressed-context rows on one H200 (device tool), after ../shared/tools/gpu-model-parts.sh
# brought the GGUF over: one bench_compaction.py process per job, all sharing the GPU (the model is small),
# each appending its rows to RESULTS_DIR/rows/compaction.jsonl as its methods finish (one file: the device
# tool brings back only a few). After SECONDS every
# process still running is stopped (the rows of finished methods stay). Each job's log is RESULTS_DIR/NAME.log.
#   usage: run_compaction_gpu.sh MODEL RESULTS_DIR SECONDS -- NAME "bench_compaction.py ARGS" [NAME "ARGS" ...]
set -u
M=$1; R=$2; LIMIT=$3; shift 3; [ "${1:-}" = "--" ] && shift
mkdir -p "$R"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
pids=()
while [ $# -ge 2 ]; do
  name=$1; args=$2; shift 2
  # shellcheck disable=SC2086  # ARGS is a word list on purpose
  STIEFKV_RESULTS_DIR="$R/rows" timeout "$LIMIT" python3 -u benchmarks/bench_compaction.py "$M" $args \
    >> "$R/$name.log" 2>&1 &
  pids+=($!)
done
wait "${pids[@]}"
exit 0
