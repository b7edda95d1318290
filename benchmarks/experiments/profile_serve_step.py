"""One decode step of ``stiefkv.generate`` by cache store, at real shapes without a prefill: the step's time
(CUDA-graph replay, as ``bench_serve.py`` times it) and, from ``torch.profiler`` over eager steps, the
kernels it launches and where their GPU time goes. For the serving notes' question: what an exact window
(``--recent``) or codes cost a step beyond the bf16 latents' (``docs/notes/serving.md``). Stores of codes
run twice by default: written by the quantize-on-write kernel and by PyTorch operators (``--fused-writes``).

    python benchmarks/experiments/profile_serve_step.py --case 8x16384 [--key-mode pre_rope]
    python benchmarks/experiments/profile_serve_step.py --tiny      # a CPU smoke run: eager, no profile
    python benchmarks/experiments/profile_serve_step.py --storage-from CKPT [--variants "as calibrated"]

``--storage-from``: a calibrated checkpoint's storage on random bases at these shapes (``bench_serve.py
--storage-from``), as calibrated and with each of its features taken away in turn (``STORAGE_VARIANTS``):
which of them a step pays for.

``--prefill``: one prefill forward instead (``stiefkv.generate``'s share of ``--prefill-tokens`` a row,
written behind the ``CONTEXT`` tokens already held; eager, as generate runs it), for the question of where a
prefill at capacity spends its time (``--code-slice``: the keys a prefill over codes dequantizes at a time).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import utils  # noqa: E402  (benchmarks/ on sys.path above)
from bench_serve import (  # noqa: E402
    SHAPES,
    fill_synthetic,
    identity_projections,
    random_projections,
    storage_projections,
    with_codes,
)
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import stiefkv  # noqa: E402
from stiefkv import static_cache  # noqa: E402
from stiefkv.kernels import lowrank  # noqa: E402
from stiefkv.quant import QuantSpec  # noqa: E402
from stiefkv.serve import PREFILL_TOKENS, DecodeState, Runner, chunk_per_row, make_cache  # noqa: E402


def auto_kinds(model, key_mode: str) -> stiefkv.Projections:
    """What SmolLM2's 12.5 % ``--bits auto`` checkpoint stores in most layers (serving.md), without the
    checkpoint: int2 channel-layout keys and int2 log8 token values, each behind a 16-token int8 window, on
    random bases of rank 0.75·d."""
    proj = random_projections(model, 0.75, key_mode)
    proj.quant = [(QuantSpec.parse("int2-channel-r16-w8"), QuantSpec.parse("int2-token-log8-r16-w8"))
                  ] * len(proj.keys)
    return proj


# label: (bits, recent) of both latents, None for the uncompressed cache on our kernels, or a function of
# the model and key mode giving the projections
STORES = {"uncompressed (our kernels)": None, "bf16 latents": (16, 0), "int8 codes": (8, 0),
          "int8 r16": (8, 16), "int4 codes": (4, 0), "int4 r16": (4, 16),
          "int2 w8 (auto's kinds)": auto_kinds}


# --storage-from: the checkpoint's storage as calibrated, and with one of its features at a time taken
# away, for the question of which of them a step pays for
STORAGE_VARIANTS = {
    "as calibrated": lambda spec: spec,
    "no exact window": lambda spec: dataclasses.replace(spec, recent=0, window8=False),
    "bf16 exact window": lambda spec: dataclasses.replace(spec, window8=False),
    "token layout": lambda spec: dataclasses.replace(spec, layout="token"),
    "no log8 scales": lambda spec: dataclasses.replace(spec, log8=False),
    "int2/int3 as int4": lambda spec: dataclasses.replace(spec, bits=max(spec.bits, 4)),
}


def projections(model, store, budget: float, key_mode: str):
    if store is None:
        return identity_projections(model)
    if callable(store):
        return store(model, key_mode)
    return with_codes(random_projections(model, budget, key_mode), *store)


def storage_variant(path: str, change):
    """A store of ``--storage-from``: the checkpoint's storage (``bench_serve.storage_projections``) with
    ``change`` applied to every latent's spec (``token layout`` keeps the channel latents' bases as they are:
    random either way, this times storage, not quality). ``key_mode`` None: the checkpoint's."""
    def make(model, key_mode: str | None):
        proj = storage_projections(model, path, key_mode)
        return dataclasses.replace(proj, quant=[(change(k), change(v)) for k, v in proj.specs])
    return make


def kernel_table(prof, steps: int, rows: int) -> tuple[int, float, list[tuple[str, int, float]]]:
    """Kernels per step, their GPU ms per step, and the ``rows`` costliest kernel names."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name].append(e.time_range.elapsed_us() / 1000)
    total = sum(sum(v) for v in by_name.values()) / steps
    count = sum(len(v) for v in by_name.values()) // steps
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:rows]
    return count, total, [(name[:70], len(v) // steps, sum(v) / steps) for name, v in top]


def run_prefill(runner, B: int, N: int, args, device, label: str) -> None:
    """Time one prefill forward of a row's share of ``--prefill-tokens`` behind ``N`` held tokens, the
    cache's counters set back to ``N`` before each, and list its kernels (CUDA)."""
    n = chunk_per_row(args.prefill_tokens, B)
    ids = torch.zeros(B, n, dtype=torch.long, device=device)
    positions = torch.arange(N, N + n, device=device).expand(B, n)
    slots = positions[0]

    def forward() -> None:
        runner.cache.filled.fill_(N)
        runner.cache.seen = N
        runner.forward(ids, positions, slots)

    forward()  # compile and warm
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        forward()
    sync()
    ms = 1e3 * (time.perf_counter() - start) / args.steps
    print(f"{label:28s} prefill forward of {n} tokens a row behind {N}: {ms:8.2f} ms "
          f"({B * n / ms * 1e3:8.0f} prompt tokens/s)", flush=True)
    if device.type == "cuda":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            forward()
            sync()
        count, gpu_ms, top = kernel_table(prof, 1, args.rows)
        print(f"    {count} kernels, {gpu_ms:.2f} ms of GPU time", flush=True)
        for name, k, t in top:
            print(f"    {t:7.3f} ms  {k:5d}×  {name}", flush=True)
    if args.op_sites:
        print_op_sites(forward, args.rows)


def operator_sites(forward) -> dict[tuple[str, str], int]:
    """How often one ``forward()`` calls each PyTorch operator from each line of stiefkv (``("file.py(line):
    function", "aten::op")``; "outside stiefkv" for the rest): operators called by the Python code itself,
    not by another operator (the profiler's Python frames are the operators' parent events)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        forward()
    sites: dict[tuple[str, str], int] = defaultdict(int)
    for e in prof.events():
        parent = e.cpu_parent
        if not e.name.startswith("aten::") or (parent is not None and parent.name.startswith("aten::")):
            continue
        while parent is not None and ("stiefkv/" not in parent.name or "profile_serve_step" in parent.name):
            parent = parent.cpu_parent
        sites[parent.name.split("stiefkv/", 1)[-1] if parent is not None else "outside stiefkv", e.name] += 1
    return sites


def print_op_sites(forward, rows: int) -> None:
    """The lines of stiefkv whose operators one forward calls most often: where a host-bound prefill's
    launches come from (``--op-sites``)."""
    sites = {f"{site} {op}": n for (site, op), n in operator_sites(forward).items()}
    print(f"    {sum(sites.values())} operators called from Python; the most frequent sites:", flush=True)
    for site, n in sorted(sites.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"    {n:6d}×  {site}", flush=True)


def run(model, label: str, store, B: int, N: int, args, device) -> None:
    stiefkv.load(model, projections(model, store, args.budget, args.key_mode))
    extra = chunk_per_row(args.prefill_tokens, B) if args.prefill else 4 * args.steps + 8
    runner = Runner(model, make_cache(model, B, N + extra), None)
    fill_synthetic(runner.cache, N)
    if args.prefill:
        with torch.inference_mode():
            run_prefill(runner, B, N, args, device, label)
        stiefkv.unload(model)
        del runner
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return
    tokens = torch.zeros(B, 4 * args.steps + 8, dtype=torch.long, device=device)
    state = DecodeState(tokens, torch.full((B, 1), N, device=device), N)
    with torch.inference_mode():
        if device.type == "cpu":
            start = time.perf_counter()
            runner.decode_eager(state, 2)
            ms = 1e3 * (time.perf_counter() - start) / 2
            print(f"{label:28s} eager {ms:8.1f} ms/step (CPU)", flush=True)
        else:
            runner.decode_eager(state, 2)  # compile and warm every kernel outside the capture
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                runner.decode_eager(state, args.steps)
                torch.cuda.synchronize()
            runner.capture(state)
            runner.replay(args.steps)
            torch.cuda.synchronize()
            start = time.perf_counter()
            runner.replay(args.steps)
            torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - start) / args.steps
            count, gpu_ms, top = kernel_table(prof, args.steps, args.rows)
            print(f"{label:28s} captured {ms:7.2f} ms/step ({B / ms * 1e3:6.0f} tok/s); eager: {count} "
                  f"kernels, {gpu_ms:.2f} ms of GPU time a step", flush=True)
            for name, n, t in top:
                print(f"    {t:7.3f} ms  {n:5d}×  {name}", flush=True)
    stiefkv.unload(model)
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    ap.add_argument("--case", type=utils.batch_context, default="8x16384", help="BATCHxCONTEXT")
    ap.add_argument("--key-mode", default=None, choices=["pre_rope", "post_rope", "auto"],
                    help="default pre_rope; with --storage-from, the checkpoint's")
    ap.add_argument("--budget", type=utils.share, default=0.5)
    ap.add_argument("--stores", type=utils.comma_list(str, list(STORES)), default=",".join(STORES),
                    help="comma-separated labels of STORES")
    ap.add_argument("--steps", type=utils.at_least(1), default=8)
    ap.add_argument("--rows", type=utils.at_least(1), default=12, help="kernels listed per store")
    ap.add_argument("--fused-writes", default="both", choices=["on", "off", "both"],
                    help="codes written by the quantize-on-write kernel, by PyTorch, or each in turn")
    ap.add_argument("--prefill", action="store_true", help="one prefill forward, not a decode step")
    ap.add_argument("--prefill-tokens", type=int, default=PREFILL_TOKENS,
                    help="tokens a prefill forward takes over all rows (generate's prefill_chunk)")
    ap.add_argument("--code-slice", type=int, default=None, metavar="KEYS",
                    help="keys a prefill over codes dequantizes at a time (default: PREFILL_CODE_SLICE)")
    ap.add_argument("--rebuilt", default=None, choices=["on", "off"],
                    help="a prefill's keys that every query sees whole through rebuilt keys and "
                         "FlashAttention (on, both key modes) or the low-rank prefill kernel (off); default: "
                         "PREFILL_REBUILT (pre_rope only)")
    ap.add_argument("--storage-from", default=None, metavar="CKPT",
                    help="profile this checkpoint's storage (bench_serve.py --storage-from) instead of "
                         "--stores, as calibrated and with each feature taken away (STORAGE_VARIANTS)")
    ap.add_argument("--variants", default=",".join(STORAGE_VARIANTS),
                    help="comma-separated labels of STORAGE_VARIANTS (with --storage-from)")
    ap.add_argument("--no-uncompressed", action="store_true",
                    help="with --storage-from: skip the uncompressed cache (it does not fit at a compressed "
                         "cache's capacity batch)")
    ap.add_argument("--op-sites", action="store_true",
                    help="with --prefill: list the source lines whose operators the forward calls most often")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    unknown = [v for v in args.variants.split(",") if v not in STORAGE_VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {', '.join(map(repr, unknown))}; choose from "
                         f"{', '.join(map(repr, STORAGE_VARIANTS))}")
    if args.no_uncompressed and not args.storage_from:
        ap.error("--no-uncompressed skips the uncompressed cache beside --storage-from's: give a checkpoint, "
                 "or list the caches with --stores")
    if args.key_mode is None and not args.storage_from:
        args.key_mode = "pre_rope"
    if args.code_slice is not None:
        lowrank.PREFILL_CODE_SLICE = args.code_slice
    if args.rebuilt is not None:
        lowrank.PREFILL_REBUILT = ("pre_rope", "post_rope") if args.rebuilt == "on" else ()
    if args.tiny:
        args.shape, args.case, args.steps = "tiny", "2x300", 2
    device = torch.device("cpu" if args.tiny else "cuda")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape][1])).to(
            torch.float32 if args.tiny else torch.bfloat16).eval()
    B, N = (int(x) for x in args.case.lower().split("x"))
    mode = args.key_mode or f"the key mode of {args.storage_from}"
    print(f"# {SHAPES[args.shape][0]} shapes, {B}x{N}, {mode}, budget {args.budget:g}", flush=True)
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.fused_writes]
    if device.type == "cpu":  # the kernel would need Triton's interpreter: the A/B is the GPU's question
        modes = [False]
    if args.storage_from:
        static_cache.FUSED_WRITES = None  # the default: the quantize-on-write kernel where it runs
        if not args.no_uncompressed:
            run(model, "uncompressed (our kernels)", None, B, N, args, device)
        for label in args.variants.split(","):
            run(model, label, storage_variant(args.storage_from, STORAGE_VARIANTS[label]), B, N, args, device)
        return
    for label in args.stores:
        store = STORES[label]
        codes = store is not None and (callable(store) or store[0] < 16)
        for fused in modes if codes else [None]:
            static_cache.FUSED_WRITES = fused
            name = label + {None: "", True: " fused", False: " pytorch"}[fused]
            run(model, name, store, B, N, args, device)


if __name__ == "__main__":
    main()
