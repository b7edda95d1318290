"""Decode time against the key-split count at capacity batches (many programs an SM): does the split rule of
``_decode_splits`` leave a partial last round of programs where more splits would fill it?

    python benchmarks/experiments/split_probe.py --cases 43:112:2:channel 45:56:4:token

Each case is ``B:rank:bits:key_layout`` at 32k keys, Llama-3-8B heads; both key modes; the default
configuration, then each split count in ``--splits`` at each key tile in ``--block-n`` (the default tile
when none is given; ms, p50 of CUDA-graph replays). A 64-key tile over int4 ``pre_rope`` keys at r 56
compiles to 168 registers a thread (triton 3.6, ``kernel_sass.py --codes --block-n 64``), so three programs
fit an SM: ``--block-n 64 --splits 1 2 3 4 5 6`` asks whether that pays.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import utils  # noqa: E402
from bench_attention import MODES, G, H, default_config, kernel_call, latent_inputs, quantized  # noqa: E402

from stiefkv.kernels.lowrank import _num_sms, _token_int4  # noqa: E402


def probe(B: int, r: int, bits: int, layout: str, n: int, splits: list[int], tiles: list[int | None]) -> None:
    x = latent_inputs(B, 1, n, r)
    x = dict(x, z_k=quantized(x["z_k"], bits, layout=layout), z_v=quantized(x["z_v"], bits))
    sms = _num_sms(x["q"].device)
    with torch.no_grad():
        for mode in MODES:
            rule = default_config(B, n, mode, r, bits, _token_int4(x["z_k"]) and _token_int4(x["z_v"]),
                                  layout == "channel")["num_splits"]
            times = {"default": utils.graph_ms(kernel_call(x, mode))["p50"]}
            for tile in tiles:
                for s in splits:
                    key = s if tile is None else f"{tile} keys, {s}"
                    times[key] = utils.graph_ms(kernel_call(x, mode, num_splits=s, block_n=tile))["p50"]
            cells = ", ".join(f"{k}: {v:.4f}" for k, v in times.items())
            print(f"{B}x{n} r{r} int{bits} {layout} keys {mode} (H {H}, G {G}, {sms} SMs, default splits "
                  f"{rule}): {cells}", flush=True)
    del x
    torch.cuda.empty_cache()


def probe_case(text: str) -> str:
    """``ROWS:RANK:BITS:LAYOUT`` of ``--cases`` (``45:56:4:token``), checked as the arguments are parsed, so
    a typo in the last case no longer waits for the cases before it on the GPU."""
    parts = text.split(":")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts[:3]) or parts[2] not in (
            "2", "3", "4", "8") or parts[3] not in ("token", "channel"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected ROWS:RANK:BITS:LAYOUT, e.g. 45:56:4:token "
                                         "(bits 2, 3, 4 or 8; layout token or channel)")
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", type=probe_case, default=["43:112:2:channel", "45:56:4:token"],
                        metavar="ROWS:RANK:BITS:LAYOUT")
    parser.add_argument("--context", type=utils.at_least(1), default=32768)
    parser.add_argument("--splits", type=utils.at_least(1), nargs="+", default=[1, 2, 3, 4])
    parser.add_argument("--block-n", type=int, nargs="+", default=[None])
    args = parser.parse_args()
    for case in args.cases:
        B, r, bits, layout = case.split(":")
        probe(int(B), int(r), int(bits), layout, args.context, args.splits, args.block_n)


if __name__ == "__main__":
    main()
