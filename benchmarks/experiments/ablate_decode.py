"""Where the ``pre_rope`` decode kernel's time goes: time variants of it that leave one stage of the key loop
out, at the same shapes and configuration, and read each stage's cost from the differences.

    python benchmarks/experiments/ablate_decode.py           # CUDA: device time of each variant (CUDA graphs)
    python benchmarks/experiments/ablate_decode.py --static  # no GPU: compile for sm_90, registers, SASS

The variants are built from ``stiefkv/kernels/lowrank.py`` by replacing lines of ``_attend_range``, so they
always match the kernel in the tree; their outputs are wrong by design (only their time means something):
- ``no sin/cos``: ``sin, cos = angle, angle`` (no MUFU or polynomial; the rotation's arithmetic stays);
- ``no rotation``: the rebuilt halves go to the score dots unrotated (the positions, angles and sin/cos
  become dead code, so their loads go too);
- ``no rebuild``: the latents stand in for the rebuilt halves (needs ``r = d/2``), the two rebuild dots go;
- ``no rebuild, no rotation``: what is left is the ``post_rope``-like stream with ``d``-wide score dots.
Llama-3-8B heads (H = 32, G = 8, d = 128), bf16, 50 % (r = 64), int32 positions as the cache stores them.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import pathlib
import sys
import tempfile

import torch

SRC = pathlib.Path(__file__).resolve().parents[2] / "stiefkv" / "kernels" / "lowrank.py"
FAST = "        sin, cos = _sincos_fast(angle, FAST_SINCOS == 2)\n"
POLY = "        sin, cos = _sincos(angle)\n"
ROT = "    k1 = (a1 * cos - a2 * sin).to(dtype)\n    k2 = (a2 * cos + a1 * sin).to(dtype)\n"
REBUILD = (
    "        a1 = _dot(z, p1t, zero, DOT_PREC, UPCAST)  # [BLOCK_N, d/2]\n"
    "        a2 = _dot(z, p2t, zero, DOT_PREC, UPCAST)\n"
)
NO_SINCOS = [
    (FAST, "        sin, cos = angle, angle\n"),
    (POLY, "        sin, cos = angle, angle\n"),
]
NO_ROT = [(ROT, "    k1 = a1.to(dtype)\n    k2 = a2.to(dtype)\n")]
NO_REBUILD = [(REBUILD, "        a1 = z.to(tl.float32)\n        a2 = z.to(tl.float32)\n")]
VARIANTS = {
    "full": [],
    "no sin/cos": NO_SINCOS,
    "no rotation": NO_ROT,
    "no rebuild": NO_REBUILD,
    "no rebuild, no rotation": NO_REBUILD + NO_ROT,
}
H, G, D, R = 32, 8, 128, 64
SHAPES = [(1, 32768), (4, 131072)]


def build(name: str, edits, tmp: pathlib.Path):
    """The kernel module with ``edits`` applied, imported from a file of its own (Triton reads its source)."""
    src = SRC.read_text().replace("from .reference import", "from stiefkv.kernels.reference import")
    for old, new in edits:
        if old not in src:
            raise SystemExit(
                f"variant {name!r}: the kernel no longer contains {old.strip()!r}; update this script"
            )
        src = src.replace(old, new)
    path = tmp / f"variant_{len(list(tmp.iterdir()))}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def static_table(modules) -> None:
    from kernel_sass import compile_decode, report

    print("sm_90, decode, d = 128, GQA 4, r = 64, block_n 64, 4 warps, 3 stages, fast sin/cos\n")
    print(
        "| variant | registers | stack bytes | instructions in the kernel "
        "| instructions per loop iteration | "
        "top of the unmasked loop |"
    )
    print("|---|---|---|---|---|---|")
    for name, module in modules.items():
        kernel = compile_decode("pre_rope", R, 64, 4, 3, True, fn=module._lowrank_attn_fwd)
        print(f"| {name} " + report(kernel), flush=True)


def timed_table(modules) -> None:
    import utils

    print(utils.header())
    print(f"H={H}, G={G}, d={D}, r={R}, bf16, default configuration; device ms by CUDA-graph replay (p50)\n")
    print("| B×ctx | SDPA ms | " + " | ".join(f"{name} ms" for name in modules) + " |")
    print("|---|---|" + "---|" * len(modules))
    for B, N in SHAPES:
        q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, G, N, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)  # its own tensor: k passed as v too halves SDPA's bytes (so did run 1)
        sdpa = utils.graph_ms(
            functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v, enable_gqa=True)
        )["p50"]
        del k, v
        z_k = torch.randn(B, G, N, R, device="cuda", dtype=torch.bfloat16)
        z_v = torch.randn_like(z_k)
        P = utils.random_basis(G, D, R)
        pos = torch.arange(N, device="cuda", dtype=torch.int32)[None].expand(B, N).contiguous()
        rope = utils.rope_spec(D)
        cells = []
        with torch.no_grad():
            for module in modules.values():
                fn = functools.partial(
                    module.lowrank_attention,
                    q,
                    z_k,
                    z_v,
                    P,
                    None,
                    key_mode="pre_rope",
                    positions=pos,
                    rope=rope,
                )
                cells.append(utils.graph_ms(fn)["p50"])
        print(
            f"| {B}×{N // 1024}k | {sdpa:.4f} | " + " | ".join(f"{ms:.4f}" for ms in cells) + " |", flush=True
        )
        del z_k, z_v
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--static", action="store_true", help="compile for sm_90 and count SASS (no GPU needed)"
    )
    args = parser.parse_args()
    here = pathlib.Path(__file__).resolve().parent
    sys.path[:0] = [str(here), str(here.parent)]  # kernel_sass beside this file, utils one folder up
    with tempfile.TemporaryDirectory() as tmp:
        modules = {name: build(name, edits, pathlib.Path(tmp)) for name, edits in VARIANTS.items()}
        static_table(modules) if args.static else timed_table(modules)


if __name__ == "__main__":
    main()
