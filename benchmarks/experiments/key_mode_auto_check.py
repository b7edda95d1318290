"""PPL and next-token KL of checkpoints on the first test windows, without per-layer errors: how
``--key-mode auto`` was compared with the default key mode (``docs/notes/quantized-latents.md``).

    stiefkv calibrate smollm2 -o .ck/a50pre.safetensors
    stiefkv calibrate smollm2 --key-mode auto -o .ck/a50auto.safetensors
    python benchmarks/experiments/key_mode_auto_check.py --windows 12 \
        .ck/a50auto.safetensors .ck/a50pre.safetensors
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import stiefkv
from stiefkv.evaluate import evaluate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoints", nargs="+")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--windows", type=int, default=12)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = stiefkv.load_model(args.model, projections=False)
    for path in args.checkpoints:
        proj = stiefkv.Projections.load(path)
        t0 = time.perf_counter()
        r = evaluate(model, tok, proj, limit=args.windows, layer_errors=False)
        print(json.dumps({"ckpt": path, "key_mode": proj.key_mode_summary, "windows": r.windows,
                          "ppl_original": round(r.ppl_original, 4), "ppl": round(r.ppl, 4),
                          "next_token_kl": round(r.next_token_kl, 5),
                          "kv_bytes_per_token": r.kv_bytes_per_token,
                          "s": round(time.perf_counter() - t0)}), flush=True)


if __name__ == "__main__":
    main()
