"""How well the ``kl`` profile's predicted storages stand in for measured ones (issue 13, calibration time).

With ``profile_storages="anchors"`` the ``kl`` profile measures the model's next-token KL at full rank only
for the anchor widths (int2, int4) of each layout and predicts int3 and int8 from their quantization noise
(``calibrate.profile.predict_storage_kl``).
This runs the first pass twice on the same sequences — every storage measured, then the anchors only — and
prints the predicted against the measured KL of every predicted storage, and, at each Pareto budget, how many
latents the knapsack allocates differently and what each allocation costs by the *measured* profile.

    python benchmarks/experiments/storage_kl_prediction.py smollm2 --device cpu
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

import stiefkv
from stiefkv.calibrate.allocate import storage_dp
from stiefkv.calibrate.pipeline import CalibrationConfig, first_pass, storages
from stiefkv.calibrate.profile import LayerProfile
from stiefkv.calibrate.state import CalibrationState
from stiefkv.data import calibration_sequences
from stiefkv.models import dims_of, fingerprint

BUDGETS = (0.5, 0.25, 0.1875, 0.125, 0.09375, 0.0625)


def profiles(model, seqs, cfg) -> tuple[list[LayerProfile], float]:
    state = CalibrationState(settings={}, fingerprint=fingerprint(model))
    t0 = time.perf_counter()
    first_pass(model, seqs, cfg, state)
    return [LayerProfile(**p) for p in state.profiles], time.perf_counter() - t0


def cost(profs, which_choice) -> float:
    """Summed measured KL of an allocation ``(ranks, specs)`` under the profiles ``profs``."""
    ranks, specs = which_choice
    total = 0.0
    for prof, (rk, rv), (sk, sv) in zip(profs, ranks, specs):
        for which, r, s in (("k", rk, sk), ("v", rv, sv)):
            errs = prof.quant[which][str(s)] if s.quantized else getattr(prof, which)
            total += errs[prof.ranks.index(r)]
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--extra", default="", help="calibration keywords, e.g. seq_len=128,num_sequences=16")
    args = ap.parse_args()
    extra = dict(kv.split("=") for kv in args.extra.split(",") if kv)
    extra = {k: int(v) if v.isdigit() else v for k, v in extra.items()}
    model, tok = stiefkv.load_model(args.model, device=args.device)
    # one exact window for every budget: the profiles measure it (the default's is 8 below a budget of 0.1)
    extra.setdefault("recent", 16)
    cfg = CalibrationConfig.from_kwargs(device=args.device, bits="auto", **extra)
    seqs = calibration_sequences(model, tok, data=cfg.data, num_sequences=cfg.num_sequences,
                                 seq_len=cfg.seq_len, seed=cfg.seed)
    measured, t_all = profiles(model, seqs, cfg)
    predicted, t_anchor = profiles(model, seqs, replace(cfg, profile_storages="anchors"))
    print(f"first pass: every storage measured {t_all:.0f} s, anchors only {t_anchor:.0f} s")
    ratios = {}
    for m, p in zip(measured, predicted):
        for which in ("k", "v"):
            for name, errs in p.quant[which].items():
                true = m.quant[which][name][-1]
                if "int3" in name or "int8" in name:
                    ratios.setdefault(name.split("-")[0] + "-" + name.split("-")[1], []).append(
                        errs[-1] / true if true > 0 else float("nan"))
    for name, rs in sorted(ratios.items()):
        rs = [r for r in rs if r == r]
        print(f"{name}: predicted / measured KL at full rank, median {statistics.median(rs):.2f}, "
              f"range {min(rs):.2f}–{max(rs):.2f} over {len(rs)} latents")
    dims = dims_of(model.config)
    for b in BUDGETS:
        c = CalibrationConfig.from_kwargs(device=args.device, bits="auto", budget=b, **extra)
        a = storage_dp(measured, b, dims.G, dims.d, c.rank_step, storages(c))
        q = storage_dp(predicted, b, dims.G, dims.d, c.rank_step, storages(c))
        differ = sum((a[0][i][j], a[1][i][j]) != (q[0][i][j], q[1][i][j])
                     for i in range(dims.L) for j in range(2))
        print(f"budget {b:g}: {differ} of {2 * dims.L} latents allocated differently; measured KL of the "
              f"allocation from measured profiles {cost(measured, a):.4f}, from "
              f"predicted {cost(measured, q):.4f}")


if __name__ == "__main__":
    main()
