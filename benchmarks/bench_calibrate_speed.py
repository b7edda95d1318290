"""Wall time of `stiefkv.calibrate` with its defaults on a model of given shapes with random weights.

Default shapes are Llama-3-8B's (32 layers, hidden 4096, 32 query heads, 8 KV heads, d = 128, MLP 14336)
with 128 random sequences × 2048 tokens (issue: calibration speed). Random weights say nothing about
quality; only the time is reported, as a row of ``benchmarks/results/calibrate_speed.jsonl``.

    python benchmarks/bench_calibrate_speed.py --device cuda --dtype bfloat16
    python benchmarks/bench_calibrate_speed.py --model smollm2 --device cpu --dtype float32 --extra bits=16

With ``--model`` the real model (and its calibration data) replaces the random one: the time of
``stiefkv calibrate MODEL`` with the defaults and ``--extra``.
"""

from __future__ import annotations

import time

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

import stiefkv


def main() -> None:
    ap = utils.parser(__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="a real model (smollm2, a .gguf, a folder) instead of random weights")
    utils.add_llama_shape_args(ap)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--extra", default="", help="calibration keywords, e.g. steps=20,method=pca")
    args = ap.parse_args()
    utils.check_results_dir(ap)
    extra = utils.calibration_keywords(args.extra)  # a bad setting stops here, before any model is built
    print(utils.header(), flush=True)
    tok = seqs = None
    if args.model:
        model, tok = utils.load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    else:
        model = utils.random_llama(args, args.device, getattr(torch, args.dtype))
        seqs = torch.randint(0, model.config.vocab_size, (args.sequences, args.seq_len))
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    proj = stiefkv.calibrate(model, tok, sequences=seqs, **extra)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    shape = (f"L{args.layers} D{args.hidden} H{args.heads} G{args.kv_heads} {args.sequences}x{args.seq_len}"
             if not args.model else args.model)
    row = {
        "case": f"calibrate {shape} {args.dtype}" + (f" {args.device} {args.extra}" if args.model else ""),
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "intermediate": args.intermediate,
        "sequences": args.sequences,
        "seq_len": args.seq_len,
        "device": args.device,
        "dtype": args.dtype,
        "extra": extra,
        "method": proj.method,
        # the settings, not what calibration measured with them (per-layer profiles: ~250 kB a row)
        "settings": {k: v for k, v in proj.settings.items() if k not in ("profiles", "refine")},
        "seconds": seconds,
    }
    if args.model:  # the shape options were not used
        unused = ("layers", "hidden", "heads", "kv_heads", "intermediate", "sequences", "seq_len")
        row = {k: v for k, v in row.items() if k not in unused} | {"model": args.model}
    utils.write_rows("calibrate_speed", row)
    print(
        f"{row['case']}: {proj.method}, {proj.settings['allocation']}, {proj.settings['order']}, "
        f"steps {proj.settings['steps']} {extra}: {seconds:.1f} s",
        flush=True,
    )


if __name__ == "__main__":
    main()
