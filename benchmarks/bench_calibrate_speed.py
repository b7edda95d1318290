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

import argparse
import time

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path
from transformers import LlamaConfig, LlamaForCausalLM

import stiefkv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="a real model (smollm2, a .gguf, a folder) instead of random weights")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--sequences", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--extra", default="", help="calibration keywords, e.g. steps=20,method=pca")
    args = ap.parse_args()
    print(utils.header(), flush=True)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=8192,
    )
    tok = seqs = None
    if args.model:
        model, tok = stiefkv.load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    else:
        with torch.device(args.device):
            model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
        seqs = torch.randint(0, config.vocab_size, (args.sequences, args.seq_len))
    extra = dict(kv.split("=") for kv in args.extra.split(",") if kv)
    extra = {k: (float(v) if "." in v else int(v) if v.isdigit() else v) for k, v in extra.items()}
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
        "settings": proj.settings,
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
