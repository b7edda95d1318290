set -u
export STIEFKV_COMMIT=$(cat .commit) STIEFKV_DIRTY=0
source benchmarks/gpu_run.sh
step tests python3 -m pytest -q -ra -p no:cacheprovider tests/test_lowrank_kernel.py -k "packed or wide_int4 or late_values"
step quant python3 benchmarks/bench_attention.py --tables quant --bits 4 --modes post_rope --shapes 4x131072 16x16384 29x32768 47x32768 --sweep-with pack_rows
step quant56 python3 benchmarks/bench_attention.py --tables quant --bits 4 --modes post_rope --shapes 4x131072 29x32768 47x32768 --rank 56 --sweep-with pack_rows num_warps
tail -n 80 $LOG
