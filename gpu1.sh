set -u
export STIEFKV_COMMIT=$(cat .commit) STIEFKV_DIRTY=0
bash benchmarks/run_serve_gpu.sh capacity12post capacitypost
