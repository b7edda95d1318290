"""Time of one decode step (a forward of one new token per sequence) of a Llama-3.2-1B-shaped model served by
StiefKV, with the host's share: ``STEPS`` steps back to back after a prefill of ``--context`` tokens, then the
sync, repeated ``--repeats`` times. Where decode is bound by the host (BENCHMARKS.md §3), the
host time per step is the step time, and this resolves host-side changes that ``bench_generate.py``'s
tokens/s does not.

    python3 benchmarks/bench_decode_step.py [--key-mode pre_rope] [--context 8192]
    python3 benchmarks/bench_decode_step.py --tiny --count-ops --backend reference   # no GPU: ops per step

To compare two versions of the package in one call, run it twice, once with the other version's ``stiefkv``
package first on ``PYTHONPATH`` (the row's ``package`` says which one ran), alternating A B A B. One row per
run goes to ``benchmarks/results/decode_step.jsonl`` (``--tiny`` writes none).
"""

from __future__ import annotations

import statistics

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path
from bench_generate import LLAMA_1B, TINY, random_projections
from transformers import LlamaConfig, LlamaForCausalLM

import stiefkv
from stiefkv import LatentCache
from stiefkv.attention import cache_keyword

STEPS = 100


def main() -> None:
    parser = utils.parser(__doc__.splitlines()[0])
    parser.add_argument("--key-mode", default="pre_rope", choices=["pre_rope", "post_rope"])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny model on the CPU (smoke test of this script)"
    )
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "reference"])
    parser.add_argument(
        "--count-ops",
        action="store_true",
        help="also count the top-level aten operations of one step (torch.profiler)",
    )
    args = parser.parse_args()
    utils.check_results_dir(parser)
    if not args.tiny:
        utils.require_cuda("--tiny runs a tiny model on the CPU")
    print(utils.header(), flush=True)
    torch.manual_seed(0)
    device, dtype = ("cpu", torch.float32) if args.tiny else ("cuda", torch.bfloat16)
    model = LlamaForCausalLM(LlamaConfig(**(TINY if args.tiny else LLAMA_1B))).to(device, dtype).eval()
    stiefkv.load(model, random_projections(model, 0.5, args.key_mode), backend=args.backend)
    keyword = cache_keyword(model)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), device=device)
    host_ms, total_ms, ops = [], [], None
    with torch.no_grad():
        for _ in range(args.repeats):
            cache = LatentCache()
            token = model(ids, **{keyword: cache}).logits[:, -1:].argmax(-1)
            t = utils.host_us(
                lambda cache=cache, token=token: model(token, **{keyword: cache}), calls=STEPS, warmup=0
            )
            host_ms.append(t["host_us"] / 1e3)
            total_ms.append(t["total_us"] / 1e3)
        if args.count_ops:
            ops = count_ops(lambda: model(token, **{keyword: cache}))
    row = {
        "case": f"decode step {args.key_mode} ctx{args.context} backend {args.backend}",
        "model": "Llama-3.2-1B shapes, random weights",
        "key_mode": args.key_mode,
        "context": args.context,
        "backend": args.backend,
        "steps": STEPS,
        "repeats": args.repeats,
        "package": stiefkv.__file__,
        "host_ms": host_ms,
        "total_ms": total_ms,
        "total_ms_median": statistics.median(total_ms),
        "aten_ops_per_step": ops,
        "layers": model.config.num_hidden_layers,
    }
    if not args.tiny:
        utils.write_rows("decode_step", row)
    print(
        f"{stiefkv.__file__} {args.key_mode}, {args.context} tokens: ms per step (host/host+device), "
        f"{args.repeats} repeats of {STEPS} steps: "
        + " ".join(f"{h:.2f}/{t:.2f}" for h, t in zip(host_ms, total_ms, strict=True))
        + (f"; top-level aten operations per step: {ops}" if ops is not None else ""),
        flush=True,
    )


def count_ops(fn) -> int:
    """aten operations ``fn`` calls directly (not those inside another aten operation): on CUDA most of them
    are a kernel launch each, the host cost of a host-bound decode step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(
        1
        for e in prof.events()
        if e.name.startswith("aten::")
        and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
    )


if __name__ == "__main__":
    main()
