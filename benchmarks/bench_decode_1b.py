"""Decode kernel at Llama-3.2-1B attention shapes (H = 32, G = 8, d = 64, 50 %: r = 32), bf16: the default
configuration against block_n 64 and 128 and, for ``pre_rope``, the polynomial sin/cos; full-rank SDPA on the
same shapes as the floor. These are the shapes of ``bench_generate.py``'s model.

Keys and values are distinct tensors (latents and full-rank alike), and every call is timed after an L2
flush (:func:`utils.graph_ms`): at 1×32k the latents are 32 MB, which the H200's 60 MB L2 would otherwise
hold between calls. Rows go to ``benchmarks/results/decode_1b.jsonl``.

    python benchmarks/bench_decode_1b.py
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

from stiefkv.kernels.lowrank import lowrank_attention

H, G, D, R = 32, 8, 64, 32
SHAPES = [(1, 32768), (4, 32768)]
VARIANTS = [
    ("pre_rope", {}),
    ("pre_rope", {"block_n": 64}),
    ("pre_rope", {"block_n": 128}),
    ("pre_rope", {"fast_sincos": False}),
    ("post_rope", {}),
    ("post_rope", {"block_n": 64}),
    ("post_rope", {"block_n": 128}),
]


def main() -> None:
    ap = utils.parser(__doc__.split("\n")[0])
    ap.parse_args()  # --help, and no stray arguments
    utils.check_results_dir(ap)
    utils.require_cuda()
    print(utils.header(), flush=True)
    dtype = torch.bfloat16
    torch.manual_seed(0)
    for B, N in SHAPES:
        q = torch.randn(B, H, 1, D, device="cuda", dtype=dtype)
        k = torch.randn(B, G, N, D, device="cuda", dtype=dtype)
        v = torch.randn(B, G, N, D, device="cuda", dtype=dtype)
        sdpa = utils.graph_ms(functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True))
        del k, v
        z_k = torch.randn(B, G, N, R, device="cuda", dtype=dtype)
        z_v = torch.randn(B, G, N, R, device="cuda", dtype=dtype)
        P_k, P_v = utils.random_basis(G, D, R), utils.random_basis(G, D, R)
        pos = torch.arange(N, device="cuda", dtype=torch.int32)[None].expand(B, N).contiguous()
        rope = utils.rope_spec(D)
        with torch.no_grad():
            for mode, cfg in VARIANTS:
                fn = functools.partial(
                    lowrank_attention, q, z_k, z_v, P_k, P_v, key_mode=mode, positions=pos, rope=rope, **cfg
                )
                ms = utils.graph_ms(fn)
                variant = ", ".join(f"{k}={v}" for k, v in cfg.items()) or "default"
                row = {
                    "case": f"decode {utils.shape_name(B, N)} r{R} {mode} {variant}",
                    "B": B,
                    "N": N,
                    "H": H,
                    "G": G,
                    "d": D,
                    "r": R,
                    "key_mode": mode,
                    "variant": variant,
                    "dtype": "bfloat16",
                    "sdpa_ms": sdpa,
                    "kernel_ms": ms,
                }
                utils.write_rows("decode_1b", row)
                print(
                    f"{row['case']}: {ms['p50'] * 1e3:.1f} us (SDPA {sdpa['p50'] * 1e3:.1f} us)", flush=True
                )


if __name__ == "__main__":
    main()
