"""Where a prefill chunk's attention over the codes below its band goes, and what might take it faster.

A prefill chunk of ``Nq`` queries a row behind ``N`` stored keys attends to all of them (no causal mask
below the band). The library dequantizes the codes in slices of ``PREFILL_CODE_SLICE`` keys and runs the
low-rank prefill kernel over each (``lowrank._prefill_in_key_slices``): 45.9 of the 67.5 ms of GPU time
of SmolLM2's 32×128 prefill behind 8000 int2 keys (H100, 2026-12-06). Timed here, each in the same run,
with ``do_bench`` (L2 flushed):

- ``library``: ``lowrank_attention`` over the codes, as the serving path calls it (latent output, lse);
- ``kernel cfg``: the prefill kernel over the whole float (dequantized) latents at its default and at
  other tiles, warps and ``ahead`` (is the prefill kernel's own configuration the loss?);
- ``rebuilt+flash``: each slice dequantized, its keys rebuilt at full width and rotated in PyTorch, its
  value latents zero-padded to ``d``, and the group's query heads folded into the query axis of one
  non-causal FlashAttention call that returns the log-sum-exp; slices merged by log-sum-exp;
- ``flash alone``: that FlashAttention call on keys already rebuilt (what a fused rebuild could reach);
- ``sdpa bf16``: full-rank SDPA over ``N`` uncompressed keys (the uncompressed model's cost).

Prints only (numbers quoted in docs/notes/serving.md come from its output).

    python benchmarks/experiments/below_band.py --heads smollm2 --case 32x8000 --bits 2 4 16
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_attention as ba  # noqa: E402
import utils  # noqa: E402

from stiefkv.kernels import lowrank  # noqa: E402
from stiefkv.kernels._common import QuantizedLatents, merge_prior  # noqa: E402
from stiefkv.kernels.dequantize import dequantize_latents  # noqa: E402
from stiefkv.kernels.lowrank import PREFILL_CODE_SLICE, lowrank_attention  # noqa: E402
from stiefkv.kernels.rebuilt import flash_with_lse  # noqa: E402
from stiefkv.kernels.reference import rebuild_keys  # noqa: E402

CONFIGS = [
    {"block_n": 64},
    {"block_n": 64, "num_warps": 4},
    {"block_n": 32, "num_warps": 4},
    {"num_stages": 3},
    {"ahead": True},
    {"ahead": True, "block_n": 64},
    {"block_n": 64, "num_stages": 3},
]


def rebuilt_slice(zk, zv, P_k, mode, positions, rope, d):
    keys = rebuild_keys(zk, P_k, key_mode=mode, positions=positions, rope=rope).to(zk.dtype)
    return keys, F.pad(zv, (0, d - zv.shape[-1]))


def rebuilt_flash(q, z_k, z_v, P_k, mode, positions, rope, step):
    """Latent output ``[B, H, Nq, r_v]`` and lse over all keys of ``z_k, z_v`` (codes or floats)."""
    B, H, Nq, d = q.shape
    G, N, r_v = z_k.shape[1], z_k.shape[2], z_v.shape[3]
    qg = q.reshape(B, G, (H // G) * Nq, d)
    state = None
    for a in range(0, N, step):
        c = min(a + step, N)
        zk, zv = (z.tokens(a, c) if isinstance(z, QuantizedLatents) else z[:, :, a:c] for z in (z_k, z_v))
        zk, zv = (dequantize_latents(z, q.dtype) if isinstance(z, QuantizedLatents) else z for z in (zk, zv))
        keys, values = rebuilt_slice(zk, zv[..., :r_v], P_k, mode, positions[:, a:c], rope, d)
        o, lse = flash_with_lse(qg, keys, values, d**-0.5)
        o = o.float()
        state = (o, lse) if state is None else merge_prior(state, o, lse, torch.float32, True)
    o, lse = state
    return o.reshape(B, H, Nq, d)[..., :r_v], lse.reshape(B, H, Nq)


def once(fn) -> dict:
    """The CPU smoke run's stand-in for ``do_bench`` (no device to time): one call, no time."""
    fn()
    return {"p50": float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="smollm2", choices=sorted(ba.HEADS))
    p.add_argument("--case", nargs="+", type=utils.batch_context, default=["32x8000"])
    p.add_argument("--nq", type=int, default=128, help="queries a row (the prefill chunk)")
    p.add_argument("--rank", type=int, default=None, help="latent rank (default: half the head dimension)")
    p.add_argument("--bits", nargs="+", type=int, default=[2, 4, 16], choices=(16, 8, 4, 2))
    p.add_argument("--modes", nargs="+", default=["pre_rope", "post_rope"], choices=ba.MODES)
    p.add_argument("--no-configs", action="store_true", help="skip the kernel's configurations (bf16)")
    p.add_argument("--step", type=int, default=PREFILL_CODE_SLICE or 4096, help="keys a slice")
    args = p.parse_args()
    ba.set_heads(args.heads)
    if not torch.cuda.is_available():  # a smoke run under TRITON_INTERPRET=1
        ba.DEVICE = "cpu"
    torch.manual_seed(0)
    ms = utils.bench_ms if torch.cuda.is_available() else once
    for case in args.case:
        B, N = (int(t) for t in case.lower().split("x"))
        r = args.rank or ba.D_HEAD // 2
        x = ba.latent_inputs(B, args.nq, N, r)
        k = torch.randn(B, ba.G, N, ba.D_HEAD, device=ba.DEVICE, dtype=ba.DTYPE)
        v = torch.randn_like(k)
        sdpa = ms(functools.partial(F.scaled_dot_product_attention, x["q"], k, v, enable_gqa=True))
        del k, v
        print(f"{args.heads} {B}x{N} +{args.nq} r{r}: sdpa bf16 {sdpa['p50']:.3f} ms", flush=True)
        for bits in args.bits:
            zk, zv = (x["z_k"], x["z_v"]) if bits == 16 else (ba.quantized(x["z_k"], bits),
                                                              ba.quantized(x["z_v"], bits))
            for mode in args.modes:
                kw = dict(key_mode=mode, positions=x["positions"], rope=x["rope"], return_lse=True,
                          causal=False)
                with torch.no_grad():
                    lib = functools.partial(lowrank_attention, x["q"], zk, zv, x["P_k"], None, **kw)
                    reb = functools.partial(rebuilt_flash, x["q"], zk, zv, x["P_k"], mode, x["positions"],
                                            x["rope"], args.step)
                    lowrank.PREFILL_REBUILT = (mode,)  # the library with the path on, then off
                    (o1, l1), (o2, l2) = lib(), reb()
                    err = ((o1.float() - o2).abs().max().item(), (l1 - l2).abs().max().item())
                    t_lib, t_reb = ms(lib), ms(reb)
                    lowrank.PREFILL_REBUILT = ()
                    (o3, l3), t_old = lib(), ms(lib)
                    lowrank.PREFILL_REBUILT = (mode,)
                    err_old = ((o3.float() - o2).abs().max().item(), (l3 - l2).abs().max().item())
                    line = (f"  int{bits} {mode}: library, PREFILL_REBUILT on {t_lib['p50']:.3f} ms, "
                            f"off (the kernel) {t_old['p50']:.3f} ms, rebuilt+flash here "
                            f"{t_reb['p50']:.3f} ms (max |Δo| {err[0]:.2e}, |Δlse| {err[1]:.2e}; kernel's "
                            f"{err_old[0]:.2e}, {err_old[1]:.2e})")
                    if bits == 16:  # the kernel's own configuration, and flash on keys already rebuilt
                        keys, values = rebuilt_slice(zk, zv, x["P_k"], mode, x["positions"], x["rope"],
                                                     ba.D_HEAD)
                        qg = x["q"].reshape(B, ba.G, -1, ba.D_HEAD)
                        alone = ms(functools.partial(flash_with_lse, qg, keys, values, ba.D_HEAD**-0.5))
                        del keys, values
                        line += f", flash alone {alone['p50']:.3f} ms"
                        lowrank.PREFILL_REBUILT = ()  # the kernel's own configurations
                        for cfg in [] if args.no_configs else CONFIGS:
                            try:
                                t = ms(functools.partial(lib, **cfg))["p50"]
                                line += f"\n    {cfg}: {t:.3f} ms"
                            except Exception as e:  # a config that does not compile is a result too
                                line += f"\n    {cfg}: {type(e).__name__}: {str(e)[:80]}"
                        lowrank.PREFILL_REBUILT = (mode,)
                    print(line, flush=True)
            del zk, zv
        del x
        ba.empty_cache()


if __name__ == "__main__":
    main()
