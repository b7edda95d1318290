"""Time of one decode step (a forward of one new token per sequence) of a Llama-3.2-1B-shaped model served by
StiefKV, with the host's share: ``STEPS`` steps back to back after a prefill of ``--context`` tokens, then the
sync, repeated ``--repeats`` times. Where decode is bound by the host (BENCHMARKS.md §2, "End to end"), the
host time per step is the step time, and this resolves host-side changes that ``bench_generate.py``'s
tokens/s does not.

    python3 benchmarks/bench_decode_step.py [--key-mode pre_rope] [--context 8192]
    python3 benchmarks/bench_decode_step.py --tiny --count-ops --backend reference   # no GPU: ops per step

To compare two versions of the package in one call, run it twice, once with the other version's ``stiefkv``
package first on ``PYTHONPATH`` (the printed path says which one ran), alternating A B A B.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import stiefkv
from stiefkv.attention import LatentCache, cache_keyword

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from bench_generate import LLAMA_1B, TINY, random_projections  # noqa: E402  (after the path insert)

STEPS = 100


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--key-mode", default="pre_rope", choices=["pre_rope", "post_rope"])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke test of this script)")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    parser.add_argument("--count-ops", action="store_true",
                        help="also count the top-level aten operations of one step (torch.profiler)")
    args = parser.parse_args()
    torch.manual_seed(0)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    model = LlamaForCausalLM(LlamaConfig(**(TINY if args.tiny else LLAMA_1B))).to(device, dtype).eval()
    stiefkv.load(model, random_projections(model, 0.5, args.key_mode), backend=args.backend)
    keyword = cache_keyword(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), device=device)
    results = []
    with torch.no_grad():
        for _ in range(args.repeats):
            cache = LatentCache()
            token = model(ids, **{keyword: cache}).logits[:, -1:].argmax(-1)
            sync(device)
            start = time.perf_counter()
            for _ in range(STEPS):
                model(token, **{keyword: cache})
            host = time.perf_counter() - start
            sync(device)
            total = time.perf_counter() - start
            results.append(f"{host / STEPS * 1e3:.2f}/{total / STEPS * 1e3:.2f}")
        if args.count_ops:
            print(f"top-level aten operations per step ({model.config.num_hidden_layers} layers): "
                  f"{count_ops(lambda: model(token, **{keyword: cache}))}")
    print(f"{stiefkv.__file__} {args.key_mode}, {args.context} tokens: ms per step (host/host+device), "
          f"{args.repeats} repeats of {STEPS} steps: " + " ".join(results), flush=True)


def count_ops(fn) -> int:
    """aten operations ``fn`` calls directly (not those inside another aten operation): on CUDA most of them
    are a kernel launch each, the host cost of a host-bound decode step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


if __name__ == "__main__":
    main()
