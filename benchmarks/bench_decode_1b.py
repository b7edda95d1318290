"""Decode kernel at Llama-3.2-1B attention shapes (H = 32, G = 8, d = 64, 50 %: r = 32), bf16: the default
configuration against block_n 64 and 128 and, for ``pre_rope``, the polynomial sin/cos; full-rank SDPA on the
same shapes as the floor. Device times: ``triton.testing.do_bench_cudagraph`` medians (no L2 flush).

    python benchmarks/bench_decode_1b.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from stiefkv.kernels.lowrank import lowrank_attention
from stiefkv.kernels.reference import RopeSpec

H, G, D, R = 32, 8, 64, 32
SHAPES = [(1, 32768), (4, 32768)]


def main() -> None:
    device, dtype = "cuda", torch.bfloat16
    print(f"{torch.cuda.get_device_name()}; H={H}, G={G}, d={D}, r={R}, bf16; µs per call\n")
    print("| B × ctx | SDPA | pre_rope default | block_n 64 | block_n 128 | polynomial sin/cos | "
          "post_rope default | block_n 64 | block_n 128 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, N in SHAPES:
        q = torch.randn(B, H, 1, D, device=device, dtype=dtype)
        k = torch.randn(B, G, N, D, device=device, dtype=dtype)
        cells = [do_bench_cudagraph(lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True))]
        z = torch.randn(B, G, N, R, device=device, dtype=dtype)
        P = torch.linalg.qr(torch.randn(G, D, R, device=device))[0]
        pos = torch.arange(N, device=device, dtype=torch.int32)[None].expand(B, N).contiguous()
        rope = RopeSpec(1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device).float() / D)))
        variants = [("pre_rope", dict()), ("pre_rope", dict(block_n=64)), ("pre_rope", dict(block_n=128)),
                    ("pre_rope", dict(fast_sincos=False)), ("post_rope", dict()), ("post_rope", dict(block_n=64)),
                    ("post_rope", dict(block_n=128))]
        with torch.no_grad():
            for mode, cfg in variants:
                cells.append(do_bench_cudagraph(lambda: lowrank_attention(
                    q, z, z, P, P, key_mode=mode, positions=pos, rope=rope, **cfg)))
        print(f"| {B}×{N // 1024}k | " + " | ".join(f"{ms * 1e3:.1f}" for ms in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
