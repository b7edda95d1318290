"""Compressed-context perplexity of attention-matching compaction and the eviction baselines, one run.

Each chunk of WikiText-2 test is ``context + score`` tokens: the context is prefilled, its cache compacted
to ``keep`` of its tokens per KV head (``stiefkv.longcontext``), and the next ``score`` tokens are scored in
one forward on top of it, against the same chunk uncompressed. Methods: ``am`` (attention matching, with its
variants by ``--variants``), and the evictions ``attention`` (SnapKV-like: the most-attended keys of the
same reference queries), ``sink`` (StreamingLLM: 4 first + newest), ``recent`` (newest). One row per method
to ``benchmarks/results/compaction.jsonl`` (``STIEFKV_RESULTS_DIR`` elsewhere).

    python benchmarks/bench_compaction.py smollm2 --context 1024 --chunks 3 --device cpu
"""

from __future__ import annotations

import argparse
import time

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

import stiefkv
from stiefkv.longcontext import DEFAULT_WINDOW, evaluate_compacted

GLOBAL = {"allocation": "global", "pooling": "rms", "solver": "projected"}
VARIANTS = {
    "am": {}, "am projected": {"solver": "projected"}, "am omp": {"selection": "omp"}, "am no-beta": {"fit_beta": False},
    "am no-refit": {"refit_values": False}, "am rms": {"pooling": "rms"}, "am max": {"pooling": "max"},
    "am global": {"allocation": "global"}, "am global rms": {"allocation": "global", "pooling": "rms"},
    "am global rms projected": GLOBAL, "am global rms omp": {**GLOBAL, "selection": "omp"},
    "am global rms no-beta": {**GLOBAL, "fit_beta": False},
    "am global rms no-refit": {**GLOBAL, "refit_values": False},
    "am layers rms": {**GLOBAL, "allocation": "layers"},
    "am layers-max rms": {**GLOBAL, "allocation": "layers-max"},
    "attention global": {"allocation": "global"},
    "attention global rms": {"allocation": "global", "pooling": "rms"},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--score", type=int, default=512)
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--chunks", type=int, default=None, help="first N chunks (default: all)")
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW)
    ap.add_argument("--methods", default="am,attention,sink,recent")
    ap.add_argument("--variants", default="", help=f"comma-separated variants of {', '.join(VARIANTS)} ('_' for ' ')")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    print(utils.header(), flush=True)
    torch.set_grad_enabled(False)
    model, tok = stiefkv.load_model(args.model, device=args.device)
    runs = [(m, {}) for m in args.methods.split(",") if m] + [
        (v, VARIANTS[v]) for v in args.variants.replace("_", " ").split(",") if v]
    for name, options in runs:
        t0 = time.perf_counter()
        r = evaluate_compacted(model, tok, context=args.context, score=args.score, keep=args.keep,
                               method=name.split()[0], chunks=args.chunks, window=args.window, **options)
        row = {"case": f"{name} C{args.context} keep{args.keep:g}"
               + (f" chunks{args.chunks}" if args.chunks else "") + f" {args.device}",
               **r.as_dict(), "method": name, "options": options, "window": args.window,
               "seconds": time.perf_counter() - t0}
        utils.write_rows("compaction", row)
        print(f"{row['case']}: PPL {r.ppl:.3f} (uncompressed {r.ppl_full:.3f}), {r.kept_tokens} of "
              f"{args.context} tokens kept ({r.held_tokens:.0f} held), {r.chunks} chunks, "
              f"{row['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
