# Sourced by the run_*_gpu.sh scripts: results folder and log, the install on the device image, and step().
# Rows go to $STIEFKV_RESULTS_DIR (default $OUT); every step's output is appended to its run.log.
export STIEFKV_RESULTS_DIR=${STIEFKV_RESULTS_DIR:-$OUT}
export PYTHONUNBUFFERED=1
mkdir -p "$STIEFKV_RESULTS_DIR"
LOG=$STIEFKV_RESULTS_DIR/run.log
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl; fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || echo "editable install failed"
  python3 -c "import stiefkv.kernels.lowrank, torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >> "$LOG" 2>&1
step() {  # step NAME CMD...: run CMD, appending to the log with its start, end and exit status
  local name=$1; shift
  echo "=== $(date -u +%T) start $name: $*" >> "$LOG"
  local rc=0
  "$@" >> "$LOG" 2>&1 || rc=$?
  echo "=== $(date -u +%T) end $name rc=$rc" >> "$LOG"
}
