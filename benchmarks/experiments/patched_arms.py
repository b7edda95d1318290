"""The command line of the experiments that patch calibration and evaluation (``shared_log8.py``; the int8
window's ``int8_window.py``, removed once built as ``window8``, used it too): calibrate with the patch on
(and, with ``--control``, off, in the same process), score the WikiText-2 test windows, print one line
each."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import stiefkv
from stiefkv.evaluate import evaluate


def run(doc: str, patch: Callable[[bool], None], names: tuple[str, str], *, setup=None) -> None:
    """``patch(on)`` switches the experiment's patches; ``names`` label the arms (on, off); ``setup(model)``,
    if given, runs once after the model loads (e.g. to read its shapes)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--budget", type=float, default=0.0625)
    ap.add_argument("--control", action="store_true", help="also calibrate and score without the patches")
    ap.add_argument("--windows", type=int, default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--extra", default="", help="calibration keywords, e.g. seq_len=128,num_sequences=16")
    args = ap.parse_args()
    extra = {}
    for item in filter(None, args.extra.split(",")):
        key, value = item.split("=")
        extra[key] = int(value) if value.isdigit() else value
    model, tok = stiefkv.load_model(args.model, device=args.device)
    if setup is not None:
        setup(model)
    try:
        for on in ([True, False] if args.control else [True]):
            patch(on)
            t = time.perf_counter()
            proj = stiefkv.calibrate(model, tok, budget=args.budget, **extra)
            took = time.perf_counter() - t
            with torch.no_grad():
                r = evaluate(model, tok, proj, limit=args.windows, layer_errors=False)
            storages = sorted({str(s) for pair in proj.specs for s in pair})
            print(f"budget {args.budget} {names[0] if on else names[1]}: PPL {r.ppl:.3f} "
                  f"(uncompressed {r.ppl_original:.3f}), next-token KL {r.next_token_kl:.4f}, "
                  f"{r.windows} windows, bytes {proj.kv_bytes_per_token():.0f} / token, "
                  f"calibration {took:.0f} s, storages {storages}", flush=True)
    finally:
        patch(False)
