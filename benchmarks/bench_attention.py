"""Low-rank attention kernel against full-rank SDPA at Llama-3-8B attention shapes (H=32, G=8, d=128, bf16).

Prints markdown tables:

1. decode (one new token per sequence) at batch × context ∈ {1×32k, 8×8k, 16×16k, 4×128k}, budgets 50 %
   (r_k = r_v = 64) and 25 % (r = 32), both key modes: kernel time with the default config and with the best
   of a small config sweep, full-rank ``scaled_dot_product_attention(..., enable_gqa=True)`` time on the same
   shape in the same run, their ratio, and the bandwidth the kernel reaches on the bytes it must read
   (latents, plus the key positions for ``pre_rope``) against a device-to-device copy measured here;
2. prefill at 8k tokens (causal) against full-rank SDPA;
3. ``P_v`` in the kernel's epilogue versus folded into ``o_proj`` (``P_v=None`` and an ``o_proj`` whose
   input dimension is ``H·r_v``), each followed by its ``o_proj`` matmul.
4. the host time of one decode call at the 1B model's shapes (d = 64, r = 32), against SDPA's: what a
   host-bound ``generate`` step pays per layer.

Decode times are device times from CUDA-graph replay (``graph_ms``: 20 calls, each after a 256 MB L2
flush, minus the flushes alone), so the Python launch cost of a call (which at small shapes exceeds the
kernel) is left out for the kernel and SDPA alike; the eager ``do_bench`` median of the default config is
shown beside it. Prefill and the ``P_v`` table use ``do_bench`` medians (warm-up excluded, L2 flushed).

    python benchmarks/bench_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from stiefkv.kernels.lowrank import _default_config, lowrank_attention
from stiefkv.kernels.reference import RopeSpec

H, G, D_HEAD, D_MODEL = 32, 8, 128, 4096
DECODE_SHAPES = [(1, 32768), (8, 8192), (16, 16384), (4, 131072)]
BUDGETS = {"50%": 64, "25%": 32}
TARGETS = {("post_rope", "50%"): 0.55, ("pre_rope", "50%"): 0.65, ("post_rope", "25%"): 0.35}
# Decode configs tried beside the default; "splits" multiplies the default number of key splits.
SWEEP = [
    dict(block_n=32, num_warps=4, num_stages=3),
    dict(block_n=64, num_warps=4, num_stages=4),
    dict(block_n=128, num_warps=4, num_stages=3),
    dict(block_n=128, num_warps=8, num_stages=3),
    dict(block_n=64, num_warps=4, num_stages=3, splits=2),
    dict(block_n=128, num_warps=8, num_stages=3, splits=2),
    dict(block_n=64, num_warps=4, num_stages=3, splits=0.5),
]
DTYPE = torch.bfloat16


def median_ms(fn, rep=50) -> float:
    """Median of ``do_bench`` (ms); warm-up runs excluded, the device synchronised around the clock."""
    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graph_ms(fn, n=20) -> float:
    """Device time (ms) of one ``fn()``: a CUDA graph of ``n`` × (256 MB L2 flush, ``fn``) minus a graph of
    the ``n`` flushes alone, each the median of 5 replays."""
    flush = torch.empty(2**26, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up (compilation, allocator) outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()

    def replay_ms(with_fn: bool) -> float:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(n):
                flush.zero_()
                if with_fn:
                    fn()
        graph.replay()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[2]

    return (replay_ms(True) - replay_ms(False)) / n


def rope_spec(device) -> RopeSpec:
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, D_HEAD, 2, dtype=torch.float32, device=device) / D_HEAD))
    return RopeSpec(inv_freq, 1.0)


def latent_inputs(B, Nq, Nk, r, device):
    z_k = torch.randn(B, G, Nk, r, device=device, dtype=DTYPE)
    z_v = torch.randn(B, G, Nk, r, device=device, dtype=DTYPE)
    P_k = torch.linalg.qr(torch.randn(G, D_HEAD, r, device=device))[0]
    P_v = torch.linalg.qr(torch.randn(G, D_HEAD, r, device=device))[0]
    q = torch.randn(B, H, Nq, D_HEAD, device=device, dtype=DTYPE)
    positions = torch.arange(Nk, device=device)[None].expand(B, Nk).contiguous()
    return q, z_k, z_v, P_k, P_v, positions


def copy_bandwidth(device) -> float:
    """TB/s of a 2 GiB device-to-device copy, counting bytes read and written."""
    src = torch.empty(2**30, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e9


def header(device) -> None:
    print(f"GPU: {torch.cuda.get_device_name(device)}; date {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; "
          f"torch {torch.__version__}; triton {triton.__version__}; "
          f"shapes H={H}, G={G}, d={D_HEAD}, {str(DTYPE).removeprefix('torch.')}")


def decode_table(device, copy_tbs, shapes, sweep) -> None:
    print("\n## Decode (Nq = 1); device times from CUDA-graph replay\n")
    print("| B×ctx | budget | mode | SDPA ms | kernel ms (default) | polynomial sin/cos ms | eager ms (default) | "
          "best ms | best config | ratio (best/SDPA) | target | kernel TB/s | % copy BW |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for B, N in shapes:
        q = torch.randn(B, H, 1, D_HEAD, device=device, dtype=DTYPE)
        k = torch.randn(B, G, N, D_HEAD, device=device, dtype=DTYPE)
        v = torch.randn(B, G, N, D_HEAD, device=device, dtype=DTYPE)
        sdpa_ms = graph_ms(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        del k, v
        for budget, r in BUDGETS.items():
            q, z_k, z_v, P_k, P_v, pos = latent_inputs(B, 1, N, r, device)
            rope = rope_spec(device)
            for mode in ("post_rope", "pre_rope"):
                def run(**cfg):
                    return lowrank_attention(q, z_k, z_v, P_k, P_v, key_mode=mode, positions=pos, rope=rope, **cfg)

                default = _default_config(H // G, N, mode, B * G, torch.cuda.get_device_properties(device)
                                          .multi_processor_count, r)
                eager_ms = median_ms(run)
                default_ms = graph_ms(run)
                # pre_rope with the polynomial sin/cos instead of the default hardware one: that option's A/B
                poly = f"{graph_ms(lambda: run(fast_sincos=False)):.4f}" if mode == "pre_rope" else "–"
                best_ms, best_cfg = default_ms, f"default ({default['block_n']},{default['num_warps']},"
                best_cfg += f"{default['num_stages']},S={default['num_splits']})"
                for cfg in sweep:
                    cfg = dict(cfg)
                    splits = max(1, round(default["num_splits"] * cfg.pop("splits", 1)))
                    ms = graph_ms(lambda: run(num_splits=splits, **cfg))
                    if ms < best_ms:
                        best_ms = ms
                        best_cfg = f"({cfg['block_n']},{cfg['num_warps']},{cfg['num_stages']},S={splits})"
                nbytes = (z_k.numel() + z_v.numel()) * z_k.element_size()
                nbytes += pos.numel() * pos.element_size() if mode == "pre_rope" else 0
                tbs = nbytes / best_ms / 1e9
                target = TARGETS.get((mode, budget))
                ratio = best_ms / sdpa_ms
                mark = "—" if target is None else f"≤{target} {'met' if ratio <= target else 'MISSED'}"
                print(f"| {B}×{N // 1024}k | {budget} | {mode} | {sdpa_ms:.4f} | {default_ms:.4f} | {poly} | "
                      f"{eager_ms:.4f} | "
                      f"{best_ms:.4f} | {best_cfg} | {ratio:.3f} | {mark} | {tbs:.2f} | {100 * tbs / copy_tbs:.0f}% |",
                      flush=True)
            del z_k, z_v
        torch.cuda.empty_cache()
    print("\nconfig = (block_n, num_warps, num_stages, S = key splits); bytes = latents "
          "(+ int64 positions for pre_rope)")


def prefill_table(device, n=8192) -> None:
    print(f"\n## Prefill (causal, B=1, {n // 1024}k tokens)\n")
    print("| budget | mode | SDPA ms | kernel ms | ratio | kernel TFLOP/s (attention in latent dims) |")
    print("|---|---|---|---|---|---|")
    q = torch.randn(1, H, n, D_HEAD, device=device, dtype=DTYPE)
    k = torch.randn(1, G, n, D_HEAD, device=device, dtype=DTYPE)
    v = torch.randn(1, G, n, D_HEAD, device=device, dtype=DTYPE)
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    for budget, r in BUDGETS.items():
        _, z_k, z_v, P_k, P_v, pos = latent_inputs(1, n, n, r, device)
        rope = rope_spec(device)
        for mode, fast in (("post_rope", None), ("pre_rope", None), ("pre_rope", False)):
            ms = median_ms(lambda: lowrank_attention(q, z_k, z_v, P_k, P_v, key_mode=mode, positions=pos, rope=rope,
                                                     fast_sincos=fast))
            d_qk = r if mode == "post_rope" else D_HEAD
            flops = 2 * H * n * n / 2 * (d_qk + r)
            name = mode + (" (polynomial sin/cos)" if fast is False else "")
            print(f"| {budget} | {name} | {sdpa_ms:.3f} | {ms:.3f} | {ms / sdpa_ms:.3f} | {flops / ms / 1e9:.0f} |",
                  flush=True)


def fold_table(device, shapes, prefill_n=8192) -> None:
    """``P_v`` in the epilogue (+ ``o_proj`` on ``H·d`` inputs) vs folded (``P_v=None`` + ``o_proj`` on ``H·r``)."""
    print("\n## P_v: kernel epilogue vs folded into o_proj (50 %, r_v = 64)\n")
    print("| shape | mode | kernel+P_v ms | kernel latent ms | epilogue + o_proj ms | folded + o_proj ms | "
          "folded / epilogue |")
    print("|---|---|---|---|---|---|---|")
    r = BUDGETS["50%"]
    W_o = torch.randn(D_MODEL, H * D_HEAD, device=device, dtype=DTYPE) * 0.01
    W_fold = torch.randn(D_MODEL, H * r, device=device, dtype=DTYPE) * 0.01  # W_o · blockdiag(P_v): same shape
    cases = [(B, 1, N) for B, N in shapes] + [(1, prefill_n, prefill_n)]
    for B, Nq, N in cases:
        q, z_k, z_v, P_k, P_v, pos = latent_inputs(B, Nq, N, r, device)
        rope = rope_spec(device)
        for mode in ("post_rope", "pre_rope"):
            kw = dict(key_mode=mode, positions=pos, rope=rope)

            def epilogue():
                o = lowrank_attention(q, z_k, z_v, P_k, P_v, **kw)
                return o.transpose(1, 2).reshape(B * Nq, H * D_HEAD) @ W_o.T

            def folded():
                o = lowrank_attention(q, z_k, z_v, P_k, None, **kw)
                return o.transpose(1, 2).reshape(B * Nq, H * r) @ W_fold.T

            k_pv = median_ms(lambda: lowrank_attention(q, z_k, z_v, P_k, P_v, **kw))
            k_lat = median_ms(lambda: lowrank_attention(q, z_k, z_v, P_k, None, **kw))
            e_ms, f_ms = median_ms(epilogue), median_ms(folded)
            name = f"{'decode' if Nq == 1 else 'prefill'} {B}×{N // 1024}k"
            print(f"| {name} | {mode} | {k_pv:.4f} | {k_lat:.4f} | {e_ms:.4f} | {f_ms:.4f} | {f_ms / e_ms:.3f} |",
                  flush=True)
        del z_k, z_v
        torch.cuda.empty_cache()


def host_table(device, n=32768, calls=200) -> None:
    """Host time of one decode call at the 1B model's attention shapes (d = 64, r = 32), where a `generate`
    step is host-bound: ``calls`` back-to-back calls without a sync, against SDPA's, and the same with the
    final sync (device time shows only where it exceeds the host's)."""
    print(f"\n## Host time per decode call (B=1, {n // 1024}k keys, H={H}, G={G}, d=64, r=32)\n")
    print("| call | host µs per call | host + device µs per call |")
    print("|---|---|---|")
    d, r = 64, 32
    q = torch.randn(1, H, 1, d, device=device, dtype=DTYPE)
    k = torch.randn(1, G, n, d, device=device, dtype=DTYPE)
    z = torch.randn(1, G, n, r, device=device, dtype=DTYPE)
    P = torch.linalg.qr(torch.randn(G, d, r, device=device))[0].to(DTYPE)
    pos = torch.arange(n, device=device, dtype=torch.int32)[None]
    rope = RopeSpec(1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device).float() / d)))
    calls_by_name = {
        "SDPA (full rank)": lambda: F.scaled_dot_product_attention(q, k, k, enable_gqa=True),
        "lowrank_attention pre_rope": lambda: lowrank_attention(q, z, z, P, None, key_mode="pre_rope",
                                                                positions=pos, rope=rope),
        "lowrank_attention post_rope": lambda: lowrank_attention(q, z, z, P, None, key_mode="post_rope"),
    }
    with torch.no_grad():
        for name, fn in calls_by_name.items():
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            host = time.perf_counter() - start
            torch.cuda.synchronize()
            total = time.perf_counter() - start
            print(f"| {name} | {host / calls * 1e6:.0f} | {total / calls * 1e6:.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="two decode shapes, no config sweep")
    parser.add_argument("--skip", nargs="*", default=[], choices=["decode", "prefill", "fold", "host"])
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    header(device)
    copy_tbs = copy_bandwidth(device)
    print(f"device-to-device copy: {copy_tbs:.2f} TB/s (bytes read + written)")
    shapes = DECODE_SHAPES[::3] if args.quick else DECODE_SHAPES
    if "decode" not in args.skip:
        decode_table(device, copy_tbs, shapes, [] if args.quick else SWEEP)
    if "prefill" not in args.skip:
        prefill_table(device)
    if "fold" not in args.skip:
        fold_table(device, shapes)
    if "host" not in args.skip:
        host_table(device)


if __name__ == "__main__":
    main()
