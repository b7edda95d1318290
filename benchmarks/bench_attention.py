"""Low-rank attention kernel against full-rank SDPA at Llama-3-8B attention shapes (H=32, G=8, d=128, bf16).

Rows go to ``benchmarks/results/attention.jsonl`` (``render.py`` makes BENCHMARKS.md's tables of them), one
per measurement, by table:

- ``decode``: one new token per sequence at batch × context ∈ {1×32k, 8×8k, 16×16k, 4×128k}, budgets 50 %
  (r_k = r_v = 64) and 25 % (r = 32), both key modes: the kernel at its default configuration, full-rank
  ``scaled_dot_product_attention(..., enable_gqa=True)`` on the same shape (separate k and v), the eager
  call, and for ``pre_rope`` the polynomial sin/cos (``fast_sincos=False``); bytes the kernel must read
  (latents, plus int64 key positions for ``pre_rope``) and the copy bandwidth measured in the same run;
- ``sweep``: the same cases at a few other configurations (tile, warps, stages, key splits), with their own
  default and SDPA times, so that the best of the sweep stands beside the default;
- ``prefill``: 8k tokens, causal, against full-rank SDPA;
- ``fold``: ``P_v`` in the kernel's epilogue versus folded into ``o_proj`` (``P_v=None`` and an ``o_proj``
  whose input dimension is ``H·r_v``), each followed by its ``o_proj`` matmul;
- ``host``: host time of one decode call at the 1B model's shapes (d = 64, r = 32), against SDPA's;
- ``quant``: decode over bf16 latents and int8 and int4 codes (token layout, fp16 scale and low per 64
  channels, dequantized in registers) at the decode shapes and 50 % ranks, both key modes, against SDPA;
  bytes read (latents or codes, scales, lows, positions) and the read bandwidth against the copy's; beside
  the default, the configurations of ``QUANT_SWEEP``: the candidates that read each tile one iteration
  ahead (``prefetch=True``) and that fold the scales into logits and probabilities
  (``fold_scales=True``), more key splits, other tiles, warps and stages;
- ``band``: a prefill chunk's exact band over a windowed store (rows × tokens behind an 8-token window), the
  band kernel at its default and other warps against the PyTorch reference it replaced.

Decode times are device times from CUDA-graph replay with an L2 flush before every call
(:func:`utils.graph_ms`); prefill and ``fold`` use ``do_bench`` (:func:`utils.bench_ms`). Random data.

    python benchmarks/bench_attention.py [--tables decode prefill] [--quick]
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

from stiefkv.kernels import band as band_kernel
from stiefkv.kernels._common import ExactTail
from stiefkv.kernels.lowrank import _default_config, _num_sms, _token_int2, _token_int4, lowrank_attention
from stiefkv.kernels.reference import lowrank_attention as reference_attention

H, G, D_HEAD, D_MODEL = 32, 8, 128, 4096
# --heads: the attention shapes measured (query heads, KV heads, head dim, model width); rows of any but the
# first name them in their case and table ("decode-smollm2"), so that BENCHMARKS.md's Llama-3-8B tables and
# claims never read them
HEADS = {"llama8b": (32, 8, 128, 4096), "smollm2": (9, 3, 64, 576), "llama1b": (32, 8, 64, 2048)}
CASE_PREFIX = TABLE_SUFFIX = ""
DECODE_SHAPES = [(1, 32768), (8, 8192), (16, 16384), (4, 131072)]
BUDGETS = {"50%": 64, "25%": 32}
TARGETS = {("post_rope", "50%"): 0.55, ("pre_rope", "50%"): 0.65, ("post_rope", "25%"): 0.35}
MODES = ("post_rope", "pre_rope")
# Decode configurations tried beside the default; "splits" multiplies the rule's number of key splits
# (_default_config's; the default launches more where more programs fit an SM: lowrank._occupancy_splits).
SWEEP = [
    {"block_n": 32, "num_warps": 4, "num_stages": 3},
    {"block_n": 64, "num_warps": 4, "num_stages": 3},
    {"block_n": 64, "num_warps": 4, "num_stages": 4},
    {"block_n": 128, "num_warps": 4, "num_stages": 3},
    {"block_n": 128, "num_warps": 8, "num_stages": 3},
    {"block_n": 64, "num_warps": 4, "num_stages": 3, "splits": 2},
    {"block_n": 64, "num_warps": 4, "num_stages": 3, "splits": 0.5},
]
# Tried beside the default of each quant row ("splits" multiplies the rule's number of key splits).
QUANT_SWEEP = [
    {"prefetch": True},
    {"prefetch": False},
    {"prefetch": False, "block_n": 64},  # the default for codes before 2026-12-01
    {"fold_scales": True},
    {"fold_scales": True, "block_n": 128},
    {"splits": 2},
    {"splits": 4},
    {"block_n": 64},
    {"block_n": 128},
    {"block_n": 128, "prefetch": True, "splits": 2},
    {"num_warps": 8},
    {"num_stages": 2},
    {"num_stages": 4},
    # int4 only: the interleaved loop of before the even/odd split (the default since 2026-12-02), and the
    # split without its two refinements (defaults since the second session of 2026-12-02)
    {"nibbles": False},
    {"nibble_rebuild": False},
    {"nibble_fold": False, "prefetch": True},  # the fold needs the prefetch (off on the wide int4 tile)
    # pre_rope: the rotated keys as the logits dot's left operand, from registers (2026-12-02, third session;
    # the default over float latents and int4 keys since)
    {"keys_left": False},
    {"keys_left": True},
    {"keys_left": True, "num_stages": 4},
    {"keys_left": True, "block_n": 128},
    {"keys_left": True, "block_n": 64},
    {"keys_left": True, "splits": 2},
    # more programs an SM for pre_rope (2026-12-06; kernel_sass, triton 3.6, r 64): 32-key tiles at 128
    # registers, four programs, and a 168 ceiling at 64 keys, three. Timed on the H100 the same day: 1.3-2.3×
    # slower at 32 keys (the entry kept was the least slow of them; splits × 1.5 and 4 stages did worse),
    # the ceiling −1.8 % at one bf16 shape and +40-60 % over int4 keys (docs/notes/kernel-tries.md)
    {"keys_left": True, "block_n": 32, "splits": 2, "max_registers": 128},
    {"keys_left": True, "max_registers": 168, "splits": 1.5},
    # pre_rope: the angles' whole turns rounded on the FMA pipe, not by FRND on the XU pipe the MUFU sin/cos
    # run on (2026-12-06, second session: Nsight Compute puts 110 of a bf16 tile's 748 instructions a warp on
    # that pipe, 32 of them FRND; the static count is unchanged, FRND 32 → FADD). The default since the
    # third session of 2026-12-06 (3-6 % less time at every shape timed), so the entry is FRND's, as before
    {"sincos_fadd": False},
    {"sincos_fadd": True},  # int3 keys' default is FRND's: this entry re-tests their exclusion
    {"sincos_fadd": True, "max_registers": 168, "splits": 1.5},
    # 1.5 × the splits: meant as three programs an SM, but at 255 registers a thread (Nsight Compute, int4
    # post_rope, 2026-12-03) only two fit, so these run 1.45 waves of two
    {"splits": 1.5},
    # int4 codes are a quarter of bf16's bytes a key: tiles of 256 keys put as many bytes in flight as bf16's
    # 64 (the default for int4 post_rope since 2026-12-03), and 8 warps a program
    {"block_n": 256},
    {"block_n": 256, "num_warps": 8},
    {"block_n": 256, "num_stages": 2},
    {"block_n": 128, "num_warps": 8, "num_stages": 4},
    {"splits": 1.5, "num_stages": 2},
    {"splits": 1.5, "num_stages": 1},
    # fewer warps a program, more programs (2026-12-03, second session): the row maxima and sums of a
    # 4-warp program cross warps through shared memory and a barrier each tile; a 1- or 2-warp program
    # keeps them in a warp, and more programs an SM keep more tiles in flight
    {"num_warps": 2, "block_n": 128, "splits": 2},
    {"num_warps": 2, "block_n": 256, "splits": 2},
    {"num_warps": 1, "block_n": 64, "splits": 4},
    {"num_warps": 1, "block_n": 128, "splits": 4},
    {"num_warps": 2, "block_n": 128, "splits": 4},
    # a register ceiling: 168 a thread fits three 4-warp programs an SM, 128 four (spilling the rest)
    {"max_registers": 168, "splits": 1.5},
    {"max_registers": 128, "splits": 2},
    {"max_registers": 128, "splits": 2, "block_n": 128},
    # value codes decoded just before the value dot (their decoded tile not live beside the logits)
    {"late_values": True, "prefetch": True},  # as the fold, it needs the prefetch
    {"late_values": True, "prefetch": True, "max_registers": 168, "splits": 1.5},
    # int8 only: codes read as 32-bit words and met as two tiles of channel pairs (2026-12-05, fourth
    # session; fp8_decode_probe.py's int8-pairs: half the instructions a tile, 128 registers at r 128); with
    # prefetch only (without, the launcher falls back to the bytes' loop)
    {"pairs": True},
    {"pairs": True, "splits": 1.5},
    {"pairs": True, "block_n": 64},
    {"pairs": True, "block_n": 64, "splits": 1.5},
    {"pairs": False, "block_n": 64},  # the bytes' loop at the same tile, so --sweep-with pairs is an A/B
    # channel-layout keys (--channel-keys only): the scales as a row a token group, broadcast (2026-12-05,
    # fifth session; kernel_sass.py --channel: pre_rope int2 r 64 no longer spills, post_rope 236 → 142
    # registers)
    {"channel_rows": True},
    {"channel_rows": True, "block_n": 64},
    # the per-element loads (rows are the default since; planes, on for int2, would read the rows)
    {"channel_rows": False, "planes": False, "block_n": 64},
    {"channel_rows": False, "planes": False},
    # int2 only: codes read as words and met as bit planes, channel-layout scales by rows (2026-12-05, fifth
    # session; kernel_sass.py --channel 2, triton 3.6: 1235 → 773 instructions a 64-key tile at r 128
    # post_rope, 1707 → 1278 pre_rope)
    {"planes": True},
    {"planes": True, "block_n": 64},
    {"planes": True, "block_n": 64, "splits": 1.5},
    {"planes": False},  # the generic unpacking at the default tile (planes are the default since)
    # int4 only: nibbles read as 32-bit words (2026-12-05, fifth session; kernel_sass.py: post_rope r 64
    # 717 → 524 instructions a 128-key tile, and at 256 keys with prefetch 973 against the default's 1375)
    {"nibble_words": True, "prefetch": True},
    {"nibble_words": True, "prefetch": True, "block_n": 256},
    {"nibble_words": True, "prefetch": True, "block_n": 256, "splits": 2},
    # int3 only: codes met as bit planes, field by field, read as the bytes' loop reads them (2026-12-05,
    # eighth session; kernel_sass.py --channel 3, triton 3.6: channel keys with scale rows at r 128 and
    # 64-key tiles 1881 → 1585 instructions a tile pre_rope, 1422 → 1082 post_rope; token keys even). On
    # since for pre_rope channel keys, whose int3 tiles are 64 keys wide as token keys' are (H100, 2026-12-06)
    {"int3_planes": True},
    {"int3_planes": False},
    {"int3_planes": True, "block_n": 128},
    # pre_rope over bf16 latents: each tile's logits formed one iteration ahead, so the next tile's rebuild,
    # sin/cos and rotation and this tile's softmax and value dot are independent work in one iteration
    # (2026-12-06, seventh session; kernel_sass.py, triton 3.6, r 64: 748 → 769 instructions a tile with
    # keys_left, 699 without; 255 and 250 registers, no stack, still two programs an SM)
    {"ahead": True},
    {"ahead": True, "keys_left": False},
    {"ahead": True, "splits": 1.5},
    {"ahead": False, "keys_left": True},  # the default before ahead (where ahead is now taken)
]
NIBBLE_OPTIONS = {"nibbles": None, "nibble_rebuild": "pre_rope", "nibble_fold": "post_rope"}  # key mode
TABLES = ("decode", "prefill", "sweep", "fold", "host", "quant", "shared", "band")
# the band table: prefill chunks (rows × tokens) behind an exact window of BAND_WINDOW tokens, as
# generate's prefill writes them into a windowed store; the band kernel's warps swept
BAND_SHAPES = [(32, 128), (8, 512), (1, 2048)]
BAND_WINDOW = 8
BAND_DEFAULT_WARPS = band_kernel.NUM_WARPS
BAND_WARPS = (4, 8)
QUANT_BITS = (16, 8, 4)
DTYPE = torch.bfloat16
NAME = "attention"
DEVICE = "cuda"  # the CPU smoke test (tests/test_benchmarks.py) sets "cpu" under TRITON_INTERPRET=1


def set_heads(name: str) -> None:
    """Measure at another model's attention shapes (:data:`HEADS`); its rows' cases start with ``name``."""
    global H, G, D_HEAD, D_MODEL, CASE_PREFIX, TABLE_SUFFIX, BUDGETS
    H, G, D_HEAD, D_MODEL = HEADS[name]
    CASE_PREFIX, TABLE_SUFFIX = f"{name} ", f"-{name}"
    BUDGETS = {"50%": D_HEAD // 2, "25%": D_HEAD // 4}


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def latent_inputs(B: int, Nq: int, Nk: int, r: int, d: int | None = None) -> dict:
    """Queries, latents (distinct for keys and values), fp32 orthonormal bases, positions and RoPE table."""
    d = d or D_HEAD
    return {
        "q": torch.randn(B, H, Nq, d, device=DEVICE, dtype=DTYPE),
        "z_k": torch.randn(B, G, Nk, r, device=DEVICE, dtype=DTYPE),
        "z_v": torch.randn(B, G, Nk, r, device=DEVICE, dtype=DTYPE),
        "P_k": utils.random_basis(G, d, r, device=DEVICE),
        "P_v": utils.random_basis(G, d, r, device=DEVICE),
        "positions": torch.arange(Nk, device=DEVICE)[None].expand(B, Nk).contiguous(),
        "rope": utils.rope_spec(d, device=DEVICE),
    }


def kernel_call(x: dict, mode: str, *, with_pv: bool = True, **cfg):
    """``lowrank_attention`` on the inputs ``x`` as a no-argument callable."""
    return functools.partial(
        lowrank_attention,
        x["q"],
        x["z_k"],
        x["z_v"],
        x["P_k"],
        x["P_v"] if with_pv else None,
        key_mode=mode,
        positions=x["positions"],
        rope=x["rope"],
        **cfg,
    )


def sdpa_decode_ms(B: int, N: int) -> dict:
    q = torch.randn(B, H, 1, D_HEAD, device=DEVICE, dtype=DTYPE)
    k = torch.randn(B, G, N, D_HEAD, device=DEVICE, dtype=DTYPE)
    v = torch.randn(B, G, N, D_HEAD, device=DEVICE, dtype=DTYPE)
    return utils.graph_ms(functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True))


def default_config(B: int, N: int, mode: str, r: int, bits: int = 16, nibbles_kv: bool = False,
                   k_channel: bool = False, int2_kv: bool = False) -> dict:
    """The kernel's default for these inputs; ``nibbles_kv`` and ``int2_kv`` as :func:`_token_int4` and
    :func:`_token_int2` find the codes, ``k_channel``: key codes in the channel layout."""
    cfg = _default_config(H // G, N, mode, B * G, _num_sms(torch.device(DEVICE)), r, bits < 16, bits,
                          nibbles_kv, k_channel, int2_kv=int2_kv, head_dim=D_HEAD)
    keys = ("block_n", "num_warps", "num_stages", "num_splits") + (("prefetch",) if bits < 16 else ()) \
        + (("keys_left", "sincos_fadd", "ahead") if mode == "pre_rope" else ())
    return {k: cfg[k] for k in keys}


def launched_splits(x: dict, mode: str) -> int:
    """The split count the default call launches on ``x``: the rule's (:func:`default_config`), or more where
    the compiled kernel fits more than two programs an SM (``lowrank._occupancy_splits``)."""
    return kernel_call(x, mode, return_config=True)()["num_splits"]


def case_fields(B: int, N: int, budget: str, mode: str) -> dict:
    r = BUDGETS[budget]
    return {
        "case": f"decode {CASE_PREFIX}{utils.shape_name(B, N)} r{r} {mode}",
        "B": B,
        "N": N,
        "H": H,
        "G": G,
        "d": D_HEAD,
        "r": r,
        "budget": budget,
        "key_mode": mode,
        "dtype": "bfloat16",
    }


def read_bytes(x: dict, mode: str) -> int:
    n = (x["z_k"].numel() + x["z_v"].numel()) * x["z_k"].element_size()
    return n + (x["positions"].numel() * x["positions"].element_size() if mode == "pre_rope" else 0)


def shared_inputs(B: int, N: int, R: int) -> dict:
    """:func:`latent_inputs` for bases shared by the ``G`` KV heads: one latent ``[B, 1, N, R]`` a token read
    by every head as a stride-0 view, and the heads' ``[G, d, R]`` blocks of one orthonormal ``[G·d, R]``
    (as ``stiefkv.load`` serves a ``--share-heads`` checkpoint)."""
    x = latent_inputs(B, 1, N, R)
    x["z_k"] = x["z_k"][:, :1].contiguous().expand(B, G, N, R)
    x["z_v"] = x["z_v"][:, :1].contiguous().expand(B, G, N, R)
    x["P_k"] = utils.random_basis(1, G * D_HEAD, R, device=DEVICE).reshape(G, D_HEAD, R)
    x["P_v"] = utils.random_basis(1, G * D_HEAD, R, device=DEVICE).reshape(G, D_HEAD, R)
    return x


def shared_rows(shapes) -> None:
    """Decode over latents shared by the KV heads against a basis per head at the same bytes (rank ``G·r``
    against ``r``; 12.5 % and 25 %: 50 % is rank 512, whose tiles no config fits on the H200), both key modes,
    each over SDPA of the same run; latent output (``P_v`` folded into ``o_proj``, as served)."""
    from stiefkv.kernels.lowrank import TilesTooLarge

    for B, N in shapes:
        sdpa = sdpa_decode_ms(B, N)
        for budget, r in (("12.5%", 16), ("25%", 32)):
            arms = {"per-head": latent_inputs(B, 1, N, r), "shared": shared_inputs(B, N, G * r)}
            for mode in MODES:
                for bases, x in arms.items():
                    row = case_fields(B, N, "50%", mode) | {
                        "case": f"shared-table {utils.shape_name(B, N)} {budget} {mode} {bases}",
                        "table": "shared", "budget": budget, "bases": bases, "r": x["z_k"].shape[-1],
                        "sdpa": sdpa}
                    try:
                        with torch.no_grad():
                            row["ours"] = utils.graph_ms(kernel_call(x, mode, with_pv=False))
                        row["ratio_median"] = row["ours"]["p50"] / sdpa["p50"]
                    except TilesTooLarge as err:
                        row["error"] = str(err)
                    utils.write_rows(NAME, row)
                    print(f"{row['case']}: {row.get('ours', {}).get('p50')} ms over SDPA "
                          f"{sdpa['p50']:.4f} ({row.get('ratio_median')})", flush=True)
            del arms
            empty_cache()


def decode_rows(shapes, copy: float) -> None:
    for B, N in shapes:
        sdpa = sdpa_decode_ms(B, N)
        for budget, r in BUDGETS.items():
            x = latent_inputs(B, 1, N, r)
            with torch.no_grad():
                for mode in MODES:
                    run = kernel_call(x, mode)
                    rule = default_config(B, N, mode, r)
                    row = case_fields(B, N, budget, mode) | {
                        "table": "decode" + TABLE_SUFFIX,
                        "sdpa_ms": sdpa,
                        "kernel_ms": utils.graph_ms(run),
                        "eager_ms": utils.bench_ms(run),
                        "config": rule | {"num_splits": launched_splits(x, mode)},
                        "rule_splits": rule["num_splits"],
                        "bytes": read_bytes(x, mode),
                        "sdpa_bytes": 2 * B * G * N * D_HEAD * 2,
                        "copy_tbs": copy,
                        "target_ratio": None if TABLE_SUFFIX else TARGETS.get((mode, budget)),  # Llama's
                        "poly_sincos_ms": (
                            utils.graph_ms(kernel_call(x, mode, fast_sincos=False))
                            if mode == "pre_rope"
                            else None
                        ),
                    }
                    utils.write_rows(NAME, row)
                    print(
                        f"{row['case']}: SDPA {sdpa['p50']:.4f} ms, kernel {row['kernel_ms']['p50']:.4f} ms "
                        f"({row['kernel_ms']['p50'] / sdpa['p50']:.3f}x)",
                        flush=True,
                    )
            del x
            empty_cache()


def quantized(z: torch.Tensor, bits: int, log8: bool = False, layout: str = "token"):
    """``z`` quantized by ``stiefkv.quant``: per token on min–max float scales, or ``log8`` (one byte a group,
    symmetric: what the ``auto`` and ``window8`` checkpoints store); or in the channel layout (a scale and low
    per channel and 64 tokens: the keys of ``--bits auto`` at low budgets, and KIVI's)."""
    from stiefkv.kernels import QuantizedLatents
    from stiefkv.quant import QuantSpec, quantize

    if layout == "channel":  # whole groups of 64 tokens: the last one padded, its codes past N dropped
        N = z.shape[2]
        q = quantize(torch.nn.functional.pad(z, (0, 0, 0, -N % 64)), QuantSpec(bits, "channel"))
        return QuantizedLatents(q.codes[:, :, :N], q.scale, q.low, bits, q.rank, "channel")
    q = quantize(z, QuantSpec(bits, "token", log8=log8))
    return QuantizedLatents(q.codes, q.scale, q.low, bits, q.rank, log8=log8)


def quant_rows(shapes, copy: float, modes=MODES, sweep_with=None, rank: int | None = None,
               bits_list=QUANT_BITS, log8: bool = False, channel_keys: bool = False) -> None:
    """Decode over bf16 latents and int8/int4 codes at 50 % ranks (or ``rank``: an odd one such as the
    12.5 % checkpoint's 56, whose int4 rows are 28 bytes): the default configuration and each of
    :data:`QUANT_SWEEP` (the candidates prefetch and fold_scales, key splits, tiles, warps, stages), in
    the same run as SDPA on the same shape. ``sweep_with``: only the sweep's entries that set one of these
    options (a targeted A/B; the default and SDPA are measured all the same). ``bits_list``: the latents'
    widths (16: bf16). ``log8``: codes on log8 scales instead of min–max float ones. ``channel_keys``: key
    codes in the channel layout (the sweep's ``channel_rows`` entries apply then only)."""
    sweep = [c for c in QUANT_SWEEP if not sweep_with or any(k in c for k in sweep_with)]
    r = rank or BUDGETS["50%"]
    for B, N in shapes:
        sdpa = sdpa_decode_ms(B, N)
        x = latent_inputs(B, 1, N, r)
        for bits in bits_list:
            xq = x if bits == 16 else dict(
                x, z_k=quantized(x["z_k"], bits, log8, "channel" if channel_keys else "token"),
                z_v=quantized(x["z_v"], bits, log8))
            parts = (x["z_k"], x["z_v"]) if bits == 16 else [
                t for z in (xq["z_k"], xq["z_v"]) for t in (z.codes, z.scale, z.low) if t is not None]
            n = sum(t.nbytes for t in parts)
            with torch.no_grad():
                for mode in modes:
                    default = default_config(B, N, mode, r, bits,
                                             _token_int4(xq["z_k"]) and _token_int4(xq["z_v"]),
                                             channel_keys and bits < 16,
                                             _token_int2(xq["z_k"]) and _token_int2(xq["z_v"]))
                    # the sweep's "splits" multiply the rule's count, so the rule's own count is among them
                    # where the launch takes more (more programs an SM fit)
                    rule_splits = default["num_splits"]
                    default["num_splits"] = launched_splits(xq, mode)
                    ms = utils.graph_ms(kernel_call(xq, mode))
                    tried = []
                    for cfg in sweep:
                        cfg = dict(cfg)
                        nibble = [k for k in NIBBLE_OPTIONS if k in cfg]  # int4, and its key mode
                        if (cfg.get("fold_scales") and bits == 16) or (cfg.get("pairs") and bits != 8) or (
                                nibble and (
                                bits != 4 or NIBBLE_OPTIONS[nibble[0]] not in (None, mode))) or (
                                (cfg.get("keys_left") or "sincos_fadd" in cfg) and mode != "pre_rope") or (
                                "channel_rows" in cfg and not (channel_keys and bits < 16)) or (
                                cfg.get("planes") and bits != 2) or (cfg.get("nibble_words") and bits != 4) \
                                or (cfg.get("int3_planes") and bits != 3) or (
                                "ahead" in cfg and (bits != 16 or mode != "pre_rope")):
                            continue
                        cfg["num_splits"] = max(1, round(rule_splits * cfg.pop("splits", 1)))
                        try:
                            t = utils.graph_ms(kernel_call(xq, mode, **cfg))
                        except Exception as exc:
                            # a candidate too big for an SM at this rank and width (shared memory: bf16 at
                            # 256-key tiles) is recorded as such; the rest of the sweep still runs
                            if type(exc).__name__ != "OutOfResources":
                                raise
                            print(f"  {cfg}: does not fit ({str(exc).splitlines()[0][:100]})", flush=True)
                            continue
                        tried.append({"config": cfg, "kernel_ms": t})
                    best = min([{"config": default, "kernel_ms": ms}, *tried],
                               key=lambda t: t["kernel_ms"]["p50"])
                    fold = next((t["kernel_ms"] for t in tried if t["config"].get("fold_scales")), None)
                    read = n + (x["positions"].nbytes if mode == "pre_rope" else 0)
                    name = "bf16" if bits == 16 else f"int{bits}" + ("-log8" if log8 else "") + (
                        "-channel-keys" if channel_keys else "")
                    row = case_fields(B, N, "50%", mode) | ({"r": r, "budget": f"r{r}"} if rank else {}) | {
                        "case": f"decode {CASE_PREFIX}{utils.shape_name(B, N)} r{r} {name} {mode}",
                        "table": "quant" + TABLE_SUFFIX, "bits": bits, "log8": log8 and bits < 16,
                        "key_layout": "channel" if channel_keys and bits < 16 else "token", "sdpa_ms": sdpa,
                        "kernel_ms": ms, "bytes": read,
                        "sdpa_bytes": 2 * B * G * N * D_HEAD * 2, "copy_tbs": copy,
                        "read_tbs": read / ms["p50"] / 1e9, "config": default, "rule_splits": rule_splits,
                        "fold_scales_ms": fold, "sweep": tried, "best": best,
                    }
                    utils.write_rows(NAME, row)
                    print(f"{row['case']}: SDPA {sdpa['p50']:.4f} ms, kernel {ms['p50']:.4f} ms "
                          f"({ms['p50'] / sdpa['p50']:.3f}x), reads {row['read_tbs']:.2f} TB/s "
                          f"(copy {copy:.2f}); best {best['kernel_ms']['p50']:.4f} ms at {best['config']}",
                          flush=True)
            if bits != 16:
                del xq
        del x
        empty_cache()


def sweep_rows(shapes) -> None:
    for B, N in shapes:
        sdpa = sdpa_decode_ms(B, N)
        for budget, r in BUDGETS.items():
            x = latent_inputs(B, 1, N, r)
            with torch.no_grad():
                for mode in MODES:
                    default = default_config(B, N, mode, r)
                    tried = []
                    for cfg in SWEEP:
                        cfg = dict(cfg)
                        splits = max(1, round(default["num_splits"] * cfg.pop("splits", 1)))
                        cfg["num_splits"] = splits
                        tried.append(
                            {"config": cfg, "kernel_ms": utils.graph_ms(kernel_call(x, mode, **cfg))}
                        )
                    launched = default | {"num_splits": launched_splits(x, mode)}
                    row = case_fields(B, N, budget, mode) | {
                        "table": "sweep",
                        "sdpa_ms": sdpa,
                        "config": launched,
                        "rule_splits": default["num_splits"],
                        "kernel_ms": utils.graph_ms(kernel_call(x, mode)),
                        "sweep": tried,
                    }
                    best = min(
                        [{"config": launched, "kernel_ms": row["kernel_ms"]}, *tried],
                        key=lambda t: t["kernel_ms"]["p50"],
                    )
                    row["best"] = best
                    utils.write_rows(NAME, row)
                    print(
                        f"{row['case']}: default {row['kernel_ms']['p50']:.4f} ms, "
                        f"best {best['kernel_ms']['p50']:.4f}"
                        f" ms at {best['config']}",
                        flush=True,
                    )
            del x
            empty_cache()


def prefill_rows(n: int = 8192) -> None:
    q = torch.randn(1, H, n, D_HEAD, device=DEVICE, dtype=DTYPE)
    k = torch.randn(1, G, n, D_HEAD, device=DEVICE, dtype=DTYPE)
    v = torch.randn(1, G, n, D_HEAD, device=DEVICE, dtype=DTYPE)
    sdpa = utils.bench_ms(
        functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=True, enable_gqa=True)
    )
    for budget, r in BUDGETS.items():
        x = latent_inputs(1, n, n, r)
        x["q"] = q
        with torch.no_grad():
            for mode, fast in (("post_rope", None), ("pre_rope", None), ("pre_rope", False)):
                ms = utils.bench_ms(kernel_call(x, mode, fast_sincos=fast))
                d_qk = r if mode == "post_rope" else D_HEAD
                flops = 2 * H * n * n / 2 * (d_qk + r)  # causal: the QKᵀ and PV products in latent dims
                variant = " polynomial" if fast is False else ""
                row = {
                    **case_fields(1, n, budget, mode),
                    "case": f"prefill {utils.shape_name(1, n)} r{r} {mode}{variant}",
                    "table": "prefill",
                    "fast_sincos": fast is not False if mode == "pre_rope" else None,
                    "sdpa_ms": sdpa,
                    "kernel_ms": ms,
                    "latent_tflops": flops / ms["p50"] / 1e9,
                }
                utils.write_rows(NAME, row)
                print(f"{row['case']}: SDPA {sdpa['p50']:.3f} ms, kernel {ms['p50']:.3f} ms", flush=True)
        del x
        empty_cache()


def band_inputs(B: int, Nq: int, window: int, r: int) -> tuple[dict, ExactTail]:
    """A prefill chunk's band: ``Nq`` queries over ``window + Nq`` keys held stored and exact, query ``i``
    reading the newest ``window + 1`` keys up to its own exact (a windowed store's prefill), the rest as
    stored."""
    x = latent_inputs(B, Nq, window + Nq, r)
    jitter = 0.05  # the exact latents stand a quantization step from the stored ones
    starts = torch.arange(1, Nq + 1, device=DEVICE, dtype=torch.int32)  # key window + i is query i's own
    exact = ExactTail(x["z_k"] + jitter * torch.randn_like(x["z_k"]),
                      x["z_v"] + jitter * torch.randn_like(x["z_v"]), starts, starts)
    return x, exact


def band_rows(shapes, window: int = BAND_WINDOW) -> None:
    """The exact band of a prefill chunk over a windowed store: the band kernel (``band.band_attention``, one
    launch) at its default warps and the sweep's, against the reference it replaced
    (``reference.lowrank_attention`` with ``exact=``, ~110 operators, as the library took the band until
    2026-12-06), in both key modes, latent output (``P_v=None``, as ``_below_and_band`` hands it on). Timed
    by ``do_bench`` (the reference reads the band's bounds back to the host, so it cannot be captured)."""
    r = BUDGETS["50%"]
    for B, Nq in shapes:
        x, exact = band_inputs(B, Nq, window, r)
        for mode in MODES:
            args = (x["q"], x["z_k"], x["z_v"], exact, x["P_k"], None)
            kw = dict(key_mode=mode, positions=x["positions"], rope=x["rope"])
            kernel = functools.partial(band_kernel.band_attention, *args, **kw)
            with torch.no_grad():
                ref = utils.bench_ms(functools.partial(reference_attention, *args[:3], x["P_k"], None,
                                                       exact=exact, return_lse=True, **kw))
                default = utils.bench_ms(kernel)
                sweep = [{"config": {"num_warps": w}, "kernel_ms": utils.bench_ms(functools.partial(kernel,
                                                                                                 num_warps=w))}
                         for w in BAND_WARPS if w != BAND_DEFAULT_WARPS]
            row = {
                **case_fields(B, Nq, "50%", mode),
                "case": f"band {CASE_PREFIX}{B}x{Nq}+{window} r{r} {mode}",
                "table": f"band{TABLE_SUFFIX}",
                "window": window,
                "band_keys": window + Nq,
                "config": {"num_warps": BAND_DEFAULT_WARPS},
                "kernel_ms": default,
                "reference_ms": ref,
                "ratio_median": default["p50"] / ref["p50"],
                "sweep": sweep,
            }
            utils.write_rows(NAME, row)
            swept = ", ".join(f"{t['config']['num_warps']} warps {t['kernel_ms']['p50']:.4f}" for t in sweep)
            print(f"{row['case']}: reference {ref['p50']:.4f} ms, kernel {default['p50']:.4f} ms "
                  f"({BAND_DEFAULT_WARPS} warps); {swept}", flush=True)
        del x, exact
        empty_cache()


def fold_rows(shapes, prefill_n: int = 8192) -> None:
    """``P_v`` in the epilogue (+ ``o_proj`` on ``H·d`` inputs) vs folded (``P_v=None`` + ``o_proj`` on
    ``H·r``)."""
    r = BUDGETS["50%"]
    W_o = torch.randn(D_MODEL, H * D_HEAD, device=DEVICE, dtype=DTYPE) * 0.01
    W_fold = (
        torch.randn(D_MODEL, H * r, device=DEVICE, dtype=DTYPE) * 0.01
    )  # W_o · blockdiag(P_v): same shape
    for B, Nq, N in [(B, 1, N) for B, N in shapes] + [(1, prefill_n, prefill_n)]:
        x = latent_inputs(B, Nq, N, r)
        with torch.no_grad():
            for mode in MODES:
                with_pv, latent = kernel_call(x, mode), kernel_call(x, mode, with_pv=False)

                def epilogue(with_pv=with_pv, B=B, Nq=Nq):
                    return with_pv().transpose(1, 2).reshape(B * Nq, H * D_HEAD) @ W_o.T

                def folded(latent=latent, B=B, Nq=Nq):
                    return latent().transpose(1, 2).reshape(B * Nq, H * r) @ W_fold.T

                row = {
                    "case": f"fold {'decode' if Nq == 1 else 'prefill'} {utils.shape_name(B, N)} {mode}",
                    "table": "fold",
                    "B": B,
                    "Nq": Nq,
                    "N": N,
                    "r": r,
                    "key_mode": mode,
                    "kernel_pv_ms": utils.bench_ms(with_pv),
                    "kernel_latent_ms": utils.bench_ms(latent),
                    "epilogue_oproj_ms": utils.bench_ms(epilogue),
                    "folded_oproj_ms": utils.bench_ms(folded),
                }
                utils.write_rows(NAME, row)
                print(
                    f"{row['case']}: folded / epilogue "
                    f"{row['folded_oproj_ms']['p50'] / row['epilogue_oproj_ms']['p50']:.3f}",
                    flush=True,
                )
        del x
        empty_cache()


def host_rows(n: int = 32768, calls: int = 200) -> None:
    """Host time of one decode call at the 1B model's attention shapes (d = 64, r = 32), where a ``generate``
    step is host-bound."""
    d, r = 64, 32
    q = torch.randn(1, H, 1, d, device=DEVICE, dtype=DTYPE)
    k = torch.randn(1, G, n, d, device=DEVICE, dtype=DTYPE)
    v = torch.randn(1, G, n, d, device=DEVICE, dtype=DTYPE)
    x = latent_inputs(1, 1, n, r, d=d)
    x["q"], x["P_k"] = q, x["P_k"].to(DTYPE)
    x["positions"] = x["positions"].to(torch.int32)  # as the cache stores them
    calls_by_name = {
        "SDPA (full rank)": functools.partial(F.scaled_dot_product_attention, q, k, v, enable_gqa=True),
        "lowrank_attention pre_rope": kernel_call(x, "pre_rope", with_pv=False),
        "lowrank_attention post_rope": kernel_call(x, "post_rope", with_pv=False),
    }
    with torch.no_grad():
        for name, fn in calls_by_name.items():
            t = utils.host_us(fn, calls=calls)
            row = {
                "case": f"host {name}",
                "table": "host",
                "B": 1,
                "N": n,
                "H": H,
                "G": G,
                "d": d,
                "r": r,
                "calls": calls,
            } | t
            utils.write_rows(NAME, row)
            print(
                f"{row['case']}: host {t['host_us']:.0f} us, host + device {t['total_us']:.0f} us", flush=True
            )


def main() -> None:
    parser = utils.parser(__doc__.split("\n")[0])
    parser.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES)
    parser.add_argument("--quick", action="store_true", help="two decode shapes (1x32k, 4x128k)")
    parser.add_argument("--shapes", nargs="+", metavar="BxN", type=utils.batch_context,
                        help="decode shapes instead of the four (e.g. 16x16384 4x131072)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                        help="the quant table's key modes")
    parser.add_argument("--rank", type=utils.at_least(1), default=None,
                        help="quant table: the latents' rank instead of 50 %% (64 at d 128), e.g. 56 "
                             "(12.5 %% is r 56 x int4)")
    parser.add_argument("--bits", nargs="+", type=int, default=list(QUANT_BITS), choices=(16, 8, 4, 3, 2),
                        help="quant table: the latents' widths (16: bf16; 3 and 2: auto's low budgets)")
    parser.add_argument("--sweep-with", nargs="+", metavar="OPTION",
                        help="quant table: only the sweep's entries that set one of these options")
    parser.add_argument("--log8", action="store_true",
                        help="quant table: codes on log8 scales (what auto and window8 checkpoints store)")
    parser.add_argument("--channel-keys", action="store_true",
                        help="quant table: key codes in the channel layout (auto's low budgets, KIVI), "
                             "values per token")
    parser.add_argument("--heads", default="llama8b", choices=sorted(HEADS),
                        help="attention shapes: Llama-3-8B's (H 32, G 8, d 128), SmolLM2-135M's (H 9, G 3, "
                             "d 64) or Llama-3.2-1B's (H 32, G 8, d 64); decode and quant tables, whose rows "
                             "then name them")
    args = parser.parse_args()
    utils.check_results_dir(parser)
    if args.heads != "llama8b":
        set_heads(args.heads)
        if set(args.tables) - {"decode", "quant", "band"}:
            parser.error(f"--heads {args.heads}: only the decode, quant and band tables take other shapes "
                         f"(got --tables {' '.join(args.tables)})")
    options = sorted({key for entry in QUANT_SWEEP for key in entry})
    unknown = sorted(set(args.sweep_with or ()) - set(options))
    if unknown:  # it filtered the sweep to nothing, silently, after the decode table had run
        parser.error(f"--sweep-with {' '.join(unknown)}: not an option of the quant sweep; choose among "
                     f"{', '.join(options)}")
    if args.rank is not None and args.rank > D_HEAD:
        parser.error(f"--rank {args.rank} is above the head dimension {D_HEAD}")
    torch.manual_seed(0)
    utils.require_cuda()  # after the arguments' checks, before any work
    print(utils.header(), flush=True)
    shapes = DECODE_SHAPES[::3] if args.quick else DECODE_SHAPES
    if args.shapes:
        shapes = [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes]
    copy = None
    if "decode" in args.tables or "quant" in args.tables:
        copy = utils.copy_tbs()
        utils.write_rows(NAME, {"case": "copy", "table": "copy", "bytes": 2 * 2**31, "copy_tbs": copy})
        print(f"device-to-device copy: {copy:.2f} TB/s (bytes read + written)", flush=True)
    if "decode" in args.tables:
        decode_rows(shapes, copy)
    if "quant" in args.tables:
        quant_rows(shapes, copy, args.modes, args.sweep_with, args.rank, args.bits, args.log8,
                   args.channel_keys)
    if "shared" in args.tables:
        shared_rows(shapes)
    if "prefill" in args.tables:
        prefill_rows()
    if "sweep" in args.tables:
        sweep_rows(shapes)
    if "fold" in args.tables:
        fold_rows(shapes)
    if "host" in args.tables:
        host_rows()
    if "band" in args.tables:
        band_rows(shapes if args.shapes else BAND_SHAPES)


if __name__ == "__main__":
    main()
