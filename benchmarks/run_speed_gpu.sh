#!/usr/bin/env bash
# The speed benchmarks on one H200 (device tool, kind nvidia-h200): random weights at real shapes, no model to
# carry. Rows go to $STIEFKV_RESULTS_DIR (default $OUT) as each measurement finishes, so whatever finished
# before a time limit comes back; every step's output is appended to $STIEFKV_RESULTS_DIR/run.log.
#   usage: run_speed_gpu.sh STEP...    (steps, run in the order given:)
#     attention  bench_attention.py, decode (default configuration) and prefill, against SDPA
#     streamkl   bench_streamkl.py at its default shapes (eager reference up to 16k)
#     decode_1b  bench_decode_1b.py, decode at the 1B model's shapes
#     sweep      bench_attention.py: the decode configuration sweep, the P_v fold and the host time per call
#     generate   bench_generate.py, pre_rope then post_rope (batch 1, 32k context)
# The device tree has no .git: pass STIEFKV_COMMIT, STIEFKV_DIRTY and STIEFKV_DIRTY_FILES (benchmarks/utils.py)
# in the command, and carry .whl (the geoopt wheel: `import stiefkv` needs it) where the image lacks it.
#   e.g.  STIEFKV_COMMIT=$(git rev-parse HEAD) ... bash benchmarks/run_speed_gpu.sh attention streamkl
set -u
source "$(dirname "$0")/gpu_run.sh"
for s in "$@"; do
  case $s in
    attention) step attention python3 benchmarks/bench_attention.py --tables decode prefill ;;
    streamkl) step streamkl python3 benchmarks/bench_streamkl.py --eager-max-n 16384 --budget-s 240 ;;
    decode_1b) step decode_1b python3 benchmarks/bench_decode_1b.py ;;
    sweep) step sweep python3 benchmarks/bench_attention.py --tables sweep fold host ;;
    generate)
      step generate_pre python3 benchmarks/bench_generate.py --key-mode pre_rope
      step generate_post python3 benchmarks/bench_generate.py --key-mode post_rope ;;
    *) echo "unknown step $s" >> "$LOG" ;;
  esac
done
tail -n 60 "$LOG"
