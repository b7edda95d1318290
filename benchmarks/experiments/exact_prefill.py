"""Does a prompt prefilled exactly (its own keys and values at full precision, only their latents stored)
lose less than one prefilled over its latents? SmolLM2, chunks of WikiText-2 test: prefill C tokens, score the
next S in one forward over the latent cache, with and without AM compaction of the context, both ways.

    python benchmarks/experiments/exact_prefill.py MODEL P.safetensors [P2 ...] [--chunks 12] [--context 4096]

Prints one JSON line per checkpoint (PPLs over the chunks' scored tokens) and writes them to
``$STIEFKV_RESULTS_DIR/exact_prefill.jsonl`` when that is set.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from stiefkv.attention import Switch
from stiefkv.cache import LatentCache, cache_keyword
from stiefkv.evaluate import load_test_windows
from stiefkv.longcontext import _nll, chunk_nll
from stiefkv.models import load_model
from stiefkv.projections import Projections


def split_nll(model, ids: torch.Tensor, context: int) -> float:
    """The scored tokens' summed NLL after a prefill of the context into a latent cache."""
    cache = LatentCache()
    model(ids[:, :context], **{cache_keyword(model): cache})
    positions = torch.arange(context, ids.shape[1], device=ids.device)[None]
    logits = model(ids[:, context:], position_ids=positions, **{cache_keyword(model): cache}).logits
    return _nll(logits[:, :-1], ids[:, context + 1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("projections", nargs="+")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--score", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=12)
    ap.add_argument("--keep", type=float, default=0.1)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_model(args.model, device=device)
    windows = load_test_windows(tok, window=args.context + args.score, limit=args.chunks)
    for path in args.projections:
        switch = Switch(model, Projections.load(path))
        sums: dict[str, float] = {}
        n = 0
        t0 = time.time()
        for w in windows:
            ids = w[None].to(device)
            with torch.no_grad():
                for exact in (False, True):
                    for m in switch.modules:
                        m.exact_prefill = exact
                    tag = "exact" if exact else "latent"
                    with switch:
                        nll = split_nll(model, ids, args.context)
                    sums[f"split_{tag}"] = sums.get(f"split_{tag}", 0.0) + nll
                    a, b, k, _, _, r = chunk_nll(model, ids, args.context, args.keep, "am", served=switch)
                    sums[f"am_{tag}"] = sums.get(f"am_{tag}", 0.0) + a
                    if not exact:  # an exact prefill's whole forward is the uncompressed model's
                        sums["ranks_whole"] = sums.get("ranks_whole", 0.0) + r
                sums["full"] = sums.get("full", 0.0) + b
                n += k
        row = {"projections": os.path.basename(path), "chunks": len(windows), "context": args.context,
               "keep": args.keep, "seconds": round(time.time() - t0, 1),
               **{key: round(math.exp(v / n), 3) for key, v in sums.items()}}
        print(json.dumps(row), flush=True)
        out = os.environ.get("STIEFKV_RESULTS_DIR")
        if out:
            with open(os.path.join(out, "exact_prefill.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
