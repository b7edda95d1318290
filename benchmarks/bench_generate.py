"""End-to-end decode speed and peak memory: a Llama-3.2-1B-shaped model (random weights) with a 50 % latent
cache (``stiefkv.load``, Triton kernels) against the same model uncompressed, at a long context.

Decode tokens/s = ``n`` / (time of ``generate`` with ``1 + n`` new tokens − time with 1 new token), so the
prefill is left out; peak memory is ``torch.cuda.max_memory_allocated`` over the longer ``generate``. The two
models alternate, one such pair each per round, and the speed-up is the median of the rounds' ratios: the
host's speed drifts within one call (the uncompressed model's tokens/s moved between 51 and 86 in one call
on the H200), and measuring one model's repeats after the other's let that drift into the ratio. Random
bases at the model's real shapes: speed does not depend on their quality.

One row per run goes to ``benchmarks/results/generate.jsonl`` (``--tiny``, a CPU smoke test of the script,
writes none).

    python benchmarks/bench_generate.py [--context 32768] [--new-tokens 64] [--key-mode pre_rope] [--rounds 5]
"""

from __future__ import annotations

import statistics
import time

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path
from transformers import LlamaConfig, LlamaForCausalLM

import stiefkv
from stiefkv.models import dims_of, fingerprint

# Llama-3.2-1B: 16 layers, hidden 2048, 32 query heads, 8 KV heads, head dim 64, vocabulary 128256.
LLAMA_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}
TINY = {
    "vocab_size": 97,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}
WARMUP_ROUNDS = 2
DEFAULT_BUDGET = 0.5


def random_projections(model, budget: float, key_mode: str, seed: int = 0) -> stiefkv.Projections:
    """Orthonormal random bases with ``r_k = r_v = budget·d`` (a multiple of 8) in every layer."""
    dims = dims_of(model.config)
    r = max(8, round(budget * dims.d / 8) * 8)
    g = torch.Generator().manual_seed(seed)
    keys = [utils.random_basis(dims.G, dims.d, r, device="cpu", generator=g) for _ in range(dims.L)]
    values = [utils.random_basis(dims.G, dims.d, r, device="cpu", generator=g) for _ in range(dims.L)]
    return stiefkv.Projections(
        keys=keys,
        values=values,
        key_mode=key_mode,
        fingerprint=fingerprint(model),
        budget=budget,
        method="random",
    )


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


def case_of(args) -> str:
    """A row's case. The budget is named where it is not the default 0.5: the case without it is what
    BENCHMARKS.md's claims read as the 50 % cache, and a ``--budget 0.25`` run took its place there."""
    budget = "" if args.budget == DEFAULT_BUDGET else f" budget{args.budget:g}"
    return f"generate {args.key_mode} B{args.batch} ctx{args.context} new{args.new_tokens}{budget}"


def main() -> None:
    # the docstring's first sentence (its first line stopped at "with a 50 % latent")
    parser = utils.parser(" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--context", type=utils.at_least(1), default=None,
                        help="prompt tokens (default 32768; with --tiny 256)")
    parser.add_argument("--new-tokens", type=utils.at_least(1), default=64)
    parser.add_argument("--batch", type=utils.at_least(1), default=1)
    parser.add_argument("--budget", type=utils.share, default=DEFAULT_BUDGET,
                        help=f"of the latent cache's bytes (default {DEFAULT_BUDGET})")
    parser.add_argument("--key-mode", default="pre_rope", choices=["pre_rope", "post_rope"])
    parser.add_argument("--rounds", type=utils.at_least(1), default=5,
                        help="alternating rounds (one pair per model each)")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model on the CPU (smoke test; writes no row)"
    )
    args = parser.parse_args()
    limit = (TINY if args.tiny else LLAMA_1B)["max_position_embeddings"]
    if args.context is None:
        args.context = 256 if args.tiny else 32768
    if args.context + args.new_tokens > limit:
        parser.error(f"--context {args.context} and --new-tokens {args.new_tokens} run past the model's "
                     f"{limit} positions")
    if not args.tiny:
        utils.check_results_dir(parser)  # --tiny writes no row
        utils.require_cuda("--tiny runs a tiny model on the CPU")
    print(utils.header(), flush=True)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    config = LlamaConfig(**(TINY if args.tiny else LLAMA_1B))
    model = LlamaForCausalLM(config).to(device, dtype).eval()
    ids = torch.randint(0, config.vocab_size, (args.batch, args.context), device=device)
    proj = random_projections(model, args.budget, args.key_mode)
    backend = "reference" if args.tiny else "auto"
    full, low = [], []
    with torch.no_grad():
        # Warm-up of each (compilation, allocator): on the H200 the uncompressed model's first pair after
        # its warm-up still decoded ~4x slower than the next ones, so one more pair each is left out.
        for _ in range(WARMUP_ROUNDS):
            decode_speed(model, ids, args.new_tokens, device)
            with stiefkv.compressed(model, proj, backend=backend):
                decode_speed(model, ids, args.new_tokens, device)
        for _ in range(args.rounds):
            full.append(decode_speed(model, ids, args.new_tokens, device))
            with stiefkv.compressed(model, proj, backend=backend):
                low.append(decode_speed(model, ids, args.new_tokens, device))
    ratios = [lo[0] / fu[0] for fu, lo in zip(full, low, strict=True)]
    gib = 2**30
    row = {
        "case": case_of(args),
        "model": "Llama-3.2-1B shapes, random weights" + (" (tiny)" if args.tiny else ""),
        "dtype": str(dtype),
        "key_mode": args.key_mode,
        "batch": args.batch,
        "context": args.context,
        "new_tokens": args.new_tokens,
        "budget": args.budget,
        "achieved_budget": proj.achieved_budget,
        "backend": backend,
        "warmup_rounds": WARMUP_ROUNDS,
        "rounds": args.rounds,
        "full_tps": [t for t, _ in full],
        "stiefkv_tps": [t for t, _ in low],
        "ratios": ratios,
        "full_tps_median": statistics.median(t for t, _ in full),
        "stiefkv_tps_median": statistics.median(t for t, _ in low),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "full_peak_gib": max(p for _, p in full) / gib,
        "stiefkv_peak_gib": max(p for _, p in low) / gib,
    }
    if not args.tiny:
        utils.write_rows("generate", row)
    print(
        f"full {row['full_tps_median']:.1f} tokens/s ({' '.join(f'{t:.1f}' for t in row['full_tps'])}), "
        f"StiefKV {row['stiefkv_tps_median']:.1f} tokens/s "
        f"({' '.join(f'{t:.1f}' for t in row['stiefkv_tps'])});"
        f" speed-up {row['ratio_median']:.2f}x (median of the rounds' ratios; {row['ratio_min']:.2f}-"
        f"{row['ratio_max']:.2f}); "
        + (f"peak memory {row['stiefkv_peak_gib']:.2f} / {row['full_peak_gib']:.2f} GiB"
           if device.type == "cuda" else "peak memory not measured on the CPU")  # it printed 0.00 / 0.00 GiB
    )


if __name__ == "__main__":
    main()
