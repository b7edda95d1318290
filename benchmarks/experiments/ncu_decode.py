"""One decode call of the low-rank kernel for Nsight Compute to read: why the loop over codes runs at a
quarter of the copy bandwidth (issue-bound, latency-bound, or waiting on something else), which the
instruction counts of ``kernel_sass.py`` and the timings cannot tell apart.

    ncu --clock-control none --kernel-name regex:_lowrank_attn_fwd --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \\
        --section MemoryWorkloadAnalysis python3 benchmarks/experiments/ncu_decode.py --bits 4

Llama-3-8B attention shapes (H = 32, G = 8, d = 128) as ``bench_attention.py``'s quant table; the call runs
three times (the first two compile and warm up: ``--launch-skip 2`` profiles the third). ``--clock-control
none`` leaves the card's clocks alone (the device notes ask for it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_attention import kernel_call, latent_inputs, quantized  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="4x131072", help="BATCHxCONTEXT")
    ap.add_argument("--r", type=int, default=64)
    ap.add_argument("--bits", type=int, default=4, choices=[16, 8, 4])
    ap.add_argument("--key-mode", default="post_rope", choices=["pre_rope", "post_rope"])
    ap.add_argument("--config", default="", help="kernel overrides, e.g. num_splits=16,prefetch=0")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_decode.py profiles a CUDA kernel: run it on the GPU")
    B, N = (int(x) for x in args.shape.lower().split("x"))
    torch.manual_seed(0)
    x = latent_inputs(B, 1, N, args.r)
    if args.bits < 16:
        x = dict(x, z_k=quantized(x["z_k"], args.bits), z_v=quantized(x["z_v"], args.bits))
    cfg = {}
    for item in filter(None, args.config.split(",")):
        key, value = item.split("=")
        cfg[key] = bool(int(value)) if key in ("prefetch", "nibbles", "keys_left") else int(value)
    call = kernel_call(x, args.key_mode, **cfg)
    with torch.no_grad():
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    print(f"{args.shape} r{args.r} {'bf16' if args.bits == 16 else f'int{args.bits}'} {args.key_mode} {cfg}: "
          "three calls done", flush=True)


if __name__ == "__main__":
    main()
