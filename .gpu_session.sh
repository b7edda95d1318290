#!/usr/bin/env bash
# untracked driver: bash .gpu_session.sh STEP...
set -u
M=$HOME/m/model.gguf
export STIEFKV_COMMIT=$(cat .commit) STIEFKV_DATA_DIR=$PWD/.data PYTHONUNBUFFERED=1
R=$HOME/res; mkdir -p $R
export STIEFKV_RESULTS_DIR=$R
source benchmarks/gpu_run.sh
pack() { (cd $HOME && tar czf $OUT/res.tgz res --exclude='*.safetensors'); }
for s in "$@"; do case $s in
  pareto)
    P=$HOME/pareto; mkdir -p $P
    X='{"share_heads":true}'
    ( CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -p no:cacheprovider tests/test_lowrank_kernel.py -k shared > $R/pytest_shared.log 2>&1; echo "rc=$?" >> $R/pytest_shared.log ) &
    tp=$!
    bash benchmarks/run_pareto_gpu.sh "$M" "$P" ${PLIMIT:-540} -- \
      sA "--rows auto --budgets 0.0625,0.09375 --extra $X --tag share-heads" \
      sB "--rows auto --budgets 0.125,0.1875 --extra $X --tag share-heads" \
      sC "--rows auto --budgets 0.25,0.5 --extra $X --tag share-heads" \
      sR "--rows ranks --budgets 0.5,0.25,0.1875,0.125 --extra $X --tag share-heads" \
      pA "--rows baselines,auto --budgets 0.0625,0.125 --baselines kivi2,kivi3,kivi4,int8"
    wait $tp
    for d in $P/*/; do n=$(basename $d); cp $d/pareto.jsonl $R/pareto_$n.jsonl 2>/dev/null; done
    cp $P/*.log $R/ 2>/dev/null ;;
  *) "$s" ;;
esac; done
pack
