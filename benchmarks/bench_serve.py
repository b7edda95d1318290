"""End-to-end serving: decode tokens/s and memory of ``stiefkv.generate`` (static latent cache, chunked
prefill, CUDA-graph-captured decode) against the same model uncompressed under the same chunking and the
same capture (transformers' ``StaticCache``, SDPA), and against plain ``generate``.

Random weights at real shapes (``--shape 1b`` Llama-3.2-1B, ``8b`` Llama-3-8B); random orthonormal bases of
rank ``budget·d`` (speed does not depend on their quality). For each (batch, context):

1. the uncompressed model: allocate its static cache, prefill in chunks (timed), capture its decode step;
2. the served model (``stiefkv.load``) likewise, with a :class:`~stiefkv.StaticLatentCache`;
3. the uncompressed cache served by StiefKV's own kernels (identity bases, ``post_rope``): transformers'
   static cache attends over every slot through a dense mask (SDPA's math path, GQA heads repeated), which
   a faster uncompressed decode avoids; the speed-up is taken against the faster of the two;
4. ``--rounds`` rounds alternating the three: ``--new-tokens`` replays each, timed with a device sync around
   them (host and device together: what a user waits for); tokens/s is summed over the batch, and the
   speed-up is the median of the rounds' ratios;
5. ``--baseline-cache NAME``: a quantization-only cache of ``stiefkv eval --baseline NAME`` (``int4``,
   ``kivi2``, …: full-rank codes, no bases; keys after RoPE, as KIVI and transformers' quantized cache keep
   them) served by the same kernels and capture, alternated with the others: what a user who wants a smaller
   cache would otherwise run; ``ratio_vs_baseline`` is StiefKV's tokens/s over it, round by round;
6. ``--plain``: the uncompressed model's plain ``generate`` (dynamic cache, eager), decode tokens/s as the
   difference of ``1 + n`` and 1 new tokens; ``--compiled``: its ``generate`` over a ``StaticCache``, which
   transformers compiles on CUDA (the fastest path a transformers user has), timed the same way.

``--storage-from CKPT`` serves a calibrated checkpoint's storage instead of ``--budget``, ``--bits`` and
``--recent`` (:func:`storage_projections`: each layer's ranks as the same fraction of the head dim, its specs,
on random bases at ``--shape``'s shapes): for instance what a SmolLM2 ``--bits auto`` checkpoint stores, at
Llama-3-8B's shapes.

Memory: the cache's bytes, and the peak allocated above the weights during its prefill and first steps.
One row per (shape, batch, context) goes to ``benchmarks/results/serve.jsonl``; ``--tiny`` runs a tiny model
on the CPU eagerly (a smoke test; writes no row). ``STIEFKV_NO_CAPTURE=1`` decodes eagerly on CUDA too (to
locate a launch that fails inside a graph replay, with ``CUDA_LAUNCH_BLOCKING=1``; writes no row).

    python benchmarks/bench_serve.py --shape 8b --cases 8x16384 [--key-mode pre_rope] [--budget 0.5]
    python benchmarks/bench_serve.py --shape 8b --cases 8x16384 --storage-from a25.safetensors
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path
from bench_generate import LLAMA_1B, TINY, random_projections
from transformers import LlamaConfig, LlamaForCausalLM

import stiefkv
from stiefkv.cache import LatentCache
from stiefkv.models import decoder_layers, dims_of, fingerprint
from stiefkv.quant import QuantSpec
from stiefkv.serve import PREFILL_TOKENS, DecodeState, Runner, chunk_per_row, make_cache

LLAMA_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
SMOLLM2 = {  # SmolLM2-135M-Instruct, the default real model: three KV heads a layer, so --share-heads
    "vocab_size": 49152,  # checkpoints of it serve at their own ranks here (storage_projections)
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
SHAPES = {"1b": ("Llama-3.2-1B", LLAMA_1B), "8b": ("Llama-3-8B", LLAMA_8B),
          "smollm2": ("SmolLM2-135M", SMOLLM2), "tiny": ("tiny", TINY)}
GIB = 2**30


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Served:
    """One model's cache, prefilled and with its decode step captured, ready to replay."""

    def __init__(self, model, ids, max_length: int, chunk: int, capture: bool, fill: int = 0, prefix=None,
                 at: int = 0):
        """``fill``: the first ``fill`` tokens of every row are written directly (:func:`fill_synthetic`,
        random latents) and only the rest is prefilled (its forwards attend over the filled tokens).
        ``prefix``: a compacted ``LatentCache`` the static cache holds first (``hold_compacted``), ``ids``
        then read behind it at positions ``at`` onward (``stiefkv.generate``'s path over a compacted
        prompt)."""
        device = ids.device
        B, N = ids.shape
        sync(device)
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        self.runner = Runner(model, make_cache(model, B, max_length), None)
        # the served attention modules, held for as long as this: the captured step reads their buffers
        # (folded weights, bases) by address, and run_case unloads the model right after capturing, which
        # would free them under the graph (its replays then read whatever took the memory)
        self.modules = [layer.self_attn for layer in decoder_layers(model)]
        positions = torch.arange(at, at + N, device=device)[None].expand(B, N)
        start = time.perf_counter()
        with torch.inference_mode():
            first = fill
            if fill:
                fill_synthetic(self.runner.cache, fill)
            if prefix is not None:
                first = self.runner.cache.hold_compacted(prefix, None)
            logits = self.runner.prefill(ids[:, fill:], positions[:, fill:], chunk, start=first)
            sync(device)
            self.prefill_s = time.perf_counter() - start
            self.cache_bytes = _cache_bytes(self.runner.cache)  # transformers allocates on the first write
            end = first + N - fill  # the slots written
            self.tokens = torch.empty(B, max_length - end, dtype=torch.long, device=device)
            self.tokens[:, 0] = logits.argmax(-1)
            self.logits = logits.float()
            self.state = DecodeState(self.tokens, positions[:, -1:] + 1, end)
            self.capture = capture
            if capture:
                self.runner.capture(self.state)
            else:
                self.runner.step(self.state)
        sync(device)
        self.peak_gib = ((torch.cuda.max_memory_allocated() - base) / GIB) if device.type == "cuda" else 0.0
        self.batch = B

    def decode_tps(self, steps: int) -> float:
        device = self.tokens.device
        sync(device)
        start = time.perf_counter()
        with torch.inference_mode():
            if self.capture:
                self.runner.replay(steps)
            else:
                with self.served_modules():
                    self.runner.decode_eager(self.state, steps)
        sync(device)
        return self.batch * steps / (time.perf_counter() - start)

    @contextmanager
    def served_modules(self):
        """This model's attention modules in the layers for the block: run_case unloads the model after
        each prefill, and an eager step would otherwise run the original attention over this cache."""
        layers = self.runner.layers
        current = [layer.self_attn for layer in layers]
        for layer, module in zip(layers, self.modules, strict=True):
            layer.self_attn = module
        try:
            yield
        finally:
            for layer, module in zip(layers, current, strict=True):
                layer.self_attn = module


def _cache_bytes(cache) -> int:
    if hasattr(cache, "nbytes"):
        return int(cache.nbytes)
    return int(sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values)
                   if isinstance(t, torch.Tensor)))


def plain_generate_tps(model, ids, new_tokens: int) -> float:
    def once(n):
        sync(ids.device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        sync(ids.device)
        return time.perf_counter() - start

    once(2)  # warm-up
    return ids.shape[0] * new_tokens / (once(1 + new_tokens) - once(1))


def compiled_generate_tps(model, ids, new_tokens: int) -> float:
    """transformers' fastest decode for a user: ``generate`` over a ``StaticCache``, whose forward it compiles
    itself on CUDA (``torch.compile``, its default ``CompileConfig``). One cache of one length serves every
    call, so that one compilation serves them all; decode tokens/s as in :func:`plain_generate_tps`."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens + 1)

    def once(n):
        cache.reset()
        sync(ids.device)
        start = time.perf_counter()
        model.generate(ids, past_key_values=cache, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                       pad_token_id=0)
        sync(ids.device)
        return time.perf_counter() - start

    once(1 + new_tokens)  # compilation
    once(1 + new_tokens)  # warm
    return ids.shape[0] * new_tokens / (once(1 + new_tokens) - once(1))


def identity_projections(model) -> stiefkv.Projections:
    """Full-rank identity bases in ``post_rope``: the uncompressed cache, served by StiefKV's kernels (the
    strongest uncompressed decode this image has: transformers' static cache attends through a dense mask)."""
    dims = dims_of(model.config)
    eye = torch.eye(dims.d).expand(dims.G, dims.d, dims.d).contiguous()
    return stiefkv.Projections(keys=[eye] * dims.L, values=[eye] * dims.L, key_mode="post_rope",
                               fingerprint=fingerprint(model), budget=1.0, method="identity")


def with_codes(proj: stiefkv.Projections, bits: int, recent: int) -> stiefkv.Projections:
    """``proj`` storing keys and values as ``bits``-bit codes (token layout), ``recent`` newest tokens exact;
    as it is for 16 bits."""
    if bits < 16:
        spec = QuantSpec(bits, "token", recent=recent)
        proj.quant = [(spec, spec)] * len(proj.keys)
    return proj


def unknown_baseline(name: str) -> str | None:
    """What is wrong with ``--baseline-cache name``: not one of :data:`stiefkv.evaluate.BASELINES`."""
    from stiefkv.evaluate import BASELINES

    if name in BASELINES:
        return None
    return f"--baseline-cache {name!r} is not a baseline; choose one of {', '.join(BASELINES)}"


def baseline_projections(model, name: str) -> stiefkv.Projections:
    """The quantization-only cache ``name`` of :data:`stiefkv.evaluate.BASELINES` on identity bases in
    ``post_rope``: full-rank keys (after RoPE) and values stored as its codes, read by StiefKV's kernels."""
    from stiefkv.evaluate import BASELINES

    if unknown_baseline(name):
        raise SystemExit(unknown_baseline(name))
    proj = identity_projections(model)
    proj.quant = [BASELINES[name]] * len(proj.keys)
    return proj


def storage_projections(model, path: str, key_mode: str | None = None) -> stiefkv.Projections:
    """Random orthonormal bases at ``model``'s shapes carrying the storage of the checkpoint at ``path`` (for
    instance a SmolLM2 ``--bits auto`` one): each layer takes its key and value ranks as the same fraction of
    the head dim (a multiple of 8, at least 8) and its storage specs (bits, layout, scales, exact window),
    the checkpoint's layers spread evenly over the model's. Speed depends on the shapes and the storage
    only, so this serves a calibrated checkpoint's storage at a large model's shapes. A ``--share-heads``
    checkpoint (one basis a layer, ``[1, G·d, R]``) gives shared bases, ``R`` the same fraction of the
    layer's ``G·d`` channels (at its own model's shapes, ``--shape smollm2`` for SmolLM2, its own ranks).
    ``key_mode``: the checkpoint's (per layer) by default; ``auto``: per layer as ``calibrate --key-mode
    auto`` serves it, ``post_rope`` where the checkpoint's layer keeps its keys at full rank, else
    ``pre_rope``."""
    try:
        ck = stiefkv.Projections.load(path)
    except stiefkv.CheckpointError as e:
        raise SystemExit(f"--storage-from: {e}") from None
    dims = dims_of(model.config)
    d_ck = int(ck.keys[0].shape[1])  # G·d of the checkpoint's model where shared
    width = dims.G * dims.d if ck.shared else dims.d
    heads = 1 if ck.shared else dims.G
    g = torch.Generator().manual_seed(0)

    def rank(r: int) -> int:
        return min(width, max(8, round(r / d_ck * width / 8) * 8))

    source = [min(len(ck.keys) - 1, i * len(ck.keys) // dims.L) for i in range(dims.L)]
    if key_mode == "auto":
        modes = ["post_rope" if ck.ranks[i][0] == ck.keys[i].shape[1] else "pre_rope" for i in source]
    else:
        modes = [key_mode or ck.key_modes[i] for i in source]
    keys, values, quant = [], [], []
    for i in source:
        r_k, r_v = ck.ranks[i]
        keys.append(utils.random_basis(heads, width, rank(r_k), device="cpu", generator=g))
        values.append(utils.random_basis(heads, width, rank(r_v), device="cpu", generator=g))
        quant.append(ck.specs[i])
    source_fields = {"storage_from": Path(path).name, "storage_budget": ck.budget,
                     "storage_achieved_budget": ck.achieved_budget, "storage_key_mode": ck.key_mode_summary,
                     "storage_ranks": ck.ranks, "storage_specs": [[str(k), str(v)] for k, v in ck.specs]}
    return stiefkv.Projections(keys=keys, values=values, key_mode=modes[0], layer_key_modes=modes,
                               fingerprint=fingerprint(model), budget=ck.budget,
                               method=f"storage of {Path(path).name}", quant=quant,
                               settings=source_fields | {"layer_key_modes": modes})


def storage_fields(proj: stiefkv.Projections) -> dict:
    """What a row served with ``--storage-from`` records: the checkpoint (kept in the stand-in's settings by
    :func:`storage_projections`) and the stand-in's own ranks and specs."""
    return {"bits": None, **proj.settings,
            "ranks": proj.ranks, "specs": [[str(k), str(v)] for k, v in proj.specs]}


def cache_label(args) -> str:
    options = "".join(f" {k}={v}" for k, v in sorted((getattr(args, "decode_option", None) or {}).items()))
    if args.storage_from:
        return f"stiefkv storage {Path(args.storage_from).stem} {args.budget:g}" + options
    return f"stiefkv {args.budget:g}" + (f" int{args.bits}" if args.bits < 16 else "") \
        + (f" r{args.recent}" if args.bits < 16 and args.recent else "") + options


def decode_option(text: str) -> tuple[str, bool | int]:
    """``KEY=VALUE`` of ``--decode-option``: a decode-kernel option (``pairs=false``, ``block_n=64``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. pairs=false")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    try:
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: VALUE must be true, false or an integer") from None


def override_decode(options: dict) -> None:
    """Every decode launch over codes (one query's GQA group a tile, int8/int4/... latents) takes ``options``
    over its default configuration: the same run's A/B of a kernel option end to end. Prefill, and decode
    over float latents (the uncompressed cache on our kernels, an exact ring), keep their own."""
    from stiefkv.kernels import lowrank

    chosen = lowrank._default_config
    unknown = set(options) - set(chosen(1, 1024, "post_rope", 1, 1, 64, True, 8))
    if unknown:
        raise SystemExit(f"bench_serve: --decode-option {', '.join(sorted(unknown))}: not a decode option "
                         f"(one of {', '.join(sorted(chosen(1, 1024, 'post_rope', 1, 1, 64, True, 8)))})")
    for key, allowed in (("block_n", (16, 32, 64, 128, 256)), ("num_warps", (1, 2, 4, 8)),
                         ("num_stages", (1, 2, 3, 4, 5)), ("num_splits", range(1, 1025))):
        if key in options and options[key] not in allowed:  # else a compile error after the prefill
            told = ", ".join(map(str, allowed)) if len(allowed) < 10 else f"{allowed[0]} to {allowed[-1]}"
            raise SystemExit(f"bench_serve: --decode-option {key}={options[key]}: the kernel takes {key} of "
                             f"{told}")

    def config(n_rows, n_k, key_mode, programs, n_sms, r_k=64, codes=False, *a, **k):
        cfg = chosen(n_rows, n_k, key_mode, programs, n_sms, r_k, codes, *a, **k)
        return cfg | options if codes and n_rows <= lowrank.DECODE_BLOCK_M else cfg

    lowrank._default_config = config


SERVED_NAMES = {"full": "uncompressed model on transformers' static cache",
                "full_kernel": "uncompressed cache on StiefKV's kernels", "stiefkv": "StiefKV cache",
                "baseline": "quantization-only cache", "compacted": "StiefKV cache of a compacted prompt"}
QUESTION = 16  # tokens read behind a compacted prompt before decoding (--compact)


def synthetic_compacted(model, B: int, N: int, keep: float, device) -> LatentCache:
    """A served model's compacted ``LatentCache`` of ``N``-token prompts kept to ``round(keep·N)`` entries a
    layer and KV head, as ``stiefkv.compact`` leaves it: random latents (stored as the model stores them),
    distinct sorted positions per (row, KV head) and random β. Decode's speed depends on the entries' count,
    not their values; compacting real prompts of Llama-3-8B shapes is timed by bench_compaction.py."""
    t = max(1, round(keep * N))
    g = torch.Generator(device).manual_seed(0)
    cache = LatentCache()
    cache.length = N
    for layer in decoder_layers(model):
        attn = layer.self_attn
        G, dtype = attn.P_k.shape[0], attn.q_proj.weight.dtype
        z_k, z_v = (torch.randn(B, G, t, P.shape[2], device=device, generator=g).to(dtype)
                    for P in (attn.P_k, attn.P_v))
        positions = torch.rand(B, G, N, device=device, generator=g).argsort(-1)[..., :t].sort(-1).values
        beta = 0.5 * torch.randn(B, G, t, device=device, generator=g)
        cache.add_compacted_layer(z_k, z_v, positions, beta, quant=attn.quant)
    return cache


def eager_only() -> bool:
    """``STIEFKV_NO_CAPTURE=1``: decode eagerly on CUDA (debugging a launch that fails in a replay)."""
    return os.environ.get("STIEFKV_NO_CAPTURE") == "1"


def _ready(name: str, served: Served, B: int, N: int) -> None:
    """A progress line per served cache: a case prefills four caches before its first number."""
    print(f"  {B}x{N} {SERVED_NAMES[name]}: prefilled in {served.prefill_s:.1f} s, "
          f"cache {served.cache_bytes / GIB:.2f} GiB", flush=True)


def run_case(model, proj, B: int, N: int, args, device) -> dict:
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (B, N), device=device)
    steps = 2 + (args.rounds + 1) * args.new_tokens  # capture's warm-up step, then the replays
    capture = device.type == "cuda" and not eager_only()
    backend = "reference" if device.type == "cpu" else "auto"
    served = {"full": Served(model, ids, N + steps, args.chunk, capture)}
    _ready("full", served["full"], B, N)
    others = [("full_kernel", identity_projections(model)), ("stiefkv", proj)]
    if args.baseline_cache:
        others.append(("baseline", baseline_projections(model, args.baseline_cache)))
    for name, p in others:
        stiefkv.load(model, p, backend=backend)
        served[name] = Served(model, ids, N + steps, args.chunk, capture)
        stiefkv.unload(model)
        _ready(name, served[name], B, N)
    if getattr(args, "compact", None):  # the same bases over the prompt compacted, a question behind it
        stiefkv.load(model, proj, backend=backend)
        prefix = synthetic_compacted(model, B, N, args.compact, device)
        held = max(p.shape[2] for p in prefix.head_positions)
        question = torch.randint(0, model.config.vocab_size, (B, QUESTION), device=device)
        served["compacted"] = Served(model, question, held + QUESTION + steps, args.chunk, capture,
                                     prefix=prefix, at=N)
        del prefix
        stiefkv.unload(model)
        _ready("compacted", served["compacted"], B, N)
    for name, s in served.items():
        try:
            s.decode_tps(args.new_tokens)  # one more warm-up round each
        except RuntimeError as e:  # a fault inside a replay surfaces at the sync after it: name whose it was
            e.add_note(f"bench_serve: in the warm-up replays of the {SERVED_NAMES[name]} ({B}x{N})")
            raise
    tps = {name: [] for name in served}
    for _ in range(args.rounds):
        for name, s in served.items():
            tps[name].append(s.decode_tps(args.new_tokens))
    # against the faster uncompressed path, round by round
    best = [max(a, b) for a, b in zip(tps["full"], tps["full_kernel"], strict=True)]
    ratios = [lo / fu for fu, lo in zip(best, tps["stiefkv"], strict=True)]
    full, kernel, low = served["full"], served["full_kernel"], served["stiefkv"]
    full_tps, low_tps = tps["full"], tps["stiefkv"]
    row = {
        "case": f"serve {args.shape} {args.key_mode} {cache_label(args)[8:]} B{B} ctx{N}",
        "model": f"{SHAPES[args.shape][0]} shapes, random weights",
        "key_mode": args.key_mode, "budget": args.budget, "achieved_budget": proj.achieved_budget,
        "bits": args.bits, "cache": cache_label(args),
        "bytes_ratio": low.cache_bytes / full.cache_bytes,
        "batch": B, "context": N, "new_tokens": args.new_tokens, "rounds": args.rounds,
        "prefill_tokens": args.chunk, "capture": "cuda graph (stiefkv.generate's)" if capture else "eager",
        "full_tps": full_tps, "full_kernel_tps": tps["full_kernel"], "stiefkv_tps": low_tps, "ratios": ratios,
        "full_tps_median": statistics.median(full_tps), "stiefkv_tps_median": statistics.median(low_tps),
        "full_kernel_tps_median": statistics.median(tps["full_kernel"]),
        "ratio_vs_transformers_static": statistics.median(lo / fu for fu, lo in zip(full_tps, low_tps)),
        "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
        "full_prefill_s": full.prefill_s, "stiefkv_prefill_s": low.prefill_s,
        "full_kernel_prefill_s": kernel.prefill_s,
        "full_cache_gib": full.cache_bytes / GIB, "stiefkv_cache_gib": low.cache_bytes / GIB,
        "full_peak_above_weights_gib": full.peak_gib, "stiefkv_peak_above_weights_gib": low.peak_gib,
        "full_kernel_peak_above_weights_gib": kernel.peak_gib,
        # the identity bases are exact: their prefill logits must be the uncompressed model's, up to rounding
        "full_kernel_logits_rel_diff": float((full.logits - kernel.logits).norm() / full.logits.norm()),
    }
    if getattr(args, "compact", None):
        comp = served["compacted"]
        over = {name: statistics.median(c / o for o, c in zip(others, tps["compacted"], strict=True))
                for name, others in (("best", best), ("stiefkv", tps["stiefkv"]))}
        row.update(case=f"{row['case']} keep{args.compact:g}", compact_keep=args.compact,
                   question_tokens=QUESTION, compacted_tps=tps["compacted"],
                   compacted_tps_median=statistics.median(tps["compacted"]),
                   compacted_cache_gib=comp.cache_bytes / GIB, compacted_peak_above_weights_gib=comp.peak_gib,
                   compacted_ratio=over["best"], compacted_vs_stiefkv=over["stiefkv"])
        del comp
    if args.baseline_cache:
        base = served["baseline"]
        row.update(baseline=args.baseline_cache, baseline_tps=tps["baseline"],
                   baseline_tps_median=statistics.median(tps["baseline"]),
                   baseline_cache_gib=base.cache_bytes / GIB,
                   baseline_bytes_ratio=base.cache_bytes / full.cache_bytes,
                   baseline_peak_above_weights_gib=base.peak_gib,
                   ratio_vs_baseline=statistics.median(
                       lo / b for b, lo in zip(tps["baseline"], tps["stiefkv"], strict=True)))
        del base
    del full, kernel, low, served
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if args.plain:
        with torch.inference_mode():
            row["plain_generate_tps"] = plain_generate_tps(model, ids, args.new_tokens)
        row["ratio_vs_plain"] = row["stiefkv_tps_median"] / row["plain_generate_tps"]
    if args.compiled:
        with torch.inference_mode():
            row["compiled_generate_tps"] = compiled_generate_tps(model, ids, args.new_tokens)
        row["ratio_vs_compiled"] = row["stiefkv_tps_median"] / row["compiled_generate_tps"]
    return row


def trial(model, proj, B: int, N: int, args, device, keep: float | None = None) -> dict | None:
    """Serve ``B`` rows of ``N`` tokens (prefill, capture, ``--new-tokens`` decode steps) with ``proj``
    (None: the uncompressed model on transformers' static cache); None when it runs out of memory. ``keep``:
    the rows' prompts compacted to that share of their tokens (:func:`synthetic_compacted`), a question
    read behind them: what serving holds after ``stiefkv.compact`` (not the prefill and compaction, which
    hold a row's whole cache for a while: bench_compaction.py times them)."""
    ids = torch.randint(0, model.config.vocab_size, (B, N if keep is None else QUESTION), device=device)
    served = prefix = None
    start = time.perf_counter()
    try:
        if proj is not None:
            stiefkv.load(model, proj)
        if keep is None:
            served = Served(model, ids, N + 2 + 2 * args.new_tokens, args.chunk, True,
                            filled_first(B, N, args))
        else:
            prefix = synthetic_compacted(model, B, N, keep, device)
            held = max(p.shape[2] for p in prefix.head_positions)
            served = Served(model, ids, held + QUESTION + 2 + 2 * args.new_tokens, args.chunk, True,
                            prefix=prefix, at=N)
            prefix = None
        served.decode_tps(args.new_tokens)
        out = {"batch": B, "tps": served.decode_tps(args.new_tokens), "peak_gib": served.peak_gib,
               "cache_gib": served.cache_bytes / GIB, "seconds": time.perf_counter() - start}
        # a progress line per trial: a call cut short by a time limit still tells what ran
        print(f"  trial {B}x{N}: {out['tps']:.0f} tok/s, peak {out['peak_gib']:.2f} GiB "
              f"({out['seconds']:.0f} s)", flush=True)
        return out
    except (torch.cuda.OutOfMemoryError, MemoryError):  # MemoryError: refused before allocating
        print(f"  trial {B}x{N}: out of memory ({time.perf_counter() - start:.0f} s)", flush=True)
        return None
    finally:
        if proj is not None:
            stiefkv.unload(model)
        del served, ids, prefix
        gc.collect()
        torch.cuda.empty_cache()


def filled_first(B: int, N: int, args) -> int:
    """With ``--fill-first``, the tokens of each row a capacity trial writes directly: all but its last
    two prefill forwards' (``--chunk`` tokens over the ``B`` rows each), which attend over the filled
    cache as a whole prefill's last forwards do; the prefill over codes merges fixed-size slices of keys,
    so no forward's transient grows with the tokens held."""
    if not getattr(args, "fill_first", False):
        return 0
    return max(0, N - 2 * chunk_per_row(args.chunk, B))


def fill_synthetic(cache, n: int) -> None:
    """Make a fresh static latent cache hold ``n`` tokens of random latents (codes: random bytes, small
    scales and lows in every group; an exact ring: random) at positions ``0..n-1`` without a prefill, in
    place (no transient beyond one buffer's)."""
    for bufs in (cache.keys_buf, cache.values_buf):
        for buf in bufs:
            if hasattr(buf, "codes"):  # CodeBuffer or WindowedCodes
                buf.codes[:, :, :n].random_(0, 256)
                if buf.low is None:  # log8 scales: code 59 is 2^((59 - 112) / 8) ≈ 0.01
                    buf.scale.fill_(59)
                else:
                    buf.scale.fill_(0.01)
                    buf.low.fill_(-1.0)
                if hasattr(buf, "ring"):
                    buf.ring.normal_()
            else:
                buf[:, :, :n].normal_()
    cache.positions[:, :n] = torch.arange(n, device=cache.positions.device, dtype=torch.int32)
    cache.filled.fill_(n)
    cache.seen = n


def context_trial(model, proj, N: int, args, device) -> dict | None:
    """One row holding ``N`` tokens (written directly, :func:`fill_synthetic`: a prefill of a million
    tokens is tens of minutes of attention), its decode step captured and replayed ``--new-tokens`` times;
    None when it runs out of memory."""
    runner = None
    try:
        stiefkv.load(model, proj)
        sync(device)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        runner = Runner(model, make_cache(model, 1, N + 2 + 2 * args.new_tokens), None)
        fill_synthetic(runner.cache, N)
        tokens = torch.zeros(1, 2 + 2 * args.new_tokens, dtype=torch.long, device=device)
        state = DecodeState(tokens, torch.full((1, 1), N, device=device), N)
        with torch.inference_mode():
            runner.capture(state)
            runner.replay(args.new_tokens // 2)  # warm
            sync(device)
            start = time.perf_counter()
            runner.replay(args.new_tokens)
            sync(device)
            tps = args.new_tokens / (time.perf_counter() - start)
        return {"context": N, "tps": tps, "peak_gib": (torch.cuda.max_memory_allocated() - base) / GIB,
                "cache_gib": _cache_bytes(runner.cache) / GIB}
    except (torch.cuda.OutOfMemoryError, MemoryError):  # MemoryError: refused before allocating
        return None
    finally:
        stiefkv.unload(model)
        del runner
        gc.collect()
        torch.cuda.empty_cache()


def context_capacity(model, caches: dict, args, device, emit=lambda row: None,
                     step: int = 4096) -> list[dict]:
    """The longest context (a multiple of ``step``) one row holds and decodes under ``--cap-gib``, per
    cache: predicted from the bytes and peak of a ``step``-token trial, then walked up while it fits and
    down while it does not."""
    cap = args.cap_gib * GIB
    index = torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(index).total_memory,
                                               index)
    weights = torch.cuda.memory_allocated() / GIB
    rows = []
    for name, proj in caches.items():
        small = context_trial(model, proj, step, args, device)
        if small is None:
            rows.append({"cache": name, "batch": 1, "context": 0})
            emit(rows[-1])
            continue
        per_token = small["cache_gib"] / (step + 2 + 2 * args.new_tokens)
        fixed = small["peak_gib"] - small["cache_gib"]
        N = max(step, int((args.cap_gib - weights - fixed) / per_token) // step * step)
        runs = {step: small}
        while N not in runs or runs[N] is not None:
            runs[N] = runs.get(N) or context_trial(model, proj, N, args, device)
            if runs[N] is None:
                break
            N += step
        while runs.get(N) is None and N > step:
            N -= step
            if N not in runs:
                runs[N] = context_trial(model, proj, N, args, device)
        best = runs[N]
        rows.append({"cache": name, "batch": 1, "context": N, "tokens": N, "tps": best["tps"],
                     "peak_gib": best["peak_gib"], "cache_gib": best["cache_gib"], "weights_gib": weights,
                     "refused_context": N + step, "trials": sorted(runs)})
        emit(rows[-1])
        print(f"context capacity {name}: {N} tokens in one row under {args.cap_gib} GiB, "
              f"{best['tps']:.0f} tok/s", flush=True)
    return rows


def start_of(name: str, args) -> int | None:
    """Where ``--capacity`` starts a cache's search, when not from its peaks at 1 and 2 rows: StiefKV's at
    ``--start-batch``, a quantization-only baseline's at ``--baseline-start-batch`` (their peaks predict far
    more rows than fit, and each trial at tens of rows is minutes of prefill); the uncompressed cache's
    search takes seconds."""
    if name.startswith("stiefkv"):
        return getattr(args, "start_batch", None)
    if name.startswith("quantization only"):
        return getattr(args, "baseline_start_batch", None)
    return None


def boundary(run, runs: dict, B: int) -> int:
    """The largest batch that ``run`` serves (``run(b)`` is None when ``b`` rows do not fit), searched from
    ``B`` with ``runs`` (batch → result) already known: steps of 1, 2, 4, … away from ``B`` while the answer
    stays on the same side, then halving the bracket, so that a start far from the answer costs a few
    trials, not one per row (a trial at tens of rows of 32k is minutes of prefill; one that runs out of
    memory late in the prefill costs as much). Every batch it rests on ran, and so did the next one up,
    refused (0: one row did not fit)."""
    step = 1
    while True:
        if B not in runs:
            runs[B] = run(B)
        fits = [b for b, r in runs.items() if r is not None]
        refused = [b for b, r in runs.items() if r is None]
        lo = max(fits, default=0)
        hi = min((b for b in refused if b > lo), default=None)
        if hi is not None and hi == lo + 1:
            return lo
        if hi is None:  # still fitting: gallop up
            B, step = lo + step, step * 2
        elif not fits:  # still refused: gallop down
            B, step = max(1, hi - step), step * 2
        else:
            B = (lo + hi) // 2


def capacity(model, caches: dict, args, device, emit=lambda row: None,
             keeps: dict | None = None) -> list[dict]:
    """The largest batch at ``--context`` tokens that serves under ``--cap-gib`` (weights included), for
    each cache, and the decode tokens/s there; ``keeps``: the caches whose prompts are compacted, and to
    what share of their tokens (:func:`trial`). The search (:func:`boundary`) starts from the batch that the
    peaks of one and two rows predict, or from ``--start-batch`` / ``--baseline-start-batch``: the answer is
    a batch that ran and the next one that did not."""
    cap = args.cap_gib * GIB
    index = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(cap / total, index)
    weights = torch.cuda.memory_allocated() / GIB
    rows = []
    for name, proj in caches.items():
        keep = (keeps or {}).get(name)

        def run(b: int, proj=proj, keep=keep) -> dict | None:
            return trial(model, proj, b, args.context, args, device, keep)

        if start_of(name, args):
            runs, B = {}, start_of(name, args)
        else:
            runs = {1: run(1)}
            if runs[1] is None:
                rows.append({"cache": name, "batch": 0})
                emit(rows[-1])
                continue
            runs[2] = run(2)
            # the peak is a fixed part (a prefill chunk's activations) plus a part per row: two points give
            # both
            per_row = runs[1]["peak_gib"] if runs[2] is None else runs[2]["peak_gib"] - runs[1]["peak_gib"]
            fixed = runs[1]["peak_gib"] - per_row
            B = max(1, int((args.cap_gib - weights - fixed) / per_row))
        B = boundary(run, runs, B)
        best = runs.get(B)
        if best is None:  # a --start-batch search that walked down to one row, and one row did not fit
            rows.append({"cache": name, "batch": 0, "trials": sorted(runs)})
            emit(rows[-1])
            continue
        rows.append({"cache": name, "batch": B, "tokens": B * args.context, "tps": best["tps"],
                     "peak_gib": best["peak_gib"], "cache_gib": best["cache_gib"], "weights_gib": weights,
                     "refused_batch": B + 1, "trials": sorted(runs),
                     "trial_seconds": best.get("seconds")})  # prefill and decode of that batch
        emit(rows[-1])
        print(f"capacity {name}: batch {B} at {args.context} tokens under {args.cap_gib} GiB, "
              f"{best['tps']:.0f} tok/s", flush=True)
    return rows


def main() -> None:
    parser = utils.parser(__doc__.split("\n")[0])
    parser.add_argument("--shape", default="8b", choices=sorted(SHAPES))
    parser.add_argument("--cases", nargs="+", type=utils.batch_context, default=["8x16384"],
                        help="BATCHxCONTEXT, e.g. 1x32768 8x16384")
    parser.add_argument("--budget", type=float, default=None,
                        help="ranks as a fraction of the head dim (default 0.5)")
    parser.add_argument("--bits", type=int, default=None, choices=[16, 8, 4, 3, 2],
                        help="latent codes (token layout, fp16 scale and low per 64 channels) for K and V")
    parser.add_argument("--recent", type=int, default=None,
                        help="with --bits: the newest tokens kept exact (--bits auto's default is 16; decode "
                             "then reads the codes beside the exact ring)")
    parser.add_argument("--key-mode", default=None, choices=["pre_rope", "post_rope", "auto"],
                        help="default: pre_rope, or with --storage-from the checkpoint's (per layer); auto "
                             "(--storage-from only): post_rope for the layers whose keys keep full rank")
    parser.add_argument("--storage-from", default=None, metavar="CKPT",
                        help="serve the storage of a calibrated checkpoint (ranks as fractions of the head "
                             "dim, storage specs per layer) on random bases at --shape's shapes, instead of "
                             "--budget/--bits/--recent")
    parser.add_argument("--baseline-cache", default=None, metavar="NAME",
                        help="also serve a quantization-only cache of `stiefkv eval --baseline` (int4, "
                             "kivi2, …) on the same kernels, beside StiefKV (a cache in --capacity too)")
    parser.add_argument("--new-tokens", type=utils.at_least(1), default=64)
    parser.add_argument("--rounds", type=utils.at_least(1), default=3)
    parser.add_argument("--chunk", type=utils.at_least(1), default=PREFILL_TOKENS,
                        help="prompt tokens a prefill forward takes over all rows (generate's prefill_chunk)")
    parser.add_argument("--code-slice", type=utils.at_least(0), default=None, metavar="KEYS",
                        help="prefill over codes dequantizes this many keys at a time (kernels.lowrank."
                             "PREFILL_CODE_SLICE; default: its value, 4096)")
    parser.add_argument("--rebuilt", default=None, choices=["on", "off"],
                        help="a prefill's keys that every query sees whole through rebuilt keys and "
                             "FlashAttention, or the low-rank prefill kernel "
                             "(on: both key modes, off: neither; default: kernels.lowrank.PREFILL_REBUILT, "
                             "pre_rope only)")
    parser.add_argument("--plain", action="store_true", help="also time plain generate (uncompressed)")
    parser.add_argument("--compact", type=float, default=None, metavar="KEEP",
                        help="also serve the StiefKV cache of the prompt compacted to KEEP of its tokens (a "
                             f"synthetic compacted cache, then a {QUESTION}-token question): decode over "
                             "the entries stiefkv.generate holds after stiefkv.compact; with --capacity, "
                             "its largest batch too")
    parser.add_argument("--decode-option", type=decode_option, action="append", metavar="KEY=VALUE",
                        help="a decode-kernel option over its default for decode over codes (pairs=false, "
                             "block_n=64; repeatable), for a same-run A/B end to end; in the case's name")
    parser.add_argument("--compiled", action="store_true",
                        help="also time generate over transformers' StaticCache, compiled by transformers on "
                             "CUDA (uncompressed; the first call compiles)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (smoke test; no row)")
    parser.add_argument("--capacity", action="store_true",
                        help="the largest batch at --context under --cap-gib, per cache (CUDA)")
    parser.add_argument("--context-capacity", action="store_true",
                        help="the longest context one row holds under --cap-gib, per cache (CUDA; the cache "
                             "filled directly, not prefilled)")
    parser.add_argument("--context", type=utils.at_least(1), default=32768)
    parser.add_argument("--cap-gib", type=float, default=40.0)
    parser.add_argument("--fill-first", action="store_true",
                        help="--capacity: write each trial's cache directly (random latents) up to its last "
                             "two prefill forwards, which run for real (minutes of prefill a trial become "
                             "seconds; the case gets ' filled')")
    parser.add_argument("--start-batch", type=utils.at_least(1), default=None,
                        help="--capacity: start StiefKV's search (not the baselines') at this batch, not the "
                             "one its peaks at 1 and 2 rows predict (a trial at tens of rows is minutes of "
                             "prefill)")
    parser.add_argument("--baseline-start-batch", type=utils.at_least(1), default=None,
                        help="--capacity: start the --baseline-cache search at this batch (KIVI-2's peaks at "
                             "1 and 2 rows predicted 30 rows at 32k under 40 GiB, where 16 fit)")
    args = parser.parse_args()
    utils.check_results_dir(parser)
    if not args.tiny:
        utils.require_cuda("--tiny serves a tiny model on the CPU")
    args.decode_option = dict(args.decode_option or [])
    given = [f"--{name}" for name in ("budget", "bits", "recent") if getattr(args, name) is not None]
    if args.storage_from and given:
        parser.error(f"--storage-from serves the checkpoint's ranks and storage; drop {', '.join(given)}")
    if args.key_mode == "auto" and not args.storage_from:
        parser.error("--key-mode auto picks per layer from a checkpoint's ranks: it needs --storage-from")
    if args.storage_from and not Path(args.storage_from).is_file():
        parser.error(f"--storage-from {args.storage_from}: no such checkpoint file")
    loose = [f"--{name.replace('_', '-')}" for name in ("fill_first", "start_batch", "baseline_start_batch")
             if getattr(args, name) not in (None, False)]
    if loose and not args.capacity:
        parser.error(f"{', '.join(loose)} tune the --capacity search; give --capacity or drop them")
    codes = args.storage_from or args.baseline_cache or (args.bits or 16) < 16
    if args.decode_option and not codes:
        parser.error("--decode-option changes decode over codes; this run serves none (bf16 latents): give "
                     "--bits, --storage-from or --baseline-cache, or drop it")
    if args.budget is not None and not 0 < args.budget <= 1:
        parser.error(f"--budget must be in (0, 1] (ranks as a fraction of the head dim), got {args.budget:g}")
    if args.compact is not None and not 0 < args.compact <= 1:
        parser.error(f"--compact must be in (0, 1] (the share of the prompt's tokens kept), got "
                     f"{args.compact:g}")
    if args.compact is not None and args.context_capacity:
        parser.error("--compact serves the --cases and the --capacity search; --context-capacity does not "
                     "take it")
    if args.cap_gib <= 0:
        parser.error(f"--cap-gib must be above 0, got {args.cap_gib:g}")
    if args.baseline_cache is not None and unknown_baseline(args.baseline_cache):  # before any prefill
        parser.error(unknown_baseline(args.baseline_cache))
    from stiefkv.kernels import lowrank

    if args.code_slice is not None:
        lowrank.PREFILL_CODE_SLICE = args.code_slice
    args.code_slice = lowrank.PREFILL_CODE_SLICE  # the rows record the slice in effect
    if args.rebuilt is not None:
        lowrank.PREFILL_REBUILT = ("pre_rope", "post_rope") if args.rebuilt == "on" else ()
    args.rebuilt = lowrank.PREFILL_REBUILT
    if args.decode_option:
        override_decode(args.decode_option)
    if args.tiny:
        args.shape = "tiny"
    print(utils.header(), flush=True)
    device = torch.device("cpu" if args.tiny else "cuda")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**SHAPES[args.shape][1])).to(dtype).eval()
    if args.storage_from:
        proj = storage_projections(model, args.storage_from, args.key_mode)
        mode = proj.key_mode if proj.layer_key_modes is None else "per_layer"
        args.key_mode, args.budget, args.bits, args.recent = mode, proj.budget, 16, 0
        stored = storage_fields(proj)
    else:
        args.key_mode = args.key_mode or "pre_rope"
        args.budget = 0.5 if args.budget is None else args.budget
        args.bits = 16 if args.bits is None else args.bits
        args.recent = 0 if args.recent is None else args.recent
        proj = with_codes(random_projections(model, args.budget, args.key_mode), args.bits, args.recent)
        stored = {}
    label = cache_label(args)
    if args.capacity or args.context_capacity:
        caches = {"uncompressed (our kernels)": identity_projections(model), label: proj}
        if args.baseline_cache:
            name = f"quantization only: {args.baseline_cache}"
            caches[name] = baseline_projections(model, args.baseline_cache)
        keeps = {}
        if args.compact:  # the same StiefKV cache over prompts compacted, after the others
            keeps[f"compacted to {args.compact:g}: {label}"] = args.compact
            caches.update(dict.fromkeys(keeps, proj))
        by_context = args.context_capacity
        kind = "capacity-context" if by_context else "capacity"
        done = []

        def emit(row: dict) -> None:
            """Write each cache's row as soon as it is measured (a run cut short keeps what it finished),
            with its ratios to the first cache's (the uncompressed one)."""
            base = (done or [row])[0]
            row.update(case=f"{kind} {args.shape} {args.key_mode} {label.removeprefix('stiefkv ')} "
                            f"{'B1' if by_context else f'ctx{args.context}'} cap{args.cap_gib:g}"
                            + (" filled" if args.fill_first and not by_context else ""),
                       model=f"{SHAPES[args.shape][0]} shapes, random weights", cap_gib=args.cap_gib,
                       new_tokens=args.new_tokens, key_mode=args.key_mode, prefill_tokens=args.chunk,
                       code_slice=args.code_slice, prefill_rebuilt=args.rebuilt, start_batch=args.start_batch,
                       baseline_start_batch=args.baseline_start_batch, decode_options=args.decode_option,
                       capacity_ratio=row.get("tokens", 0) / base["tokens"] if base.get("tokens") else None,
                       tps_ratio=row.get("tps", 0) / base["tps"] if base.get("tps") else None)
            row.setdefault("context", args.context)
            if row["cache"] == label:
                row.update(stored)
            done.append(row)
            utils.write_rows("serve_capacity", row)

        if by_context:
            context_capacity(model, caches, args, device, emit)
        else:
            capacity(model, caches, args, device, emit, keeps)
        return
    for case in args.cases:
        B, N = (int(x) for x in case.lower().split("x"))
        row = run_case(model, proj, B, N, args, device)
        row.update(stored, decode_options=args.decode_option)
        if not args.tiny and not eager_only():  # the rows and BENCHMARKS.md are graph-captured decode
            utils.write_rows("serve", row)
        print(summary(row, args.plain), flush=True)


def summary(row: dict, plain: bool) -> str:
    return (f"{row['case']}: transformers static {row['full_tps_median']:.0f} tok/s, full rank on our kernel "
            f"{row['full_kernel_tps_median']:.0f} tok/s (logits {row['full_kernel_logits_rel_diff']:.1e} "
            "apart), "
            f"StiefKV {row['stiefkv_tps_median']:.0f} tok/s, {row['ratio_median']:.2f}x the faster "
            f"({row['ratio_min']:.2f}-{row['ratio_max']:.2f}); prefill {row['full_prefill_s']:.2f} / "
            f"{row['stiefkv_prefill_s']:.2f} s; cache {row['full_cache_gib']:.2f} / "
            f"{row['stiefkv_cache_gib']:.2f} GiB; peak above weights "
            f"{row['full_peak_above_weights_gib']:.2f} / "
            f"{row['stiefkv_peak_above_weights_gib']:.2f} GiB"
            + (f"; plain generate {row['plain_generate_tps']:.0f} tok/s" if plain else "")
            + (f"; compiled static generate {row['compiled_generate_tps']:.0f} tok/s"
               if "compiled_generate_tps" in row else "")
            + (f"; compacted to {row['compact_keep']:g}: {row['compacted_tps_median']:.0f} tok/s, "
               f"{row['compacted_ratio']:.2f}x the faster uncompressed, cache "
               f"{row['compacted_cache_gib']:.2f} GiB"
               if "compact_keep" in row else "")
            + (f"; quantization only ({row['baseline']}) {row['baseline_tps_median']:.0f} tok/s, StiefKV "
               f"{row['ratio_vs_baseline']:.2f}x it, its cache {row['baseline_cache_gib']:.2f} GiB"
               if "baseline" in row else ""))


if __name__ == "__main__":
    main()
