"""End-to-end decode speed and peak memory: a Llama-3.2-1B-shaped model (random weights) with a 50 % latent
cache (``stiefkv.load``, Triton kernels) against the same model uncompressed, at a long context.

Decode tokens/s = ``n`` / (time of ``generate`` with ``1 + n`` new tokens − time with 1 new token), so the
prefill is left out; peak memory is ``torch.cuda.max_memory_allocated`` over the longer ``generate``. The two
models alternate, one such pair each per round, and the speed-up is the median of the rounds' ratios: the
host's speed drifts within one call (the uncompressed model's tokens/s moved between 51 and 86 in one call on
the H200, BENCHMARKS.md §2), and measuring one model's repeats after the other's let that drift into the
ratio. Random bases at the model's real shapes: speed does not depend on their quality.

    python benchmarks/bench_generate.py [--context 32768] [--new-tokens 64] [--key-mode pre_rope] [--rounds 5]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time

import torch
import triton
from transformers import LlamaConfig, LlamaForCausalLM

import stiefkv
from stiefkv.models import dims_of, fingerprint

# Llama-3.2-1B: 16 layers, hidden 2048, 32 query heads, 8 KV heads, head dim 64, vocabulary 128256.
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                tie_word_embeddings=True)
TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=True)


def random_projections(model, budget: float, key_mode: str, seed: int = 0) -> stiefkv.Projections:
    """Orthonormal random bases with ``r_k = r_v = budget·d`` (a multiple of 8) in every layer."""
    dims = dims_of(model.config)
    r = max(8, int(round(budget * dims.d / 8)) * 8)
    g = torch.Generator().manual_seed(seed)

    def basis():
        return torch.linalg.qr(torch.randn(dims.G, dims.d, r, generator=g, dtype=torch.float64))[0].float()

    keys = [basis() for _ in range(dims.L)]
    values = [basis() for _ in range(dims.L)]
    return stiefkv.Projections(keys=keys, values=values, key_mode=key_mode, fingerprint=fingerprint(model),
                               budget=budget, method="random")


def timed_generate(model, ids, new_tokens: int, device) -> tuple[float, int]:
    """Seconds and peak bytes of one greedy ``generate`` of exactly ``new_tokens`` tokens."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    return time.perf_counter() - start, peak


def decode_speed(model, ids, new_tokens: int, device) -> tuple[float, int]:
    """Decode tokens/s of one (prefill, prefill + decode) pair, and the peak memory of the longer one."""
    t_prefill, _ = timed_generate(model, ids, 1, device)
    t_total, peak = timed_generate(model, ids, 1 + new_tokens, device)
    return new_tokens / (t_total - t_prefill), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=float, default=0.5)
    parser.add_argument("--key-mode", default="pre_rope", choices=["pre_rope", "post_rope"])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (one pair per model each)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke test of this script)")
    args = parser.parse_args()
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY if args.tiny else LLAMA_1B))
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.context), device=device)
    name = "cpu" if args.tiny else torch.cuda.get_device_name(device)
    print(f"{name}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}; "
          f"triton {triton.__version__}; Llama-3.2-1B shapes{' (tiny)' if args.tiny else ''}, {dtype}, random weights; "
          f"batch {args.batch}, context {args.context}, {args.new_tokens} new tokens, {args.key_mode}")
    proj = random_projections(model, args.budget, args.key_mode)
    backend = "reference" if args.tiny else "auto"
    full, low = [], []
    with torch.no_grad():
        # Warm-up of each (compilation, allocator): on the H200 the uncompressed model's first pair after
        # its warm-up still decoded ~4× slower than the next ones, so one more pair each is left out.
        for _ in range(2):
            decode_speed(model, ids, args.new_tokens, device)
            with stiefkv.compressed(model, proj, backend=backend):
                decode_speed(model, ids, args.new_tokens, device)
        for _ in range(args.rounds):
            full.append(decode_speed(model, ids, args.new_tokens, device))
            with stiefkv.compressed(model, proj, backend=backend):
                low.append(decode_speed(model, ids, args.new_tokens, device))
    gib = 2**30
    full_tps = statistics.median(tps for tps, _ in full)
    low_tps = statistics.median(tps for tps, _ in low)
    full_peak, low_peak = max(p for _, p in full), max(p for _, p in low)
    ratios = [lo[0] / fu[0] for fu, lo in zip(full, low)]
    print("\n| cache | budget | decode tokens/s (median) | per round | peak memory GiB |")
    print("|---|---|---|---|---|")
    print(f"| full (DynamicCache, SDPA) | 100% | {full_tps:.1f} | {' '.join(f'{t:.1f}' for t, _ in full)} | "
          f"{full_peak / gib:.2f} |")
    print(f"| StiefKV latents | {proj.achieved_budget:.0%} | {low_tps:.1f} | {' '.join(f'{t:.1f}' for t, _ in low)} | "
          f"{low_peak / gib:.2f} |")
    print(f"\nspeed-up {statistics.median(ratios):.2f}× (median of the rounds' ratios; "
          f"{min(ratios):.2f}–{max(ratios):.2f}); peak memory {low_peak / max(full_peak, 1):.2f}× of full")


if __name__ == "__main__":
    main()
