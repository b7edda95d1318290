"""Where AM compaction's wall time goes, stage by stage, at Llama-3-8B shapes (random bf16 tensors), and
what other linear solves would cost: every stage timed between device synchronisations.

    python benchmarks/experiments/compaction_stages.py --tokens 32768
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_compaction_speed import SHAPES  # noqa: E402

from stiefkv import compaction as C  # noqa: E402


def _sync_time(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


# name: (the fits' logits dtype, how CUDA solves: all matrices together, or one Cholesky per matrix as before)
VARIANTS = {"fp64-each": (torch.float64, C._solve_each), "fp64": (torch.float64, C._solve_batched),
            "fp32-each": (torch.float32, C._solve_each), "fp32": (torch.float32, C._solve_batched)}
DEFAULTS = (C.FIT_LOGITS, C._solve_batched)


def run(tokens: int, keep: float, window: int, variant: str, layers: int) -> dict:
    s = SHAPES["llama3-8b"]
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    keys = [make(1, s["kv_heads"], tokens, s["head_dim"]) for _ in range(layers)]
    values = [make(1, s["kv_heads"], tokens, s["head_dim"]) for _ in range(layers)]
    queries = [make(1, s["heads"], window, s["head_dim"]) for _ in range(layers)]
    scale = s["head_dim"] ** -0.5
    t = round(keep * tokens)
    C.FIT_LOGITS, C._solve_batched = VARIANTS[variant]
    opts = C.effective_options("am", {})
    opts.pop("allocation")
    pooling = opts["pooling"]
    times = {}
    scores, times["scores"] = _sync_time(lambda: [C.layer_scores(k, q, scale, pooling)
                                                  for k, q in zip(keys, queries)])
    budgets, times["budgets"] = _sync_time(lambda: C.global_budgets(
        keys, queries, t, scales=[scale] * layers, pooling=pooling, heads="max", scores=scores))
    outs, times["fits"] = _sync_time(lambda: [
        C.compact_layer(k, v, q, b, scale=scale, scores=sc, **opts)
        for k, v, q, b, sc in zip(keys, values, queries, budgets, scores)])
    times["total"] = sum(times.values())
    C.FIT_LOGITS, C._solve_batched = DEFAULTS
    return {"variant": variant, "tokens": tokens, "layers": layers,
            **{k: round(v, 3) for k, v in times.items()},
            "beta": outs[-1][1].float(), "values": outs[-1][2].float()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    ref = None
    for variant in args.variants.split(","):
        run(4096, args.keep, args.window, variant, 2)  # warm-up
        row = run(args.tokens, args.keep, args.window, variant, args.layers)
        beta, values = row.pop("beta"), row.pop("values")
        if ref is None:
            ref = beta, values
        row["max_dbeta"] = float((beta - ref[0]).abs().max())
        row["max_dvalues"] = float((values - ref[1]).abs().max())
        print(row, flush=True)


if __name__ == "__main__":
    main()
