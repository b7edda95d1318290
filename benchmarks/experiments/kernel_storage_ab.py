"""``calibrate(kernel_storage=True)`` (only the storages the decode kernel reads in place: per-token codes, no
exact window) against the default ``--bits auto`` at the same budgets, on the CPU: a short calibration
(16 × 128 tokens) and the first test windows, each configuration's PPL and next-token KL.

    python benchmarks/experiments/kernel_storage_ab.py --budgets 0.125,0.25 --windows 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import stiefkv
from stiefkv.evaluate import evaluate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import utils  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--budgets", type=utils.comma_list(utils.share), default=[0.125, 0.25])
    ap.add_argument("--windows", type=utils.at_least(1), default=3)
    args = ap.parse_args()
    model, tok = stiefkv.load_model(args.model)
    for budget in args.budgets:
        for kernel_storage in (False, True):
            start = time.time()
            proj = stiefkv.calibrate(model, tok, budget=budget, seq_len=128, num_sequences=16,
                                     kernel_storage=kernel_storage)
            took = time.time() - start
            r = evaluate(model, tok, proj, limit=args.windows, layer_errors=False)
            storages = sorted({str(q) for pair in proj.specs for q in pair})
            print(f"budget {budget} kernel_storage {kernel_storage}: calibration {took:.0f} s, "
                  f"PPL {r.ppl:.3f} (uncompressed {r.ppl_original:.3f}), KL {r.next_token_kl:.4f}, achieved "
                  f"{proj.achieved_budget:.4f}, storages {storages}", flush=True)


if __name__ == "__main__":
    main()
