"""StreamKL against the materialised attention KL (eager and ``torch.compile``d) and a full-rank SDPA floor.

Causal, bf16, B = 1, teacher and student of the same shape ``[1, H, N, d]`` (MHA). For each provider:
forward time (under ``no_grad``), forward+backward time (gradients to the student's ``q_s, k_s``; the
teacher is frozen, as in distillation), and the peak memory allocated beyond the inputs, measured on a
separate call. Times are ``do_bench`` p20/p50/p80 (:func:`utils.bench_ms`) after a warm-up call that absorbs
compilation and autotuning. The backward alone is (forward+backward) − forward. SDPA is
``F.scaled_dot_product_attention(q_t, k_t, v, is_causal=True)`` on the teacher shapes, forward only.

One row per shape goes to ``benchmarks/results/streamkl.jsonl`` (table ``streamkl``) as soon as it is
measured, and one per shape where the compiled reference ran (table ``streamkl_compiled``).

    python benchmarks/bench_streamkl.py [--lengths 4096 16384] [--compile-shapes all --compile-dynamic]

Targets (issue 5) at N = 16k, H = 8, d = 128: forward ≥ 43× and backward ≥ 14× faster than eager,
forward ≤ 2.5× SDPA, extra memory O(N).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

from stiefkv.kernels.reference import attention_kl as reference
from stiefkv.kernels.streamkl import attention_kl as streamkl

TARGET = (16384, 8, 128)
LENGTHS = (1024, 4096, 8192, 16384, 32768, 65536)
NAME = "streamkl"


def setup(n: int, heads: int, d: int, *, grad: bool, seed: int = 0):
    """Teacher/student queries and keys ``[1, H, N, d]`` bf16; the student's require grad if ``grad``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_t, k_t, q_s, k_s = (
        torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
    )
    return q_t, k_t, q_s.requires_grad_(grad), k_s.requires_grad_(grad)


def measure(fn, inputs, *, backward: bool) -> dict:
    """``{"ms": p20/p50/p80, "bytes": peak extra bytes}`` of ``fn(*inputs)`` (plus the student gradients
    when ``backward``), or ``{"error": "OOM"}``."""

    def run():
        if backward:
            torch.autograd.grad(fn(*inputs), inputs[2:])
        else:
            with torch.no_grad():
                fn(*inputs)

    try:
        run()  # warm-up: compilation, autotuning, cuBLAS handles
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        return {"ms": utils.bench_ms(run), "bytes": extra}
    except torch.OutOfMemoryError:
        return {"error": "OOM"}
    finally:
        torch.cuda.empty_cache()


def sdpa(q_t, k_t, v):
    return F.scaled_dot_product_attention(q_t, k_t, v, is_causal=True)


def case(n: int, h: int, d: int) -> dict:
    return {"case": f"N{n} H{h} d{d}", "N": n, "H": h, "d": d, "B": 1, "causal": True, "dtype": "bfloat16"}


def summary(r: dict) -> str:
    return " ".join(
        f"{k} {v['ms']['p50']:.3f}" if "ms" in v else f"{k} {v['error']}"
        for k, v in r.items()
        if isinstance(v, dict) and ("ms" in v or "error" in v)
    )


def main() -> None:
    parser = utils.parser(__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="sequence lengths N")
    parser.add_argument("--heads", type=int, nargs="+", default=[8, 32], help="head counts H")
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128], help="head dimensions d")
    parser.add_argument("--eager-max-n", type=int, default=32768, help="skip the eager reference above this")
    parser.add_argument(
        "--compile-shapes",
        default="16384x8x128",
        help="comma-separated NxHxd where the torch.compile'd reference runs (compiles per shape), "
        "'eager': every shape where the eager reference ran without running out of memory, "
        "or 'all': every shape (it needs ~3.5x less memory than eager, so it fits at some "
        "shapes where eager did not; OOM is recorded as such)",
    )
    parser.add_argument(
        "--compile-dynamic",
        action="store_true",
        help="torch.compile(dynamic=True): one compilation serves every shape (default: per shape)",
    )
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new shapes after this")
    args = parser.parse_args()
    utils.check_results_dir(parser)
    utils.require_cuda()
    print(utils.header(), flush=True)
    compile_shapes = set()
    if args.compile_shapes not in ("eager", "all"):
        compile_shapes = {tuple(int(x) for x in s.split("x")) for s in args.compile_shapes.split(",") if s}
    shapes = [(n, h, d) for n in args.lengths for h in args.heads for d in args.dims]
    shapes.sort(key=lambda s: s != TARGET)  # the target first: it also sets the autotuned configs
    start = time.time()
    eager_fitted = set()
    for n, h, d in shapes:
        if time.time() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f}s spent: skipping N={n} H={h} d={d}", flush=True)
            continue
        r = case(n, h, d) | {"table": "streamkl", "eager_max_n": args.eager_max_n}
        for grad in (False, True):
            inputs = setup(n, h, d, grad=grad)
            key = "fb" if grad else "f"
            r["streamkl_" + key] = measure(streamkl, inputs, backward=grad)
            if n <= args.eager_max_n:
                r["eager_" + key] = measure(reference, inputs, backward=grad)
            del inputs
        if "ms" in r.get("eager_fb", {}):
            eager_fitted.add((n, h, d))
        q_t, k_t, _, _ = setup(n, h, d, grad=False)
        r["sdpa_f"] = measure(sdpa, (q_t, k_t, torch.randn_like(k_t)), backward=False)
        del q_t, k_t
        utils.write_rows(NAME, r)
        print(r["case"], summary(r), f"({time.time() - start:.0f}s)", flush=True)
    # torch.compile last, with what is left of the budget: it compiles per shape and per pass.
    if args.compile_shapes == "eager":
        compile_shapes = eager_fitted
    elif args.compile_shapes == "all":
        compile_shapes = set(shapes)
    compiled = torch.compile(reference, dynamic=args.compile_dynamic)
    for shape in sorted(compile_shapes & set(shapes), key=lambda s: (s != TARGET, s)):  # the target first
        r = case(*shape) | {"table": "streamkl_compiled", "dynamic": args.compile_dynamic}
        for grad in (False, True):
            if time.time() - start > args.budget_s:
                print(f"budget spent: no compiled {'fb' if grad else 'f'} at {shape}", flush=True)
                continue
            r["compiled_" + ("fb" if grad else "f")] = measure(
                compiled, setup(*shape, grad=grad), backward=grad
            )
        if "compiled_f" in r:
            utils.write_rows(NAME, r)
            print(r["case"], "compiled:", summary(r), f"({time.time() - start:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
