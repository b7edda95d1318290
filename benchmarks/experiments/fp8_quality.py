"""Would fp8 (e4m3) codes cost quality where ``--bits auto`` stores int8? Not built.

``fp8_decode_probe.py`` found e4m3 latents decoded at full rank in 0.74x bf16's time against int8's 1.05x
(the hardware converts e4m3; int8 needs a multiply-add a channel). This patches the fake quantizer that
calibration (profiles, refinement) and evaluation apply: every 8-bit token-layout storage (int8 min-max,
int8 log8, and the int8 exact window ``-w8``) becomes e4m3 codes per token and group of 64 channels (or, with
``--scale-per-token``, one group of all the token's channels: the format ``fp8_decode_probe.py`` timed), with
the group's absolute maximum mapped to 448 — by an fp16 scale where int8 kept an fp16 scale and low (fewer
bytes), and by a power-of-two scale (one byte, as MX formats store it) where int8 kept a log8 byte (the same
bytes). The byte accounting is not patched. Arms, each on the same test windows:

- the quantization-only caches ``--baselines`` (``stiefkv eval --baseline``), int8 then e4m3;
- ``--bits auto`` calibrated at ``--budgets`` with the patch off, then on (the allocation sees e4m3's noise).

    python benchmarks/experiments/fp8_quality.py MODEL [--windows 3] [--budgets 0.5] [--baselines int8-r0]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

import stiefkv
from stiefkv import quant
from stiefkv.evaluate import BASELINES, baseline_projections, evaluate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import utils  # noqa: E402

PLAIN_ROUND_TRIP = quant.round_trip
FP8_MAX = 448.0
WHOLE_TOKEN = False  # --scale-per-token: one scale over all of a token's channels, as fp8_decode_probe times


def fp8_round_trip(x: torch.Tensor, spec: quant.QuantSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """:func:`stiefkv.quant.round_trip` with 8-bit token-layout storages as e4m3 codes (see the docstring)."""
    if not (spec.bits == 8 and spec.layout == "token" and not spec.mse):
        return PLAIN_ROUND_TRIP(x, spec, dtype)
    r = x.shape[-1]
    g, _, _ = quant._group_range(x, "token")  # the int8 quantizer's groups, a short last one padded
    if WHOLE_TOKEN:
        g = g.flatten(-2).unsqueeze(-2)
    big = g.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -24)
    if spec.log8:  # one byte: a power of two at or above absmax / 448
        scale = torch.exp2(torch.ceil(torch.log2(big / FP8_MAX)))
    else:
        # rounded to fp16 (the largest code clips by < 2^-11 where it rounds down), and never to 0: a
        # group whose maximum is below fp16's range would divide 0 by 0
        scale = (big / FP8_MAX).half().float().clamp_min(2.0 ** -24)
    codes = (g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    out = (codes * scale).flatten(-2)[..., :r]
    return out.to(x.dtype if dtype is None else dtype)


def patch(on: bool) -> None:
    quant.round_trip = fp8_round_trip if on else PLAIN_ROUND_TRIP


def line(label: str, r, extra: str = "") -> str:
    return (f"{label}: PPL {r.ppl:.3f} (uncompressed {r.ppl_original:.3f}), next-token KL "
            f"{r.next_token_kl:.4f}, {r.windows} windows{extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--budgets", type=utils.share, nargs="*", default=[0.5])
    ap.add_argument("--baselines", nargs="*", default=["int8-r0", "int8"], choices=sorted(BASELINES),
                    metavar="BASELINE")
    ap.add_argument("--windows", type=utils.at_least(1), default=None)
    ap.add_argument("--e4m3-only", action="store_true", help="calibrated arms with the patch on only")
    ap.add_argument("--scale-per-token", action="store_true",
                    help="one e4m3 scale over all of a token's channels, not one per 64 (the probe's format)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--extra", default="", help="calibration keywords, e.g. seq_len=128,num_sequences=16")
    args = ap.parse_args()
    extra = utils.calibration_keywords(args.extra)  # a bad setting stops here, before the model loads
    global WHOLE_TOKEN
    WHOLE_TOKEN = args.scale_per_token
    model, tok = stiefkv.load_model(args.model, device=args.device)
    try:
        for name in args.baselines:
            for on in (False, True):
                patch(on)
                with torch.no_grad():
                    r = evaluate(model, tok, baseline_projections(model, name), limit=args.windows,
                                 layer_errors=False)
                print(line(f"baseline {name} {'e4m3' if on else 'int8'}", r), flush=True)
        for budget in args.budgets:
            for on in (True,) if args.e4m3_only else (False, True):
                patch(on)
                t = time.perf_counter()
                proj = stiefkv.calibrate(model, tok, budget=budget, **extra)
                took = time.perf_counter() - t
                with torch.no_grad():
                    r = evaluate(model, tok, proj, limit=args.windows, layer_errors=False)
                storages = sorted({str(s) for pair in proj.specs for s in pair})
                print(line(f"auto {budget} {'e4m3' if on else 'int8'}", r,
                           f", calibration {took:.0f} s, storages {storages}"), flush=True)
    finally:
        patch(False)


if __name__ == "__main__":
    main()
