"""StreamKL against the materialised attention KL (eager and ``torch.compile``d) and a full-rank SDPA floor.

Causal, bf16, B = 1, teacher and student of the same shape ``[1, H, N, d]`` (MHA). For each provider:
forward time (under ``no_grad``), forward+backward time (gradients to the student's ``q_s, k_s``; the
teacher is frozen, as in distillation), and the peak memory allocated beyond the inputs. Times are
``triton.testing.do_bench`` medians (p20–p80 in the log) after a warm-up call that absorbs compilation and
autotuning. The backward alone is reported as (forward+backward) − forward. The SDPA row is
``F.scaled_dot_product_attention(q_t, k_t, v, is_causal=True)`` on the teacher shapes, forward only.

    python benchmarks/bench_streamkl.py --out streamkl_bench.md

Targets (issue 5) at N = 16k, H = 8, d = 128: forward ≥ 43× and backward ≥ 14× faster than eager,
forward ≤ 2.5× SDPA, extra memory O(N).
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from stiefkv.kernels.reference import attention_kl as reference
from stiefkv.kernels import streamkl as sk
from stiefkv.kernels.streamkl import attention_kl as streamkl

TARGET = (16384, 8, 128)
LENGTHS = (1024, 4096, 8192, 16384, 32768, 65536)


def setup(n: int, heads: int, d: int, *, grad: bool, seed: int = 0):
    """Teacher/student queries and keys ``[1, H, N, d]`` bf16; the student's require grad if ``grad``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_t, k_t, q_s, k_s = (torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                          for _ in range(4))
    return q_t, k_t, q_s.requires_grad_(grad), k_s.requires_grad_(grad)


def measure(fn, inputs, *, backward: bool):
    """(median ms, p20, p80, peak extra bytes) of ``fn(*inputs)`` (plus its student gradients), or the error."""
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
        p50, p20, p80 = do_bench(run, quantiles=[0.5, 0.2, 0.8])
        return p50, p20, p80, extra
    except torch.OutOfMemoryError:
        return "OOM"
    finally:
        torch.cuda.empty_cache()


def sdpa(q_t, k_t, v):
    return F.scaled_dot_product_attention(q_t, k_t, v, is_causal=True)


def cell(result, what: str) -> str:
    if result is None:
        return "–"
    if isinstance(result, str):
        return result
    if what == "ms":
        return f"{result[0]:.3f}"
    return f"{result[3]:,}" if what == "bytes" else f"{result[3] / 2**20:,.0f}"


def ratio(num, den) -> str:
    ok = all(isinstance(x, tuple) for x in (num, den))
    return f"{num[0] / den[0]:.1f}×" if ok else "–"


def table_row(shape, r) -> str:
    n, h, d = shape
    for k in ("kl", "eager", "comp"):  # backward alone = (forward+backward) − forward
        f, fb = r.get(k + "_f"), r.get(k + "_fb")
        if isinstance(f, tuple) and isinstance(fb, tuple):
            r[k + "_b"] = (fb[0] - f[0], None, None, None)
    flops = 2 * n * n * d * h  # two causal QKᵀ products: 2·(N²/2)·d·2 per head
    tflops = f"{flops / r['kl_f'][0] / 1e9:.0f}" if isinstance(r["kl_f"], tuple) else "–"
    return (f"| {n} | {h} | {d} | {cell(r['kl_f'], 'ms')} | {cell(r['kl_fb'], 'ms')} | {tflops} "
            f"| {cell(r['kl_f'], 'bytes')} | {cell(r['kl_fb'], 'bytes')} "
            f"| {cell(r.get('eager_f'), 'ms')} | {cell(r.get('eager_fb'), 'ms')} | {cell(r.get('eager_f'), 'mb')} "
            f"| {cell(r.get('eager_fb'), 'mb')} | {cell(r.get('comp_f'), 'ms')} | {cell(r.get('comp_fb'), 'ms')} "
            f"| {cell(r.get('comp_f'), 'mb')} | {cell(r.get('comp_fb'), 'mb')} "
            f"| {cell(r['sdpa'], 'ms')} | {ratio(r.get('eager_f'), r['kl_f'])} "
            f"| {ratio(r.get('eager_b'), r.get('kl_b'))} | {ratio(r['kl_f'], r['sdpa'])} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    parser.add_argument("--heads", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--eager-max-n", type=int, default=32768, help="skip the eager reference above this")
    parser.add_argument("--compile-shapes", default="16384x8x128",
                        help="comma-separated NxHxd where the torch.compile'd reference runs (compiles per shape), "
                             "'eager': every shape where the eager reference ran without running out of memory, "
                             "or 'all': every shape (it needs ~3.5x less memory than eager, so it fits at some "
                             "shapes where eager did not; OOM is reported as such)")
    parser.add_argument("--compile-dynamic", action="store_true",
                        help="torch.compile(dynamic=True): one compilation serves every shape (default: per shape)")
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting new shapes after this")
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    parser.add_argument("--backward", choices=["split", "fused", "both"], default="split",
                        help="StreamKL's backward plan (kernels.streamkl.BACKWARD); 'both' times the fused plan "
                             "too and reports fused/split forward+backward")
    args = parser.parse_args()
    compile_shapes = set()
    if args.compile_shapes not in ("eager", "all"):
        compile_shapes = {tuple(int(x) for x in s.split("x")) for s in args.compile_shapes.split(",") if s}
    shapes = [(n, h, d) for n in args.lengths for h in args.heads for d in args.dims]
    shapes.sort(key=lambda s: s != TARGET)  # the target first: it also sets the autotuned configs
    sk.BACKWARD = "fused" if args.backward == "fused" else "split"
    start = time.time()
    results = {}
    for n, h, d in shapes:
        if time.time() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f}s spent: skipping N={n} H={h} d={d}", flush=True)
            continue
        r = results[(n, h, d)] = {}
        for grad in (False, True):
            inputs = setup(n, h, d, grad=grad)
            key = "fb" if grad else "f"
            r["kl_" + key] = measure(streamkl, inputs, backward=grad)
            if grad and args.backward == "both":
                sk.BACKWARD = "fused"
                r["fused_fb"] = measure(streamkl, inputs, backward=True)
                sk.BACKWARD = "split"
            if n <= args.eager_max_n:
                r["eager_" + key] = measure(reference, inputs, backward=grad)
            del inputs
        q_t, k_t, _, _ = setup(n, h, d, grad=False)
        r["sdpa"] = measure(sdpa, (q_t, k_t, torch.randn_like(k_t)), backward=False)
        del q_t, k_t
        print(n, h, d, {k: v if isinstance(v, str) else round(v[0], 3) for k, v in r.items()},
              f"({time.time() - start:.0f}s)", flush=True)
    # torch.compile last, with what is left of the budget: it compiles per shape and per pass.
    if args.compile_shapes == "eager":
        compile_shapes = {shape for shape, r in results.items() if isinstance(r.get("eager_fb"), tuple)}
    elif args.compile_shapes == "all":
        compile_shapes = set(results)
    compiled = torch.compile(reference, dynamic=args.compile_dynamic)
    for shape in sorted(compile_shapes & results.keys(), key=lambda s: (s != TARGET, s)):  # the target first
        for grad in (False, True):
            if time.time() - start > args.budget_s:
                print(f"budget spent: no compiled {'fb' if grad else 'f'} at {shape}", flush=True)
                continue
            results[shape]["comp_" + ("fb" if grad else "f")] = measure(compiled, setup(*shape, grad=grad),
                                                                       backward=grad)
            print(shape, "compiled", "fb" if grad else "f", results[shape].get("comp_fb" if grad else "comp_f"),
                  f"({time.time() - start:.0f}s)", flush=True)
    rows = [table_row(shape, r) for shape, r in sorted(results.items())]
    fused = [f"| {n} | {h} | {d} | {cell(r['kl_fb'], 'ms')} | {cell(r['fused_fb'], 'ms')} "
             f"| {ratio(r['fused_fb'], r['kl_fb'])} |" for (n, h, d), r in sorted(results.items()) if "fused_fb" in r]
    header = [
        f"GPU: {torch.cuda.get_device_name()}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"torch {torch.__version__}; triton {triton.__version__}; StreamKL backward plan: "
        f"{'split' if args.backward == 'both' else args.backward}; compiled reference: "
        f"torch.compile(dynamic={args.compile_dynamic})",
        "",
        "Causal, bf16, B=1, teacher = student shapes; times in ms (do_bench median); memory = peak allocated "
        "beyond the inputs (StreamKL in bytes, eager and compiled in MiB); f = forward (no grad), "
        "fb = forward+backward (grads to q_s, k_s, included in fb memory); speed-ups use backward = fb − f.",
        "",
        "| N | H | d | StreamKL f | StreamKL fb | StreamKL f TFLOP/s | StreamKL f bytes | StreamKL fb bytes "
        "| eager f | eager fb | eager f MiB | eager fb MiB | compiled f | compiled fb | compiled f MiB "
        "| compiled fb MiB | SDPA f "
        "| eager/StreamKL f | eager/StreamKL b | StreamKL f / SDPA f |",
        "|" + "---|" * 20,
    ]
    table = "\n".join(header + rows)
    if fused:
        table += "\n\n| N | H | d | fb split | fb fused | fused / split |\n|---|---|---|---|---|---|\n" + "\n".join(fused)
    print("\n" + table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
