"""Where compaction's time goes: torch.profiler over AM's defaults on a few layers of Llama-3-8B shapes.

    python benchmarks/experiments/profile_compaction.py --tokens 32768 --layers 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_compaction_speed import SHAPES, compact_all  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rows", type=int, default=20)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    s = SHAPES["llama3-8b"]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, device=dev, dtype=torch.bfloat16)  # noqa: E731
    T = args.tokens
    keys = [make(1, s["kv_heads"], T, s["head_dim"]) for _ in range(args.layers)]
    values = [make(1, s["kv_heads"], T, s["head_dim"]) for _ in range(args.layers)]
    queries = [make(1, s["heads"], 1024, s["head_dim"]) for _ in range(args.layers)]
    compact_all(keys, values, queries, T // 10, s["head_dim"] ** -0.5)  # warm-up
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        compact_all(keys, values, queries, T // 10, s["head_dim"] ** -0.5)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
