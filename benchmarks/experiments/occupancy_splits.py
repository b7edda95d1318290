"""Which decode launches take more key splits than the rule (``lowrank._occupancy_splits``), without timing:
for Llama-3-8B's and SmolLM2's attention shapes, batch × context, ranks, latent widths and key modes, the
rule's split count, the programs an SM the compiled kernel fits, and the count launched. Needs CUDA (the
count comes from the compiled kernel).

    python benchmarks/experiments/occupancy_splits.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_attention as ba  # noqa: E402

from stiefkv.kernels import lowrank as lk  # noqa: E402

CASES = {"llama8b": [(1, 32768), (8, 8192), (16, 16384), (4, 131072), (43, 32768)],
         "smollm2": [(8, 8192), (16, 8192), (32, 8192), (40, 8000)]}


def main() -> None:
    print("| heads | B×N | r | latents | key mode | rule | programs an SM | launched |")
    print("|---|---|---|---|---|---|---|---|")
    for heads, shapes in CASES.items():
        ba.H, ba.G, ba.D_HEAD, _ = ba.HEADS[heads]
        for B, N in shapes:
            for r in (32, 64):
                x = ba.latent_inputs(B, 1, N, r)
                for bits in (16, 8, 4, 3, 2):
                    xq = x if bits == 16 else dict(x, z_k=ba.quantized(x["z_k"], bits),
                                                   z_v=ba.quantized(x["z_v"], bits))
                    for mode in ba.MODES:
                        rule = ba.default_config(B, N, mode, r, bits, lk._token_int4(xq["z_k"])
                                                 and lk._token_int4(xq["z_v"]))["num_splits"]
                        lk._RESIDENT.clear()  # so that the one entry left is this launch's (if counted)
                        launched = ba.launched_splits(xq, mode)
                        resident = list(lk._RESIDENT.values())
                        name = "bf16" if bits == 16 else f"int{bits}"
                        print(f"| {heads} | {B}×{N} | {r} | {name} | {mode} | {rule} | "
                              f"{resident[-1] if resident else '–'} | {launched}"
                              f"{' **more**' if launched != rule else ''} |", flush=True)
                del x
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
