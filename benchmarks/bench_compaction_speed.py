"""Compaction time against context length, all layers of a model's shapes (issue 15's speed target: 32k tokens
of Llama-3-8B shapes in ≤ 2 s on the H200).

Random keys, values and reference queries at the model's shapes stand in for a prefilled cache (the time
does not depend on the weights): per layer ``[1, G, T, d]`` keys and values and ``[1, H, window, d]``
queries, bf16 on the device, and a random surprise per token for ``pin``. Timed: the choice of the pinned
tokens and :func:`stiefkv.compacted.compact_pinned` (what ``stiefkv.compact`` runs after the prefill) with
AM's defaults (``--block`` another block, ``--pin`` another share), synchronised, the best of ``--repeat``
after one warm-up; and the peak memory above the inputs.
One row per length to ``benchmarks/results/compaction_speed.jsonl``.

    python benchmarks/bench_compaction_speed.py --lengths 4096,8192,16384,32768 --device cuda
"""

from __future__ import annotations

import sys
import time

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

from stiefkv.compacted import DEFAULT_PIN, compact_pinned, most_surprising, pin_count
from stiefkv.compaction import AM_DEFAULTS

SHAPES = {"llama3-8b": dict(layers=32, heads=32, kv_heads=8, head_dim=128),
          "smollm2": dict(layers=30, heads=9, kv_heads=3, head_dim=64),
          "tiny": dict(layers=2, heads=4, kv_heads=2, head_dim=16)}


def synced(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def compact_all(keys, values, queries, t: int, scale: float, surprise: torch.Tensor, pin: float | None,
                **options) -> None:
    p = pin_count(pin, t, "am")
    pins = most_surprising(surprise, p) if p else None
    for _ in compact_pinned(list(keys), values, queries, t, pins, scales=[scale] * len(keys), **options):
        pass


def main() -> None:
    ap = utils.parser(__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default llama3-8b")
    ap.add_argument("--lengths", type=utils.comma_list(utils.at_least(1)), default=[4096, 8192, 16384, 32768])
    ap.add_argument("--keep", type=utils.share, default=0.1)
    ap.add_argument("--window", type=utils.at_least(1), default=1024)
    ap.add_argument("--repeat", type=utils.at_least(1), default=3, help="timed runs after a warm-up one")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--block", default="default",
                    help="AM's block in tokens: 'default' (AM_DEFAULTS), 'none' (the whole layer), or N")
    ap.add_argument("--pin", default="default",
                    help="the share of the kept entries held exact: 'default' (AM's), or a share (0: none)")
    args = ap.parse_args()
    utils.check_results_dir(ap)
    if args.device.startswith("cuda"):
        utils.require_cuda("--device cpu times the PyTorch path here")
    elif args.shape is None:
        sys.exit(f"no CUDA device: the default --shape llama3-8b up to {max(args.lengths)} tokens is a "
                 "GPU benchmark; give --shape tiny, or name --shape to run it on the CPU anyway")
    args.shape = args.shape or "llama3-8b"
    print(utils.header(), flush=True)
    torch.set_grad_enabled(False)
    s = SHAPES[args.shape]
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    g = torch.Generator(device=args.device).manual_seed(0)
    options = {} if args.block == "default" else {"block": None if args.block == "none" else int(args.block)}
    label = "" if args.block == "default" else f" block {args.block}"
    pin = None if args.pin == "default" else float(args.pin)
    label += "" if pin is None else f" pin{pin:g}"
    resolved = DEFAULT_PIN if pin is None else pin
    for T in args.lengths:
        make = lambda *shape: torch.randn(*shape, generator=g, device=args.device, dtype=dtype)  # noqa: E731
        keys = [make(1, s["kv_heads"], T, s["head_dim"]) for _ in range(s["layers"])]
        values = [make(1, s["kv_heads"], T, s["head_dim"]) for _ in range(s["layers"])]
        queries = [make(1, s["heads"], min(args.window, T), s["head_dim"]) for _ in range(s["layers"])]
        surprise = torch.rand(1, T, generator=g, device=args.device)
        t = max(1, round(args.keep * T))
        scale = s["head_dim"] ** -0.5
        if args.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        times = []
        for _ in range(args.repeat + 1):
            t0 = synced(args.device)
            compact_all(keys, values, queries, t, scale, surprise, pin, **options)
            times.append(synced(args.device) - t0)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if args.device.startswith("cuda") else None
        row = {"case": f"{args.shape} T{T} keep{args.keep:g}{label} {args.device}", "shape": args.shape,
               "tokens": T, "keep": args.keep, "window": args.window,
               "options": {**AM_DEFAULTS, **options, "pin": resolved},
               "seconds": min(times[1:]), "seconds_all": times, "peak_gib_above_inputs": peak}
        utils.write_rows("compaction_speed", row)
        print(f"{row['case']}: {row['seconds']:.2f} s (runs {', '.join(f'{x:.2f}' for x in times)}), "
              f"peak {peak if peak is None else f'{peak:.1f} GiB'}", flush=True)


if __name__ == "__main__":
    main()
