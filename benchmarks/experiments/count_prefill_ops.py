"""The PyTorch operators one prefill forward calls from Python on the GPU's path, counted on the CPU: the
Triton backend under the interpreter with every kernel launch stubbed out (so only the Python side runs) and
the write kernels on, as CUDA takes them. For the question of where a host-bound prefill's launches come from
when no GPU is at hand (serving.md, 2026-12-06 fifth session); views count too, so the total is above the
GPU's kernel count. Not a timing.

    TRITON_INTERPRET=1 python benchmarks/experiments/count_prefill_ops.py [--store "int2 w8 (auto's kinds)"]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import profile_serve_step as pss  # noqa: E402
from bench_serve import SHAPES, fill_synthetic  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import stiefkv  # noqa: E402
from stiefkv import static_cache  # noqa: E402
from stiefkv.serve import Runner, make_cache  # noqa: E402


def stub_kernels() -> None:
    """Every Triton launch a no-op: the interpreter's functions return at once."""
    import triton.runtime.interpreter as interpreter

    interpreter.InterpretedFunction.run = lambda self, *args, **kwargs: None


def operators_by_function(forward) -> dict[str, int]:
    """Operators called from Python (not from inside another operator), by the stiefkv function calling
    them (``profile_serve_step.operator_sites``, lines merged)."""
    counts: dict[str, int] = defaultdict(int)
    for (site, _), n in pss.operator_sites(forward).items():  # site: "file.py(line): function"
        counts[f"{site.split('(')[0]}: {site.rsplit(': ', 1)[-1]}" if "(" in site else site] += n
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="smollm2", choices=sorted(SHAPES))
    ap.add_argument("--store", default="int2 w8 (auto's kinds)", choices=sorted(pss.STORES))
    ap.add_argument("--key-mode", default="pre_rope", choices=["pre_rope", "post_rope"])
    ap.add_argument("--context", type=int, default=200, help="tokens held before the forward")
    ap.add_argument("--tokens", type=int, default=128, help="tokens the forward takes (one row)")
    ap.add_argument("--rows", type=int, default=30, help="functions listed")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("the kernels' Python side runs on the CPU only under Triton's interpreter: "
                 "set TRITON_INTERPRET=1")
    stub_kernels()
    static_cache.FUSED_WRITES = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape][1])).to(torch.bfloat16).eval()
    store = pss.STORES[args.store]
    stiefkv.load(model, pss.projections(model, store, 0.5, args.key_mode), backend="triton")
    N, n = args.context, args.tokens
    runner = Runner(model, make_cache(model, 1, N + n), None)
    fill_synthetic(runner.cache, N)
    ids = torch.zeros(1, n, dtype=torch.long)
    positions = torch.arange(N, N + n)[None]

    def forward() -> None:
        runner.cache.filled.fill_(N)
        runner.cache.seen = N
        runner.forward(ids, positions, positions[0])

    with torch.inference_mode():
        forward()
        counts = operators_by_function(forward)
    layers = model.config.num_hidden_layers
    total = sum(counts.values())
    print(f"# {args.store}, {args.key_mode}, {n} tokens behind {N}, {SHAPES[args.shape][0]} shapes: {total} "
          f"operators from Python, {total / layers:.0f} a layer")
    print("| function | operators | a layer |\n|---|---|---|")
    for name, k in sorted(counts.items(), key=lambda kv: -kv[1])[:args.rows]:
        print(f"| `{name}` | {k} | {k / layers:.1f} |")


if __name__ == "__main__":
    main()
