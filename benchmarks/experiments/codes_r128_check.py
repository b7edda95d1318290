"""Which decode launch over int8 codes at full rank (r = d = 128) reads out of bounds on the H200?
(`bench_serve.py --budget 1.0 --bits 8` at 8×16k failed in graph replay with an illegal address; 2×4k ran.)
Each variant runs in its own process (an illegal address poisons the CUDA context) and prints OK with its
largest difference from the reference, or the error.

    python benchmarks/experiments/codes_r128_check.py            # every variant
    python benchmarks/experiments/codes_r128_check.py B N KEY_MODE BITS R SPLITS PREFETCH NVALID  # one
"""

from __future__ import annotations

import subprocess
import sys

VARIANTS = [  # B, N, key mode, bits, rank, splits (0: default), prefetch (-1: default), n_valid
    (2, 4096, "post_rope", 8, 128, 0, -1, 1),
    (8, 16448, "post_rope", 8, 128, 0, -1, 1),
    (8, 16448, "post_rope", 8, 128, 0, -1, 0),
    (8, 16448, "post_rope", 8, 128, 1, -1, 1),
    (8, 16448, "post_rope", 8, 128, 0, 0, 1),
    (8, 4096, "post_rope", 8, 128, 0, -1, 1),
    (2, 16448, "post_rope", 8, 128, 0, -1, 1),
    (8, 16448, "post_rope", 8, 64, 0, -1, 1),
    (8, 16448, "post_rope", 16, 128, 0, -1, 1),
    (8, 16448, "pre_rope", 8, 128, 0, -1, 1),
]


def one(B: int, N: int, key_mode: str, bits: int, r: int, splits: int, prefetch: int, nvalid: int) -> str:
    import torch

    from stiefkv.kernels import QuantizedLatents, RopeSpec
    from stiefkv.kernels import lowrank as lk
    from stiefkv.kernels.reference import lowrank_attention as reference
    from stiefkv.quant import QuantSpec, quantize

    torch.manual_seed(0)
    dev, H, G, d = "cuda", 32, 8, 128
    q = torch.randn(B, H, 1, d, device=dev, dtype=torch.bfloat16)
    z_k = torch.randn(B, G, N, r, device=dev, dtype=torch.bfloat16)
    z_v = torch.randn(B, G, N, r, device=dev, dtype=torch.bfloat16)
    P_k = torch.linalg.qr(torch.randn(G, d, r))[0].to(dev)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rope = RopeSpec(inv_freq.to(dev), attention_scaling=1.0)
    positions = torch.arange(N, device=dev)[None].expand(B, N)
    if bits < 16:
        def codes(z):
            qz = quantize(z.float(), QuantSpec(bits, "token"))
            return QuantizedLatents(qz.codes, qz.scale, qz.low, bits, qz.rank)
        zk, zv = codes(z_k), codes(z_v)
        fk, fv = zk.dequantize(torch.bfloat16), zv.dequantize(torch.bfloat16)
    else:
        zk, zv, fk, fv = z_k, z_v, z_k, z_v
    n = N - 48
    kw = dict(key_mode=key_mode, positions=positions, rope=rope, causal=True)
    tuning = {}
    if splits:
        tuning["num_splits"] = splits
    if prefetch >= 0:
        tuning["prefetch"] = bool(prefetch)
    with torch.no_grad():
        if nvalid:
            nv = torch.tensor([n], dtype=torch.int32, device=dev)
            out = lk.lowrank_attention(q, zk, zv, P_k, None, n_valid=nv, **kw, **tuning)
        else:
            cut = (lambda z: z.tokens(0, n)) if bits < 16 else (lambda z: z[:, :, :n])
            out = lk.lowrank_attention(q, cut(zk), cut(zv), P_k, None, **kw, **tuning)
        torch.cuda.synchronize()
        kw["positions"] = positions[:, :n]
        exp = reference(q.float(), fk[:, :, :n].float(), fv[:, :, :n].float(), P_k, None, **kw)
    return f"OK maxdiff {(out.float() - exp.float()).abs().max().item():.3e}"


if __name__ == "__main__":
    if len(sys.argv) > 1:
        a = sys.argv[1:]
        print(one(int(a[0]), int(a[1]), a[2], *map(int, a[3:8])), flush=True)
    else:
        for v in VARIANTS:
            p = subprocess.run([sys.executable, __file__, *map(str, v)], capture_output=True, text=True,
                               timeout=120)
            last = (p.stdout.strip().splitlines() or [""])[-1]
            err = [ln for ln in p.stderr.splitlines() if "Error" in ln][-1:]
            print(v, last if p.returncode == 0 else f"FAILED rc={p.returncode} {err}", flush=True)
