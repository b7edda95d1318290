"""Would a quantized cache gain from keeping its first tokens (the attention sink) exact? Not built yet.

Patches the fake quantizer the compressed attention applies in an evaluation so that the first ``S`` tokens
of every quantized latent stay exact and are left out of their group's range (a per-channel group's min and
max are those of its other tokens), then scores the WikiText-2 test windows at each ``S``. Calibration is
not patched: a checkpoint's allocation is the one made without exact sink tokens. Bytes are not counted
here; one exact token of a 2048-token window adds 2 · rank bytes over 2048 tokens per latent.

    python benchmarks/experiments/exact_sink.py MODEL --sinks 0,1,4 --windows 4 ckpt.safetensors kivi2
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import stiefkv
import stiefkv.attention as attention
from stiefkv import quant
from stiefkv.evaluate import BASELINES, baseline_projections, evaluate
from stiefkv.projections import Projections

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import utils  # noqa: E402

PLAIN = quant.fake_quant


def sink_fake_quant(sink: int):
    def fake_quant(x, spec, *, straight_through=False):
        if not spec.quantized or sink == 0 or x.shape[-2] <= sink:
            return PLAIN(x, spec, straight_through=straight_through)
        y = x.clone()
        y[..., :sink, :] = x[..., sink:sink + 1, :]  # a copy of a group member: the range is the others'
        out = PLAIN(y, spec, straight_through=straight_through)
        out[..., :sink, :] = x[..., :sink, :]
        return out
    return fake_quant


def check_caches(parser: argparse.ArgumentParser, caches: list[str]) -> None:
    """Every cache named is a checkpoint file that exists or a known baseline, checked before the model
    loads: a typo in the last one used to fail after the ones before it had been scored."""
    for what in caches:
        if what.endswith(".safetensors"):
            if not Path(what).is_file():
                parser.error(f"{what}: no such checkpoint file")
        elif what not in BASELINES:
            parser.error(f"{what}: neither a checkpoint (.safetensors) nor a baseline "
                         f"({', '.join(sorted(BASELINES))})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("caches", nargs="+",
                    help=f"checkpoints (.safetensors) or baselines ({', '.join(BASELINES)})")
    ap.add_argument("--sinks", type=utils.comma_list(utils.at_least(0)), default=[0, 1, 4])
    ap.add_argument("--windows", type=utils.at_least(1), default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    check_caches(ap, args.caches)
    torch.set_grad_enabled(False)
    model, tok = stiefkv.load_model(args.model, device=args.device)
    for what in args.caches:
        proj = Projections.load(what) if what.endswith(".safetensors") else baseline_projections(model, what)
        for sink in args.sinks:
            attention.fake_quant = sink_fake_quant(sink)
            t = time.perf_counter()
            r = evaluate(model, tok, proj, limit=args.windows, layer_errors=False)
            took = time.perf_counter() - t
            print(f"{what} sink {sink}: PPL {r.ppl:.3f} (uncompressed {r.ppl_original:.3f}), "
                  f"next-token KL {r.next_token_kl:.4f}, {r.windows} windows, {took:.0f} s", flush=True)
    attention.fake_quant = PLAIN


if __name__ == "__main__":
    main()
