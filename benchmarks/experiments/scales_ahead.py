"""int4 ``post_rope`` decode with each tile's scales and lows read one tile ahead: does their load latency,
not the loop's instructions, keep the int4 stream at ~60 % of the copy bandwidth (the issue's ≥ 80 %)?

    python benchmarks/experiments/scales_ahead.py           # CUDA: default and variant, same run, CUDA graphs
    python benchmarks/experiments/scales_ahead.py --static  # no GPU: compile for sm_90, registers, SASS

In the default wide int4 tile (256 keys, no prefetch) Triton's pipeliner copies the codes ahead
(``async_copy_global_to_local``), but each tile's fp16 scales and lows are plain loads at the top of its
iteration, converted through shared memory to the decode's layout before the first dot can start (the
TTGIR of ``kernel_sass.py``'s build, triton 3.6). The variant issues the next tile's scale and low loads
after this tile's decode and carries them in registers (four ``[256]`` fp16 vectors), so their latency
overlaps the dots and the softmax. Statically it is the same loop (1367 against 1368 instructions a tile,
255 against 250 registers, triton 3.6). Timed on an H100 (2026-12-07, docs/notes/kernel-tries.md): 1.14× the
default's time at 16×16k and 4×128k, so not kept.

The variant is built from ``stiefkv/kernels/lowrank.py`` by replacing lines of ``_attend_range`` (as
``ablate_decode.py``), so it always matches the kernel in the tree. Its edit holds for token-layout int4
codes in one scale group on min-max scales (the timed case: r 64, not log8) and is checked there against
the default kernel's output before it is timed.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
import tempfile

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # ablate_decode and kernel_sass beside, utils one folder up
from ablate_decode import build  # noqa: E402

FIRST = (
    "    for start_n in range(start, end, BLOCK_N):\n"
    "        offs_n = start_n + offs_nt\n"
    "        if PREFETCH:\n"
)
KEYS = (
    "        elif NIB_K:\n"
    "            ze, zo = _load_nibbles(ZK, SK, LK, offs_n, end, stride_kn, stride_kr, stride_skn, "
    "stride_skg,\n"
    "                                   R_K, R_K_P2, BLOCK_N, MASKED, DTYPE, not UPCAST, K_LOG8)\n"
)
VALUES = (
    "            if not PREFETCH:\n"
    "                ve, vo = _load_nibbles(ZV, SV, LV, offs_n, end, stride_vn, stride_vr, stride_svn, "
    "stride_svg,\n"
    "                                       R_V, R_V_P2, BLOCK_N, MASKED, DTYPE, not UPCAST, V_LOG8)\n"
)
AHEAD = [
    (FIRST,
     "    if NIB_K and not PREFETCH:\n"
     "        ks_a, kl_a = _token_scales(SK, LK, start + offs_nt, end, stride_skn, True)\n"
     "    if NIB_V and not PREFETCH:\n"
     "        vs_a, vl_a = _token_scales(SV, LV, start + offs_nt, end, stride_svn, True)\n" + FIRST),
    (KEYS,
     "        elif NIB_K:\n"
     "            raw_k = _fetch_bytes(ZK, offs_n, end, stride_kn, stride_kr, R_K, R_K_P2, MASKED, 4)\n"
     "            ze, zo = _decode_nibbles(raw_k, ks_a, kl_a, R_K_P2, BLOCK_N, DTYPE, not UPCAST, K_LOG8)\n"
     "            ks_a, kl_a = _token_scales(SK, LK, offs_n + BLOCK_N, end, stride_skn, True)\n"),
    (VALUES,
     "            if not PREFETCH:\n"
     "                raw_v = _fetch_bytes(ZV, offs_n, end, stride_vn, stride_vr, R_V, R_V_P2, MASKED, 4)\n"
     "                ve, vo = _decode_nibbles(raw_v, vs_a, vl_a, R_V_P2, BLOCK_N, DTYPE, not UPCAST, "
     "V_LOG8)\n"
     "                vs_a, vl_a = _token_scales(SV, LV, offs_n + BLOCK_N, end, stride_svn, True)\n"),
]
VARIANTS = {"default": [], "scales ahead": AHEAD}
R = 64
SHAPES = [(16, 16384), (4, 131072)]


def static_table(modules) -> None:
    from kernel_sass import compile_decode, report

    print(f"sm_90, post_rope decode over int4 nibbles, d = 128, GQA 4, r = {R}, block_n 256, no prefetch\n")
    print("| variant | registers | stack bytes | instructions in the kernel "
          "| instructions per loop iteration | top of the unmasked loop |")
    print("|---|---|---|---|---|---|")
    for name, module in modules.items():
        kernel = compile_decode("post_rope", R, 256, 4, 3, True, fn=module._lowrank_attn_fwd, bits=4,
                                nibbles=True)
        print(f"| {name} " + report(kernel), flush=True)


def timed_table(modules) -> None:
    import utils
    from bench_attention import kernel_call, latent_inputs, quantized, sdpa_decode_ms

    print(utils.header())
    copy = utils.copy_tbs()
    print(f"int4 token latents (r {R}, fp16 scale and low a token), post_rope, default configuration; device "
          "ms by CUDA-graph replay (p20 / p50 / p80)\n")
    print("| B×ctx | SDPA ms | " + " | ".join(f"{name} ms" for name in modules) + " | variant / default "
          "| max |Δ| against the default |")
    print("|---|---|" + "---|" * len(modules) + "---|---|")
    for B, N in SHAPES:
        sdpa = sdpa_decode_ms(B, N)["p50"]
        torch.manual_seed(0)
        x = latent_inputs(B, 1, N, R)
        x = dict(x, z_k=quantized(x["z_k"], 4), z_v=quantized(x["z_v"], 4))
        cells, outs = [], []
        with torch.no_grad():
            for module in modules.values():
                base = kernel_call(x, "post_rope")  # the variant's build, the same arguments
                call = functools.partial(module.lowrank_attention, *base.args, **base.keywords)
                outs.append(call().float())
                cells.append(utils.graph_ms(call))
        diff = float((outs[1] - outs[0]).abs().max())
        if not torch.isfinite(outs[1]).all() or diff > 1e-2 * float(outs[0].abs().max()):
            raise SystemExit(f"{B}x{N}: the variant's output is off the default's by {diff:.3g}: not timed")
        ms = [c["p50"] for c in cells]
        print(f"| {B}×{N // 1024}k | {sdpa:.4f} | "
              + " | ".join(f"{c['p20']:.4f} / {c['p50']:.4f} / {c['p80']:.4f}" for c in cells)
              + f" | {ms[1] / ms[0]:.3f} | {diff:.2e} |", flush=True)
    print(f"\ncopy bandwidth {copy:.2f} TB/s (the same run)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--static", action="store_true",
                        help="compile for sm_90 and count SASS (no GPU needed)")
    args = parser.parse_args()
    if not args.static and not torch.cuda.is_available():
        raise SystemExit("scales_ahead.py times CUDA kernels: run it on the GPU, or pass --static")
    with tempfile.TemporaryDirectory() as tmp:
        modules = {name: build(name, edits, pathlib.Path(tmp)) for name, edits in VARIANTS.items()}
        static_table(modules) if args.static else timed_table(modules)


if __name__ == "__main__":
    main()
