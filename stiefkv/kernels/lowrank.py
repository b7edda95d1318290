"""Fused softmax attention over a latent (low-rank) KV cache, in Triton.

The cache holds ``z_k = P_kᵀ k`` and ``z_v = P_vᵀ v`` per token and KV head. For a query ``q`` (already
rotated at its position) and a key ``j``:

- ``post_rope`` (latents of rotated keys): ``s_j = (P_kᵀ q) · z_k,j`` — the query is projected once and
  attention runs in ``r_k`` dimensions.
- ``pre_rope`` (latents of keys before RoPE): the key is rebuilt tile by tile and rotated at its own
  position ``p_j``: with ``P1 = P_k[:d/2]``, ``P2 = P_k[d/2:]``, ``a1 = z_k P1ᵀ``, ``a2 = z_k P2ᵀ`` (two
  ``tl.dot``) and ``c, s = cos(p_j θ), sin(p_j θ)`` computed in-kernel (``θ`` the inverse frequencies),
  ``k_j = [a1 c − a2 s, a2 c + a1 s]`` and ``s_j = α·q · k_j`` (``α`` the rope attention scaling, applied to
  the query once). A program owns one KV head and all of its ``H/G`` query heads (they are rows of its query
  tile), so each key tile is rebuilt once for the whole GQA group.

Then ``o = Σ_j softmax_j(scale·s_j + bias_j) z_v,j`` accumulates in ``r_v`` dimensions with an online
softmax (fp32 statistics, base-2 exponentials) and the epilogue returns ``P_v o`` (``[.., d]``) or ``o``
itself when ``P_v`` is ``None`` (for a ``P_v`` folded into ``o_proj``).

Rows of a query tile are ``(query i, head-in-group s)`` pairs, row ``m = i·GROUP + s``; query ``i`` sits
at key index ``Nk − Nq + i`` (causal) and left-padded rows start at key ``Nk − lengths[b]``, so padding
keys are never loaded. Decode (``Nq·GROUP ≤ 16``) splits each row's keys across ``NUM_SPLITS`` programs
when ``B·G`` alone cannot fill the GPU (flash-decoding); the last program of each tile to finish merges
the partial softmaxes and applies the epilogue. Prefill tiles queries and keys like FlashAttention and
writes nothing of size N×N.

Layout of this file: jit helpers → kernels → host launcher → :func:`lowrank_attention`. Inference only:
there is no backward, and the function refuses inputs that require a gradient.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

# Absolute imports: benchmarks/experiments/ablate_decode.py imports edited copies of this file from outside
# the package, where a relative import has no package to resolve against.
from stiefkv.kernels import _common, rebuilt
from stiefkv.kernels._common import (
    KEY_MODES,
    LOG2E,
    MIN_DOT,
    QuantizedLatents,
    RopeSpec,
    check_prior,
    interpreting,
    merge_prior,
    padded_dim,
)

# Module globals that a jit function reads must be constexprs.
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)
# π/2 split for the Cody–Waite reduction: HI is π/2 rounded to fp32, LO the rest (used through fma).
PIO2_HI = tl.constexpr(1.5707963705062866)
PIO2_LO = tl.constexpr(-4.371139000186243e-08)
TWO_OVER_PI = tl.constexpr(0.6366197723675814)
# 2π split the same way, for the reduction to [−π, π] in front of the hardware sin/cos.
TWO_PI_HI = tl.constexpr(6.2831854820251465)
TWO_PI_LO = tl.constexpr(-1.7484555314695172e-07)
INV_TWO_PI = tl.constexpr(0.15915494309189535)
# 1.5·2²³: adding it to an fp32 of magnitude < 2²² rounds it to an integer (to nearest, ties to even) in the
# addition itself, so subtracting it back gives rint(x) on the FMA pipe, where FRND runs on the XU pipe
ROUND_MAGIC = tl.constexpr(12582912.0)
DECODE_BLOCK_M = MIN_DOT  # the smallest tl.dot tile; a decode tile holds one query's GQA group
# keys a split from which pre_rope decode over bf16 latents forms its logits one tile ahead (``ahead``)
AHEAD_KEYS = 4096
QUANT_GROUP = tl.constexpr(_common.QUANT_GROUP)  # channels per scale of quantized latents
LOG8_EXP_OFFSET = tl.constexpr(_common.LOG8_OFFSET // 8)  # log8 code k: 2^((k >> 3) − this) · eighth(k & 7)
LOG8_NAN = tl.constexpr(_common.LOG8_NAN)
LOG8_E1, LOG8_E2, LOG8_E3, LOG8_E4, LOG8_E5, LOG8_E6, LOG8_E7 = (tl.constexpr(m) for m in
                                                                 _common.LOG8_EIGHTHS[1:])
KERNEL_BITS = _common.KERNEL_BITS
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
WIDE_NIBBLE_TILE = 256  # decode key tile over int4 token-layout keys and values, post_rope (_default_config)
MERGE_UNROLL = tl.constexpr(4)  # splits merged per iteration of _merge_splits


# ----------------------------------------------------------------------------------------------- helpers
@triton.jit
def _sincos(x):
    """``sin(x), cos(x)`` in fp32 for any ``x``: ``x = jπ/2 + r`` with ``|r| ≤ π/4`` (two-part Cody–Waite
    through fma), minimax polynomials of ``r`` (Cephes ``sinf``/``cosf``), then the quadrant ``j mod 4``
    picks ``(±sin r, ±cos r)``. Absolute error ≈ 1e-7 for the angles RoPE produces (``|x| ≲ 1e6``)."""
    j = tl.floor(x * TWO_OVER_PI + 0.5)
    r = tl.fma(j, -PIO2_HI, x)
    r = tl.fma(j, -PIO2_LO, r)
    z = r * r
    sin_r = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4))
    cos_r = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2
                                     + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5))
    quadrant = j.to(tl.int32) & 3
    sin_x = tl.where(quadrant == 0, sin_r,
                     tl.where(quadrant == 1, cos_r, tl.where(quadrant == 2, -sin_r, -cos_r)))
    cos_x = tl.where(quadrant == 0, cos_r,
                     tl.where(quadrant == 1, -sin_r, tl.where(quadrant == 2, -cos_r, sin_r)))
    return sin_x, cos_x


@triton.jit
def _turns(x, FADD: tl.constexpr):
    """``k``, the whole turns of ``x`` to the nearest (``x = 2πk + r``, ``|r| ≤ π``): ``floor(x/2π + 0.5)``,
    or with ``FADD`` the same integer (ties aside, where ``r = ±π`` either way) by adding and subtracting
    :data:`ROUND_MAGIC`, for ``|x/2π| < 2²²`` (positions below 26 M at θ ≤ 1): two FMA-pipe instructions
    instead of one there and an ``FRND`` on the pipe that also runs the MUFU sin/cos."""
    if FADD:
        return (x * INV_TWO_PI + ROUND_MAGIC) - ROUND_MAGIC
    return tl.floor(x * INV_TWO_PI + 0.5)


def sincos_mode(fast_sincos: bool, sincos_fadd: bool) -> int:
    """The kernels' ``FAST_SINCOS``: 0 the polynomial sin/cos, 1 the hardware one, 2 the hardware one with
    its turns rounded on the FMA pipe (``sincos_fadd``, which only the hardware one has)."""
    return (2 if sincos_fadd else 1) if fast_sincos else 0


@triton.jit
def _sincos_fast(x, FADD: tl.constexpr = False):
    """``sin(x), cos(x)`` with about a third of :func:`_sincos`'s instructions: ``x = 2πk + r`` with
    ``|r| ≤ π`` (two-part Cody–Waite through fma; ``k`` by :func:`_turns`), then the GPU's
    ``sin.approx``/``cos.approx`` (the MUFU unit, absolute error ≤ 2^-20.9 on ``[−π, π]``). CUDA only: the
    interpreter has no hardware approximations."""
    k = _turns(x, FADD)
    r = tl.fma(k, -TWO_PI_HI, x)
    r = tl.fma(k, -TWO_PI_LO, r)
    return libdevice.fast_sinf(r), libdevice.fast_cosf(r)


@triton.jit
def _dot(a, b, acc, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation. ``UPCAST`` feeds the (already rounded) operands as fp32: the
    Triton interpreter multiplies bf16 operands wrongly (triton 3.9), so it is set under the interpreter."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PREC)


@triton.jit
def _load_rows(ptrs, offs_n, hi, offs_r, R: tl.constexpr, R_P2: tl.constexpr, MASK_N: tl.constexpr):
    """Load a ``[BLOCK_N, R_P2]`` tile of per-key rows; columns ``≥ R`` (rank padding) and, when ``MASK_N``,
    keys ``≥ hi`` read as 0. Masks are built only where needed so full tiles load unmasked."""
    if MASK_N:
        if R == R_P2:
            tile = tl.load(ptrs, mask=(offs_n < hi)[:, None], other=0.0)
        else:
            tile = tl.load(ptrs, mask=(offs_n < hi)[:, None] & (offs_r < R)[None, :], other=0.0)
    else:
        if R == R_P2:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(offs_r < R)[None, :], other=0.0)
    return tile


@triton.jit
def _fetch_bytes(Z, offs_n, hi, stride_n, stride_r, R: tl.constexpr, R_P2: tl.constexpr, MASK_N: tl.constexpr,
                 BITS: tl.constexpr):
    """The stored rows of a latent tile: ``[BLOCK_N, R_P2]`` floats or int8 codes, ``[BLOCK_N, R_P2 / 2]``
    packed int4 codes, or for 3 and 2 bits ``[BLOCK_N, R_P2 / 8]`` int32 words of eight codes (``bits``
    bytes each, little-endian: ``stiefkv.quant.pack``); keys ``≥ hi`` (when ``MASK_N``) and channels ``≥ R``
    read as 0. Column masks only where the rank is not a power of two: prefill pads the latents
    (_pad_rank, _pad_codes) because column-masked loads in 128-row prefill tiles read out of bounds on the
    H200 (triton 3.6)."""
    if BITS < 4:
        W8: tl.constexpr = R_P2 // 8
        W8_R: tl.constexpr = (R + 7) // 8
        offs_w = tl.arange(0, W8)
        base = Z + offs_n[:, None] * stride_n + (offs_w * BITS)[None, :] * stride_r
        raw = _load_rows(base, offs_n, hi, offs_w, W8_R, W8, MASK_N).to(tl.int32)
        raw = raw | (_load_rows(base + stride_r, offs_n, hi, offs_w, W8_R, W8, MASK_N).to(tl.int32) << 8)
        if BITS == 3:
            raw = raw | (_load_rows(base + 2 * stride_r, offs_n, hi, offs_w, W8_R, W8, MASK_N).to(tl.int32)
                         << 16)
    else:
        W: tl.constexpr = R_P2 // 2 if BITS == 4 else R_P2
        W_R: tl.constexpr = (R + 1) // 2 if BITS == 4 else R
        offs_b = tl.arange(0, W)
        raw = _load_rows(Z + offs_n[:, None] * stride_n + offs_b[None, :] * stride_r, offs_n, hi, offs_b,
                         W_R, W, MASK_N)
    return raw


@triton.jit
def _fetch_words(Z, offs_n, hi, stride_n, R: tl.constexpr, R_P2: tl.constexpr, MASK_N: tl.constexpr,
                 BITS: tl.constexpr = 8):
    """int8 codes ``[BLOCK_N, R_P2]`` as int32 words ``[BLOCK_N, R_P2 / 4]`` (code ``4w + j`` in byte ``j`` of
    word ``w``): Triton holds a uint8 element one to a 32-bit register and an int32 element as one, so the
    codes arrive four to a register, as the byte permutes of :func:`_word_pairs` take them. The rows start
    4-byte aligned, hold a multiple of 4 codes and the channels are contiguous (the launcher checks), so
    the word holding the last channel is read whole (its codes past ``R`` meet zero basis rows); words
    past it read as 0. ``BITS`` 2 (``planes``): sixteen codes a word, two words of eight
    (``stiefkv.quant.pack``), the first in the low 16 bits."""
    W: tl.constexpr = R_P2 * BITS // 32
    W_R: tl.constexpr = (R + 3) // 4 if BITS == 8 else ((R + 7) // 8 * BITS + 3) // 4
    offs_w = tl.arange(0, W)
    rows = (Z + offs_n[:, None] * stride_n).to(tl.pointer_type(tl.int32))
    return _load_rows(rows + offs_w[None, :], offs_n, hi, offs_w, W_R, W, MASK_N)


@triton.jit
def _channels(R_P2: tl.constexpr, PLANES: tl.constexpr):
    """The channel each column of a decoded tile holds: the column itself, or with ``PLANES`` (int2 codes met
    as bit planes, :func:`_plane_codes`) column ``k·W + w`` holds channel ``8w + k`` (``W = R_P2 / 8``). The
    other operand's rows and the output's columns are read and written at these channels."""
    offs = tl.arange(0, R_P2)
    if PLANES:
        W: tl.constexpr = R_P2 // 8
        offs = 8 * (offs % W) + offs // W
    return offs


@triton.jit
def _fetch_latent(Z, S, L, offs_n, hi, stride_n, stride_r, stride_sn, stride_sg,
                  R: tl.constexpr, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr,
                  BITS: tl.constexpr, CH: tl.constexpr = False, LOG8: tl.constexpr = False,
                  WORDS: tl.constexpr = False, PLANES: tl.constexpr = False):
    """The memory reads of a latent tile, nothing computed: ``(raw, scale, low)``, ``raw`` from
    :func:`_fetch_bytes` (``WORDS``: int8 or int2 codes as 32-bit words, :func:`_fetch_words`) and, for codes,
    the fp32 scales and lows (``[BLOCK_N]`` for one scale group, ``[BLOCK_N, NG]`` for more; unused zeros
    for floats), or with ``LOG8`` the groups' log8 codes (int32, in both; :func:`_log8` when decoding).
    Split from :func:`_decode_latent` so that a loop can issue the next tile's reads before it computes on
    this one (``PREFETCH``). ``PLANES``: the tile is decoded into bit-plane column order, so channel-layout
    scales are read at :func:`_channels`."""
    if WORDS:
        raw = _fetch_words(Z, offs_n, hi, stride_n, R, R_P2, MASK_N, BITS)
    else:
        raw = _fetch_bytes(Z, offs_n, hi, stride_n, stride_r, R, R_P2, MASK_N, BITS)
    NG: tl.constexpr = (R_P2 + QUANT_GROUP - 1) // QUANT_GROUP
    if BITS == 16:
        scale = tl.zeros([BLOCK_N], dtype=tl.float32)
        low = scale
    elif CH == 2:  # channel layout, tiles aligned to their size: a scale row a group the tile spans
        ROWS: tl.constexpr = BLOCK_N if BLOCK_N < QUANT_GROUP else QUANT_GROUP
        NGT: tl.constexpr = BLOCK_N // ROWS
        offs_r = _channels(R_P2, PLANES)
        first = tl.min(offs_n.reshape(NGT, ROWS), axis=1)  # each group's first key in the tile
        row_ptrs = (first // QUANT_GROUP)[:, None] * stride_sn + offs_r[None, :] * stride_sg
        scale = _load_rows(S + row_ptrs, first, hi, offs_r, R, R_P2, MASK_N).to(tl.float32)
        low = _load_rows(L + row_ptrs, first, hi, offs_r, R, R_P2, MASK_N).to(tl.float32)
    elif CH:  # channel layout: one scale and low per channel and group of QUANT_GROUP tokens
        offs_r = _channels(R_P2, PLANES)
        row_ptrs = (offs_n // QUANT_GROUP)[:, None] * stride_sn + offs_r[None, :] * stride_sg
        scale = _load_rows(S + row_ptrs, offs_n, hi, offs_r, R, R_P2, MASK_N).to(tl.float32)
        low = _load_rows(L + row_ptrs, offs_n, hi, offs_r, R, R_P2, MASK_N).to(tl.float32)
    elif NG == 1:
        if LOG8:
            if MASK_N:
                scale = tl.load(S + offs_n * stride_sn, mask=offs_n < hi, other=0).to(tl.int32)
            else:
                scale = tl.load(S + offs_n * stride_sn).to(tl.int32)
            low = scale
        else:
            scale, low = _token_scales(S, L, offs_n, hi, stride_sn, MASK_N)
    else:
        offs_g = tl.arange(0, NG)
        group_ptrs = offs_n[:, None] * stride_sn + offs_g[None, :] * stride_sg
        N_GROUPS: tl.constexpr = (R + QUANT_GROUP - 1) // QUANT_GROUP
        if LOG8:
            scale = _load_rows(S + group_ptrs, offs_n, hi, offs_g, N_GROUPS, NG, MASK_N).to(tl.int32)
            low = scale
        else:
            scale = _load_rows(S + group_ptrs, offs_n, hi, offs_g, N_GROUPS, NG, MASK_N).to(tl.float32)
            low = _load_rows(L + group_ptrs, offs_n, hi, offs_g, N_GROUPS, NG, MASK_N).to(tl.float32)
    return raw, scale, low


@triton.jit
def _log8(k, BITS: tl.constexpr):
    """fp32 ``(scale, low)`` of uint8 log8 codes ``k``, bit for bit those of
    ``stiefkv.kernels._common.log8_scale`` and ``log8_low``: an eighth of an octave from eight constants
    times a power of two built in the exponent bits (``LOG8_OFFSET`` is a multiple of 8)."""
    k = k.to(tl.int32)
    j = k & 7
    m = tl.where(j == 1, LOG8_E1, 1.0)
    m = tl.where(j == 2, LOG8_E2, m)
    m = tl.where(j == 3, LOG8_E3, m)
    m = tl.where(j == 4, LOG8_E4, m)
    m = tl.where(j == 5, LOG8_E5, m)
    m = tl.where(j == 6, LOG8_E6, m)
    m = tl.where(j == 7, LOG8_E7, m)
    pow2 = (((k >> 3) - LOG8_EXP_OFFSET + 127) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(k == LOG8_NAN, float("nan"), m * pow2)
    low = (scale * (-((1 << BITS) - 1) / 2)).to(tl.float16).to(tl.float32)
    return scale, low


@triton.jit
def _unpack_codes(raw, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr):
    """Codes ``[BLOCK_N, R_P2]`` from the stored bytes: int8 as they are; int4 packed two to a byte, channel
    ``2j`` in the low nibble of byte ``j`` and ``2j + 1`` in the high one (``stiefkv.quant.pack``),
    interleaved back by a join; 3 and 2 bits from words of eight (code ``i`` at bit ``bits·i``), the eight
    shifted tiles joined so that code ``i`` of word ``w`` lands in channel ``8w + i``."""
    if BITS == 8:
        codes = raw
    elif BITS == 4:
        codes = tl.join(raw & 15, raw >> 4).reshape(BLOCK_N, R_P2)
    else:
        M: tl.constexpr = (1 << BITS) - 1
        c0, c1, c2, c3 = raw & M, (raw >> BITS) & M, (raw >> 2 * BITS) & M, (raw >> 3 * BITS) & M
        c4, c5 = (raw >> 4 * BITS) & M, (raw >> 5 * BITS) & M
        c6, c7 = (raw >> 6 * BITS) & M, (raw >> 7 * BITS) & M
        codes = tl.join(tl.join(tl.join(c0, c4), tl.join(c2, c6)),
                        tl.join(tl.join(c1, c5), tl.join(c3, c7))).reshape(BLOCK_N, R_P2)
    return codes


@triton.jit
def _codes_to_half(codes):
    """uint8 codes as exact fp16 values without an int-to-float conversion (quarter rate on the H200, and
    the largest part of the int8 decode loop's issue slots): ``0x6400 | c`` is the fp16 number
    ``1024 + c``."""
    return (codes.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0


@triton.jit
def _field_half(raw, SHIFT: tl.constexpr, MASK: tl.constexpr):
    """The code at bit ``SHIFT`` of int32 words (``MASK`` wide) as the fp16 number ``1024 + code``: the
    element-wise form of the word conversions' PTX (the interpreter runs no PTX)."""
    return (((raw >> SHIFT) & MASK) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)


# plane k of a word: (w >> 2k) & 0x00030003 | 0x64006400 (lop3 0xea: a & b | c), its halves outputs 2k, 2k + 1
_PLANES_ASM = tl.constexpr("{ .reg .b32 t, s; " + " ".join(
    f"shr.b32 s, $16, {2 * k}; lop3.b32 t, s, 0x00030003, 0x64006400, 0xea; "
    f"mov.b32 {{${2 * k}, ${2 * k + 1}}}, t;" for k in range(8)) + " }")


@triton.jit
def _half_planes(raw, ASM: tl.constexpr):
    """int32 words of sixteen int2 codes as sixteen fp16 tiles ``1024 + code``: for ``k`` = 0..7, code ``k``
    of the low word of eight, then of the high one. ``ASM``: one shift and one ``lop3`` make each pair in the
    register it stays in (``(w >> 2k) & 0x00030003 | 0x64006400``); without it (the interpreter) the same
    values element by element."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=_PLANES_ASM, constraints="=h," * 16 + "r", args=[raw], dtype=(tl.float16,) * 16, is_pure=True,
            pack=1)
    a0, b0 = _field_half(raw, 0, 3), _field_half(raw, 16, 3)
    a1, b1 = _field_half(raw, 2, 3), _field_half(raw, 18, 3)
    a2, b2 = _field_half(raw, 4, 3), _field_half(raw, 20, 3)
    a3, b3 = _field_half(raw, 6, 3), _field_half(raw, 22, 3)
    a4, b4 = _field_half(raw, 8, 3), _field_half(raw, 24, 3)
    a5, b5 = _field_half(raw, 10, 3), _field_half(raw, 26, 3)
    a6, b6 = _field_half(raw, 12, 3), _field_half(raw, 28, 3)
    a7, b7 = _field_half(raw, 14, 3), _field_half(raw, 30, 3)
    return a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7


@triton.jit
def _field_planes(raw):
    """Words of eight int3 codes (``[BLOCK_N, W]`` int32, code ``k`` at bit ``3k``: :func:`_fetch_bytes`) as
    eight fp16 tiles ``1024 + code``, plane ``k`` holding code ``k`` of each word."""
    return (_field_half(raw, 0, 7), _field_half(raw, 3, 7), _field_half(raw, 6, 7),
            _field_half(raw, 9, 7), _field_half(raw, 12, 7), _field_half(raw, 15, 7),
            _field_half(raw, 18, 7), _field_half(raw, 21, 7))


@triton.jit
def _plane_codes(raw, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr, BITS: tl.constexpr = 2):
    """int2 codes read as words (``[BLOCK_N, R_P2 / 16]`` int32) as the fp16 tile ``1024 + code``
    ``[BLOCK_N, R_P2]`` in bit-plane order: column ``k·W + w`` holds channel ``8w + k`` (:func:`_channels`).
    Each plane keeps the pairs of :func:`_half_planes` (words ``w``, ``w + 1``) side by side, and the planes
    go to the major end by a permute, so no code is moved alone: 338 against 723 instructions a 128-key
    tile at r 128 for the byte-wise unpacking, 188 against 381 at r 64 (a standalone probe, sm_90).
    ``BITS`` 3: ``raw`` holds eight codes a word (``[BLOCK_N, R_P2 / 8]``, :func:`_fetch_bytes`), and plane
    ``k`` is field ``k`` of each word (:func:`_field_planes`), in the same column order."""
    W8: tl.constexpr = R_P2 // 8
    if BITS == 3:
        p0, p1, p2, p3, p4, p5, p6, p7 = _field_planes(raw)
    else:
        a0, b0, a1, b1, a2, b2, a3, b3, a4, b4, a5, b5, a6, b6, a7, b7 = _half_planes(raw, ASM)
        p0 = tl.join(a0, b0).reshape(BLOCK_N, W8)
        p1 = tl.join(a1, b1).reshape(BLOCK_N, W8)
        p2 = tl.join(a2, b2).reshape(BLOCK_N, W8)
        p3 = tl.join(a3, b3).reshape(BLOCK_N, W8)
        p4 = tl.join(a4, b4).reshape(BLOCK_N, W8)
        p5 = tl.join(a5, b5).reshape(BLOCK_N, W8)
        p6 = tl.join(a6, b6).reshape(BLOCK_N, W8)
        p7 = tl.join(a7, b7).reshape(BLOCK_N, W8)
    # [BLOCK_N, W8, c, b, a] holds plane 4c + 2b + a; the permute puts the plane before the word
    t = tl.join(tl.join(tl.join(p0, p4), tl.join(p2, p6)), tl.join(tl.join(p1, p5), tl.join(p3, p7)))
    return tl.permute(t, (0, 2, 3, 4, 1)).reshape(BLOCK_N, R_P2)


@triton.jit
def _decode_latent(raw, scale, low, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
                   DTYPE: tl.constexpr, CH: tl.constexpr = False, LOG8: tl.constexpr = False,
                   PLANES: tl.constexpr = False, ASM: tl.constexpr = False):
    """The tile of :func:`_fetch_latent` for the tensor cores: float rows as loaded, or codes as fp16
    ``code · scale + low`` in registers, one fp16 scale and low per token and group of :data:`QUANT_GROUP`
    channels broadcast over the group (a load per channel read 8x the codes' bytes in scales: 0.25 TB/s at
    int4 on the H200). fp16, not the queries' bf16: the scale and low are fp16 already, so the latents are
    in fp16's range, and its 11-bit significand rounds them less (``DTYPE`` is fp16 wherever the keys are
    codes), but fp32 where ``DTYPE`` is (fp32 queries). Padded channels read as their group's low (the basis
    rows they meet are 0); masked keys as 0. ``PLANES``: int2 codes read as words, or int3 ones as the bytes'
    loop reads them, decoded by :func:`_plane_codes` into bit-plane column order (channel scales read at
    :func:`_channels`)."""
    if BITS == 16:
        z = raw
    else:
        if LOG8:
            scale, low = _log8(scale, BITS)
        if PLANES:
            codes = _plane_codes(raw, R_P2, BLOCK_N, ASM and DTYPE != tl.float32, BITS) - 1024.0
            if DTYPE == tl.float32:
                codes = codes.to(tl.float32)
                scale_t, low_t = scale, low
            else:
                scale_t, low_t = scale.to(tl.float16), low.to(tl.float16)
        elif DTYPE == tl.float32:  # fp32 queries: the latents in fp32 too
            codes = _unpack_codes(raw, R_P2, BLOCK_N, BITS).to(tl.float32)
            scale_t, low_t = scale, low
        else:
            codes = _codes_to_half(_unpack_codes(raw, R_P2, BLOCK_N, BITS))
            scale_t, low_t = scale.to(tl.float16), low.to(tl.float16)
        NG: tl.constexpr = (R_P2 + QUANT_GROUP - 1) // QUANT_GROUP
        if CH == 2:  # a row of scales and lows a token group, [NGT, R_P2], over the group's keys
            ROWS: tl.constexpr = BLOCK_N if BLOCK_N < QUANT_GROUP else QUANT_GROUP
            NGT: tl.constexpr = BLOCK_N // ROWS
            z = codes.reshape(NGT, ROWS, R_P2) * scale_t[:, None, :] + low_t[:, None, :]
            z = z.reshape(BLOCK_N, R_P2)
        elif CH:  # a scale and low per element (per channel and token group)
            z = codes * scale_t + low_t
        elif NG == 1:
            z = codes * scale_t[:, None] + low_t[:, None]
        elif PLANES:  # column k·W + w: channel 8w + k, of group w // (QUANT_GROUP / 8)
            W8: tl.constexpr = R_P2 // 8
            z = codes.reshape(BLOCK_N, 8, NG, W8 // NG) * scale_t[:, None, :, None] + low_t[:, None, :, None]
            z = z.reshape(BLOCK_N, R_P2)
        else:
            z = codes.reshape(BLOCK_N, NG, QUANT_GROUP) * scale_t[:, :, None] + low_t[:, :, None]
            z = z.reshape(BLOCK_N, R_P2)
    return z


@triton.jit
def _word_nibbles(raw, ASM: tl.constexpr):
    """int4 codes read as int32 words ``[BLOCK_N, W]`` (eight codes a word: channels ``8w .. 8w + 7``) as the
    two fp16 tiles of :func:`_nibbles_to_half`, ``[BLOCK_N, 4W]`` each. The word arrives in one register, so
    Triton packs no bytes into it first (the byte loop's input is one uint8 a register); the pairs the
    byte permutes make keep their register (the outer join is the pair)."""
    BLOCK_N: tl.constexpr = raw.shape[0]
    W: tl.constexpr = raw.shape[1]
    if ASM:
        e0, e1, e2, e3, o0, o1, o2, o3 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 lo, hi, a;
            and.b32 lo, $8, 0x0F0F0F0F;
            shr.u32 hi, $8, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            prmt.b32 a, lo, 0x64646464, 0x4140;
            mov.b32 {$0, $1}, a;
            prmt.b32 a, lo, 0x64646464, 0x4342;
            mov.b32 {$2, $3}, a;
            prmt.b32 a, hi, 0x64646464, 0x4140;
            mov.b32 {$4, $5}, a;
            prmt.b32 a, hi, 0x64646464, 0x4342;
            mov.b32 {$6, $7}, a;
            }
            """,
            constraints="=h," * 8 + "r", args=[raw], dtype=(tl.float16,) * 8, is_pure=True, pack=1)
    else:
        e0, e1, e2, e3 = _field_half(raw, 0, 15), _field_half(raw, 8, 15), _field_half(raw, 16, 15), \
            _field_half(raw, 24, 15)
        o0, o1, o2, o3 = _field_half(raw, 4, 15), _field_half(raw, 12, 15), _field_half(raw, 20, 15), \
            _field_half(raw, 28, 15)
    even = tl.join(tl.join(e0, e2), tl.join(e1, e3)).reshape(BLOCK_N, 4 * W)
    odd = tl.join(tl.join(o0, o2), tl.join(o1, o3)).reshape(BLOCK_N, 4 * W)
    return even, odd


@triton.jit
def _nibbles_to_half(raw, ASM: tl.constexpr):
    """Packed int4 bytes ``[..., W]`` (uint8) as two fp16 tiles of the same shape, ``1024 + code`` of the
    low nibbles (even channels) and of the high ones (odd channels). ``ASM``: four bytes at a time in one
    32-bit register, two masks and a shift for all eight codes and one byte permute per pair of fp16
    results (``0x64`` above each code is ``0x6400 | c``); element-wise Triton spends a mask, a conversion
    and a permute on every code (benchmarks/experiments/kernel_sass.py). Without it (the interpreter, which
    runs no PTX) the same values element by element. int32 words (``nibble_words``): :func:`_word_nibbles`."""
    if raw.dtype == tl.int32:
        even, odd = _word_nibbles(raw, ASM)
    elif ASM:
        even, odd = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 lo, hi;
            and.b32 lo, $4, 0x0F0F0F0F;
            shr.u32 hi, $4, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            prmt.b32 $0, lo, 0x64646464, 0x4140;
            prmt.b32 $1, lo, 0x64646464, 0x4342;
            prmt.b32 $2, hi, 0x64646464, 0x4140;
            prmt.b32 $3, hi, 0x64646464, 0x4342;
            }
            """,
            constraints="=r,=r,=r,=r,r", args=[raw], dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    else:
        even = ((raw & 15).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        odd = ((raw >> 4).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
    return even, odd


@triton.jit
def _decode_nibbles(raw, scale, low, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
                    ASM: tl.constexpr, LOG8: tl.constexpr = False):
    """Packed int4 codes (token layout) of :func:`_fetch_latent` as two ``[BLOCK_N, R_P2 / 2]`` tiles: the
    even channels (low nibbles) and the odd ones (high nibbles), each ``code · scale + low``. Byte ``j``
    holds channels ``2j`` and ``2j + 1`` (``stiefkv.quant.pack``), so the halves need no interleaving join:
    the caller meets them with the even and odd halves of its other operand, two dots of half the depth."""
    HALF_R: tl.constexpr = R_P2 // 2
    NG: tl.constexpr = (R_P2 + QUANT_GROUP - 1) // QUANT_GROUP
    if LOG8:
        scale, low = _log8(scale, 4)
    if DTYPE == tl.float32:
        even, odd = _nibbles_to_half(raw, False)
        even, odd = even.to(tl.float32) - 1024.0, odd.to(tl.float32) - 1024.0
        scale_t, low_t = scale, low
    else:
        even, odd = _nibbles_to_half(raw, ASM)
        even, odd = even - 1024.0, odd - 1024.0
        scale_t, low_t = scale.to(tl.float16), low.to(tl.float16)
    if NG == 1:
        even = even * scale_t[:, None] + low_t[:, None]
        odd = odd * scale_t[:, None] + low_t[:, None]
    else:  # channel 2j (and 2j + 1) lies in group 2j // QUANT_GROUP: QUANT_GROUP / 2 bytes a group
        GB: tl.constexpr = QUANT_GROUP // 2
        even = even.reshape(BLOCK_N, NG, GB) * scale_t[:, :, None] + low_t[:, :, None]
        odd = odd.reshape(BLOCK_N, NG, GB) * scale_t[:, :, None] + low_t[:, :, None]
        even, odd = even.reshape(BLOCK_N, HALF_R), odd.reshape(BLOCK_N, HALF_R)
    return even, odd


@triton.jit
def _load_nibbles(Z, S, L, offs_n, hi, stride_n, stride_r, stride_sn, stride_sg,
                  R: tl.constexpr, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr,
                  DTYPE: tl.constexpr, ASM: tl.constexpr, LOG8: tl.constexpr = False):
    """:func:`_load_latent` for :func:`_decode_nibbles`: the even and odd channel halves of an int4 tile."""
    raw, scale, low = _fetch_latent(Z, S, L, offs_n, hi, stride_n, stride_r, stride_sn, stride_sg, R, R_P2,
                                    BLOCK_N, MASK_N, 4, False, LOG8)
    return _decode_nibbles(raw, scale, low, R_P2, BLOCK_N, DTYPE, ASM, LOG8)


@triton.jit
def _word_pairs(raw, BLOCK_N: tl.constexpr, W: tl.constexpr, ASM: tl.constexpr):
    """int32 words of int8 codes ``[BLOCK_N, W]`` as two fp16 tiles ``[BLOCK_N, 2W]`` of ``1024 + code``:
    the first holds channels ``4w, 4w + 1`` at ``2w, 2w + 1``, the second ``4w + 2, 4w + 3``. ``ASM``: one
    byte permute makes each pair in the register it stays in (the join keeps the two halves of a register
    together), where the byte-wise form spends a permute to unpack each code and another to pack each pair
    (``benchmarks/experiments/fp8_decode_probe.py``, ``int8-pairs``: 776 against 1568 instructions a
    128-key tile at r 128, sm_90). Without it (the interpreter, which runs no PTX) the same values byte by
    byte."""
    if ASM:
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            asm="""
            {
            .reg .b32 a, b;
            prmt.b32 a, $4, 0x64646464, 0x4140;
            prmt.b32 b, $4, 0x64646464, 0x4342;
            mov.b32 {$0, $1}, a;
            mov.b32 {$2, $3}, b;
            }
            """,
            constraints="=h,=h,=h,=h,r", args=[raw], dtype=(tl.float16,) * 4, is_pure=True, pack=1)
    else:
        b0, b1 = _field_half(raw, 0, 255), _field_half(raw, 8, 255)
        b2, b3 = _field_half(raw, 16, 255), _field_half(raw, 24, 255)
    return tl.join(b0, b1).reshape(BLOCK_N, 2 * W), tl.join(b2, b3).reshape(BLOCK_N, 2 * W)


@triton.jit
def _decode_pairs(raw, scale, low, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, DTYPE: tl.constexpr,
                  ASM: tl.constexpr, LOG8: tl.constexpr = False):
    """int8 codes (token layout) read as words (:func:`_fetch_words`) as two ``[BLOCK_N, R_P2 / 2]`` tiles of
    ``code · scale + low``, the channel pairs of :func:`_word_pairs`: met, as the int4 nibbles are, with the
    matching halves of the other operand in two dots of half the depth. Column ``2w + j`` of a tile holds
    channel ``4w + j`` (or ``+ 2``), of scale group ``4w // QUANT_GROUP``: the tile's column blocks of
    ``QUANT_GROUP / 2``."""
    HALF: tl.constexpr = R_P2 // 2
    NG: tl.constexpr = (R_P2 + QUANT_GROUP - 1) // QUANT_GROUP
    if LOG8:
        scale, low = _log8(scale, 8)
    if DTYPE == tl.float32:
        a, b = _word_pairs(raw, BLOCK_N, R_P2 // 4, False)
        a, b = a.to(tl.float32) - 1024.0, b.to(tl.float32) - 1024.0
        scale_t, low_t = scale, low
    else:
        a, b = _word_pairs(raw, BLOCK_N, R_P2 // 4, ASM)
        a, b = a - 1024.0, b - 1024.0
        scale_t, low_t = scale.to(tl.float16), low.to(tl.float16)
    if NG == 1:
        a = a * scale_t[:, None] + low_t[:, None]
        b = b * scale_t[:, None] + low_t[:, None]
    else:
        GH: tl.constexpr = HALF // NG
        a = (a.reshape(BLOCK_N, NG, GH) * scale_t[:, :, None] + low_t[:, :, None]).reshape(BLOCK_N, HALF)
        b = (b.reshape(BLOCK_N, NG, GH) * scale_t[:, :, None] + low_t[:, :, None]).reshape(BLOCK_N, HALF)
    return a, b


@triton.jit
def _decode_halves(raw, scale, low, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, BITS: tl.constexpr,
                   DTYPE: tl.constexpr, ASM: tl.constexpr, LOG8: tl.constexpr = False):
    """A code tile met as two channel halves: int4 nibbles (even and odd channels) or int8 pairs."""
    if BITS == 8:
        a, b = _decode_pairs(raw, scale, low, R_P2, BLOCK_N, DTYPE, ASM, LOG8)
    else:
        a, b = _decode_nibbles(raw, scale, low, R_P2, BLOCK_N, DTYPE, ASM, LOG8)
    return a, b


@triton.jit
def _half_channels(R_P2: tl.constexpr, STEP: tl.constexpr):
    """The channels of the first half of :func:`_decode_halves` (the second's are ``STEP`` above): ``2i``
    (int4, ``STEP`` 1), or ``4w + j`` at ``i = 2w + j`` (int8 pairs, ``STEP`` 2)."""
    i = tl.arange(0, R_P2 // 2)
    return (2 * STEP) * (i // STEP) + i % STEP


@triton.jit
def _split_acc(acc, BLOCK_M: tl.constexpr, R_P2: tl.constexpr, BITS: tl.constexpr):
    """The value accumulator ``[BLOCK_M, R_P2]`` as the two halves :func:`_decode_halves` fills: even and
    odd channels (int4), or channels ``4w + j`` and ``4w + 2 + j`` at ``2w + j`` (int8 pairs)."""
    if BITS == 8:
        acc = acc.reshape(BLOCK_M, R_P2 // 4, 2, 2).permute(0, 1, 3, 2)
        a, b = tl.split(acc.reshape(BLOCK_M, R_P2 // 2, 2))
    else:
        a, b = tl.split(tl.reshape(acc, [BLOCK_M, R_P2 // 2, 2]))
    return a, b


@triton.jit
def _join_acc(a, b, BLOCK_M: tl.constexpr, R_P2: tl.constexpr, BITS: tl.constexpr):
    """The inverse of :func:`_split_acc`."""
    if BITS == 8:
        acc = tl.join(a, b).reshape(BLOCK_M, R_P2 // 4, 2, 2).permute(0, 1, 3, 2).reshape(BLOCK_M, R_P2)
    else:
        acc = tl.join(a, b).reshape(BLOCK_M, R_P2)
    return acc


@triton.jit
def _load_latent(Z, S, L, offs_n, hi, stride_n, stride_r, stride_sn, stride_sg,
                 R: tl.constexpr, R_P2: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr,
                 BITS: tl.constexpr, DTYPE: tl.constexpr, CH: tl.constexpr = False,
                 LOG8: tl.constexpr = False):
    """A ``[BLOCK_N, R_P2]`` tile of latents in ``DTYPE``, read and decoded at once. No early return in the
    helpers: the compiler (unlike the interpreter) generates the code after a ``return`` inside a constexpr
    ``if``."""
    raw, scale, low = _fetch_latent(Z, S, L, offs_n, hi, stride_n, stride_r, stride_sn, stride_sg, R, R_P2,
                                    BLOCK_N, MASK_N, BITS, CH, LOG8)
    return _decode_latent(raw, scale, low, R_P2, BLOCK_N, BITS, DTYPE, CH, LOG8)


@triton.jit
def _code_tile(Z, offs_n, hi, stride_n, stride_r, R: tl.constexpr, R_P2: tl.constexpr, BLOCK_N: tl.constexpr,
               MASK_N: tl.constexpr, BITS: tl.constexpr):
    """The ``[BLOCK_N, R_P2]`` codes (uint8 values; ``BITS`` 8 or 4, token layout) of a tile, without their
    scales (``fold_scales``)."""
    raw = _fetch_bytes(Z, offs_n, hi, stride_n, stride_r, R, R_P2, MASK_N, BITS)
    return _unpack_codes(raw, R_P2, BLOCK_N, BITS)


@triton.jit
def _token_scales(S, L, offs_n, hi, stride_sn, MASK_N: tl.constexpr, LOG8: tl.constexpr = False,
                  BITS: tl.constexpr = 8):
    """The fp32 scale and low ``[BLOCK_N]`` of each key of a tile whose latents fit one scale group (from
    their log8 codes with ``LOG8``, at ``BITS``)."""
    if LOG8:
        if MASK_N:
            k = tl.load(S + offs_n * stride_sn, mask=offs_n < hi, other=0)
        else:
            k = tl.load(S + offs_n * stride_sn)
        scale, low = _log8(k, BITS)
    elif MASK_N:
        scale = tl.load(S + offs_n * stride_sn, mask=offs_n < hi, other=0.0).to(tl.float32)
        low = tl.load(L + offs_n * stride_sn, mask=offs_n < hi, other=0.0).to(tl.float32)
    else:
        scale = tl.load(S + offs_n * stride_sn).to(tl.float32)
        low = tl.load(L + offs_n * stride_sn).to(tl.float32)
    return scale, low


@triton.jit
def _query_rows(pid_m, n_q, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows ``m = i·GROUP + s`` of query tile ``pid_m``: ``(offs_m, query i, head-in-group s, valid)``."""
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return offs_m, offs_m // GROUP, offs_m % GROUP, offs_m < n_q * GROUP


@triton.jit
def _online_softmax_update(acc, l_i, m_i, s, v, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr):
    """One step of the online softmax over a key tile: ``m' = max(m, max_j s_j)``,
    ``ℓ' = ℓ·2^(m−m') + Σ_j 2^(s_j−m')``, ``acc' = acc·2^(m−m') + 2^(s−m') v`` (logits in base-2 units)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PREC, UPCAST)
    return acc, l_i, m_new


@triton.jit
def _fetch_pos(POS, offs_n, end, stride_posn, BLOCK_N: tl.constexpr, KEY_MODE: tl.constexpr,
               MASKED: tl.constexpr):
    """The positions ``[BLOCK_N]`` of a key tile (``pre_rope``; zeros for ``post_rope``, which has none)."""
    if KEY_MODE == 0:
        if MASKED:
            pos = tl.load(POS + offs_n * stride_posn, mask=offs_n < end, other=0)
        else:
            pos = tl.load(POS + offs_n * stride_posn)
    else:
        pos = tl.zeros([BLOCK_N], dtype=tl.int32)
    return pos


@triton.jit
def _rotated_logits(q1, q2, a1, a2, pos, inv_freq, dtype: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, FAST_SINCOS: tl.constexpr, DOT_PREC: tl.constexpr,
                    UPCAST: tl.constexpr, KEYS_LEFT: tl.constexpr = False):
    """``pre_rope`` logits ``[BLOCK_M, BLOCK_N]`` of the query halves against rebuilt key halves ``a1``,
    ``a2`` ``[BLOCK_N, d/2]`` (fp32), rotated at their positions ``pos`` and rounded to ``dtype``.
    ``KEYS_LEFT`` computes ``(k qᵀ)ᵀ``: the rotated keys, still in the rebuild's accumulator layout, are
    the dot's left operand, which the tensor cores read from registers; as the right operand (``q kᵀ``)
    the tile goes through shared memory first. Only the ``[BLOCK_N, BLOCK_M]`` logits are transposed."""
    angle = pos.to(tl.float32)[:, None] * inv_freq[None, :]
    if FAST_SINCOS:  # 2: the turns rounded on the FMA pipe (sincos_fadd)
        sin, cos = _sincos_fast(angle, FAST_SINCOS == 2)
    else:
        sin, cos = _sincos(angle)
    k1 = (a1 * cos - a2 * sin).to(dtype)
    k2 = (a2 * cos + a1 * sin).to(dtype)
    if KEYS_LEFT:
        st = _dot(k1, tl.trans(q1), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT_PREC, UPCAST)
        return tl.trans(_dot(k2, tl.trans(q2), st, DOT_PREC, UPCAST))
    s = _dot(q1, tl.trans(k1), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PREC, UPCAST)
    return _dot(q2, tl.trans(k2), s, DOT_PREC, UPCAST)


@triton.jit
def _key_logits(q1, q2, p1t, p2t, inv_freq, z, pos, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, KEY_MODE: tl.constexpr, FAST_SINCOS: tl.constexpr,
                DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, KEYS_LEFT: tl.constexpr = False):
    """The logits ``[BLOCK_M, BLOCK_N]`` of the query tile against a tile ``z`` of key latents at
    positions ``pos``: ``pre_rope`` rebuilds and rotates the keys, once for all the group's query heads."""
    HALF: tl.constexpr = HEAD_DIM // 2
    if KEY_MODE == 0:  # pre_rope: rebuild and rotate the keys, once for all the group's query heads
        zero = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
        a1 = _dot(z, p1t, zero, DOT_PREC, UPCAST)  # [BLOCK_N, d/2]
        a2 = _dot(z, p2t, zero, DOT_PREC, UPCAST)
        s = _rotated_logits(q1, q2, a1, a2, pos, inv_freq, z.dtype, BLOCK_M, BLOCK_N, FAST_SINCOS, DOT_PREC,
                            UPCAST, KEYS_LEFT)
    else:  # post_rope: the projected queries meet the latents directly
        s = _dot(q1, tl.trans(z), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PREC, UPCAST)
    return s


@triton.jit
def _nibble_logits(q1, q2, p1t, p2t, p1t_o, p2t_o, inv_freq, z_even, z_odd, pos, HEAD_DIM: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_MODE: tl.constexpr,
                   FAST_SINCOS: tl.constexpr, DOT_PREC: tl.constexpr, UPCAST: tl.constexpr,
                   KEYS_LEFT: tl.constexpr = False):
    """:func:`_key_logits` of a key tile met as its even and odd channels (:func:`_decode_nibbles`):
    ``pre_rope`` rebuilds the keys from both halves against the basis's even (``p1t``, ``p2t``) and odd
    (``p1t_o``, ``p2t_o``) channels; ``post_rope``'s ``q1``, ``q2`` are the projected queries' even and odd
    channels."""
    HALF: tl.constexpr = HEAD_DIM // 2
    if KEY_MODE == 0:
        zero = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
        a1 = _dot(z_odd, p1t_o, _dot(z_even, p1t, zero, DOT_PREC, UPCAST), DOT_PREC, UPCAST)  # [BLOCK_N, d/2]
        a2 = _dot(z_odd, p2t_o, _dot(z_even, p2t, zero, DOT_PREC, UPCAST), DOT_PREC, UPCAST)
        s = _rotated_logits(q1, q2, a1, a2, pos, inv_freq, z_even.dtype, BLOCK_M, BLOCK_N, FAST_SINCOS,
                            DOT_PREC, UPCAST, KEYS_LEFT)
    else:
        s = _dot(q1, tl.trans(z_even), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PREC, UPCAST)
        s = _dot(q2, tl.trans(z_odd), s, DOT_PREC, UPCAST)
    return s


@triton.jit
def _decoded_keys(kr, ks, kl, R_K_P2: tl.constexpr, BLOCK_N: tl.constexpr, K_BITS: tl.constexpr,
                  DTYPE: tl.constexpr, K_CH: tl.constexpr, K_LOG8: tl.constexpr, K_PLANES: tl.constexpr,
                  NIB_K: tl.constexpr, FP16: tl.constexpr):
    """A prefetched key tile decoded: its even and odd channels (``NIB_K``), else the whole tile twice."""
    if NIB_K:
        ze, zo = _decode_halves(kr, ks, kl, R_K_P2, BLOCK_N, K_BITS, DTYPE, FP16, K_LOG8)
    else:
        ze = _decode_latent(kr, ks, kl, R_K_P2, BLOCK_N, K_BITS, DTYPE, K_CH, K_LOG8, K_PLANES, FP16)
        zo = ze
    return ze, zo


@triton.jit
def _rebuilt_halves(z, p1t, p2t, HALF: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                    UPCAST: tl.constexpr):
    """The rebuilt key halves ``[BLOCK_N, d/2]`` (fp32) of a ``pre_rope`` tile: ``z P_1ᵀ``, ``z P_2ᵀ``."""
    zero = tl.zeros([BLOCK_N, HALF], dtype=tl.float32)
    return _dot(z, p1t, zero, DOT_PREC, UPCAST), _dot(z, p2t, zero, DOT_PREC, UPCAST)


@triton.jit
def _attend_range(
    acc, l_i, m_i, q1, q2, p1t, p2t, p1t_o, p2t_o, inv_freq, bias_scale, start, end, q_idx, n_q, n_k,
    ZK, ZV, POS, BIAS, SK, LK, SV, LV,
    stride_kn, stride_kr, stride_vn, stride_vr, stride_posn, stride_bn,
    stride_skn, stride_skg, stride_svn, stride_svg,
    HEAD_DIM: tl.constexpr, R_K: tl.constexpr, R_V: tl.constexpr, R_K_P2: tl.constexpr, R_V_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEY_MODE: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, MASKED: tl.constexpr, FAST_SINCOS: tl.constexpr, DOT_PREC: tl.constexpr,
    UPCAST: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr, DTYPE: tl.constexpr,
    q1sum, FOLD_K: tl.constexpr, FOLD_V: tl.constexpr, PREFETCH: tl.constexpr,
    K_CH: tl.constexpr = False, V_CH: tl.constexpr = False, NIB_K: tl.constexpr = False,
    NIB_V: tl.constexpr = False, FOLD_NIB: tl.constexpr = False, K_LOG8: tl.constexpr = False,
    V_LOG8: tl.constexpr = False, KEYS_LEFT: tl.constexpr = False, LATE_V: tl.constexpr = False,
    K_PLANES: tl.constexpr = False, V_PLANES: tl.constexpr = False, K_NIBW: tl.constexpr = False,
    V_NIBW: tl.constexpr = False, AHEAD: tl.constexpr = False,
):
    """Attend the query tile to keys ``[start, end)`` tile by tile. ``MASKED=False`` is for tiles every row
    sees entirely; ``MASKED=True`` masks keys ``≥ end`` and, when causal, keys past each row's position.
    ``ZK``/``ZV``/``POS``/``BIAS`` (and the scales and lows ``SK``, ``LK``, ``SV``, ``LV`` of quantized
    latents) already point at this (batch row, KV head). ``FOLD_K`` (``post_rope`` codes in one scale group)
    and ``FOLD_V`` (value codes in one group) apply each token's scale and low to the logits or to the
    probabilities instead of dequantizing the tile: ``s = (q'·code)·scale + (Σ q')·low`` (``q1sum`` is
    ``Σ q'`` per row) and ``acc += (p·scale) code + Σ_j p_j·low_j``. ``PREFETCH`` (not with a fold) reads
    the next tile's latents, scales, lows and positions before this tile's compute, a register double
    buffer: the pipeliner stages the float tiles that feed a dot, but the small scale and position loads of
    a tile were left in its critical path; its reads past ``end`` are masked. ``NIB_K`` and ``NIB_V`` (int4
    codes, token layout) meet a tile as its even and odd channels (:func:`_decode_nibbles`): the keys against
    the basis's (``pre_rope``: ``p1t``, ``p2t`` even, ``p1t_o``, ``p2t_o`` odd) or the projected query's
    (``post_rope``: ``q1``, ``q2``) even and odd channels, the values into two halves joined on return; over
    int8 codes (``pairs``, with ``PREFETCH`` only) the halves are the channel pairs of :func:`_decode_pairs`.
    ``FOLD_NIB`` (``post_rope`` int4 keys in one scale group, with ``PREFETCH``) leaves the key codes as
    ``1024 + code`` and applies each token's scale and low to the logits (``q1sum`` is ``Σ q'``).
    ``LATE_V`` (with ``PREFETCH``) keeps this tile's value codes packed through the logits and softmax and
    decodes them just before the value dot: the decoded tile (4× the codes' registers at int4) is then not
    live beside the logits. ``AHEAD`` (``pre_rope`` over float latents, no prefetch) forms the logits one
    tile ahead: an iteration issues the next tile's rebuild, runs this tile's softmax and value dot on the
    logits the last one left, then rotates the next tile and forms its logits. The two tiles' chains are
    independent, so the scheduler can overlap them (FlashAttention-3's softmax and GEMM overlap within a
    warpgroup); the logits it carries are ``BLOCK_M × BLOCK_N`` floats. (Over prefetched codes it lost:
    docs/notes/kernel-tries.md.)"""
    offs_nt = tl.arange(0, BLOCK_N)
    tl.static_assert(not AHEAD or (KEY_MODE == 0 and not PREFETCH and not FOLD_K and not NIB_K),
                     "logits ahead: pre_rope over float latents without prefetch only")
    HALF: tl.constexpr = HEAD_DIM // 2
    PAIR_K: tl.constexpr = NIB_K and K_BITS == 8  # int8 codes read as words (channel pairs)
    PAIR_V: tl.constexpr = NIB_V and V_BITS == 8
    tl.static_assert(PREFETCH or not (PAIR_K or PAIR_V), "int8 pairs are read by the prefetched loop only")
    # int2 codes read as words and met as bit planes (the other operand's rows at _channels), prefetched only
    tl.static_assert(PREFETCH or not (K_PLANES or V_PLANES), "int2 and int3 planes: the prefetched loop only")
    # int4 nibbles read as words (K_NIBW, V_NIBW), prefetched only
    tl.static_assert(PREFETCH or not (K_NIBW or V_NIBW), "int4 words: the prefetched loop only")
    WORDS_K: tl.constexpr = PAIR_K or (K_PLANES and K_BITS == 2) or K_NIBW  # int3 planes: the bytes' reads
    WORDS_V: tl.constexpr = PAIR_V or (V_PLANES and V_BITS == 2) or V_NIBW
    if NIB_V:
        acc_e, acc_o = _split_acc(acc, BLOCK_M, R_V_P2, V_BITS)
    if PREFETCH:
        kr, ks, kl = _fetch_latent(ZK, SK, LK, start + offs_nt, end, stride_kn, stride_kr, stride_skn,
                                   stride_skg, R_K, R_K_P2, BLOCK_N, True, K_BITS, K_CH, K_LOG8, WORDS_K,
                                   K_PLANES)
        kp = _fetch_pos(POS, start + offs_nt, end, stride_posn, BLOCK_N, KEY_MODE, True)
        vr, vs, vl = _fetch_latent(ZV, SV, LV, start + offs_nt, end, stride_vn, stride_vr, stride_svn,
                                   stride_svg, R_V, R_V_P2, BLOCK_N, True, V_BITS, V_CH, V_LOG8, WORDS_V,
                                   V_PLANES)
    if AHEAD:  # the first tile's logits; each iteration forms the next one's
        z_a = _load_latent(ZK, SK, LK, start + offs_nt, end, stride_kn, stride_kr, stride_skn, stride_skg,
                           R_K, R_K_P2, BLOCK_N, True, K_BITS, DTYPE, K_CH, K_LOG8)
        pos_a = _fetch_pos(POS, start + offs_nt, end, stride_posn, BLOCK_N, KEY_MODE, True)
        a1, a2 = _rebuilt_halves(z_a, p1t, p2t, HALF, BLOCK_N, DOT_PREC, UPCAST)
        s_a = _rotated_logits(q1, q2, a1, a2, pos_a, inv_freq, DTYPE, BLOCK_M, BLOCK_N, FAST_SINCOS, DOT_PREC,
                              UPCAST, KEYS_LEFT)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_nt
        if PREFETCH:
            if FOLD_NIB:  # 1024 + code: this tile's scale and low go to the logits below
                ze, zo = _nibbles_to_half(kr, not UPCAST)
                if DTYPE == tl.float32:
                    ze, zo = ze.to(tl.float32), zo.to(tl.float32)
                if K_LOG8:
                    k_scale, k_low = _log8(ks, 4)
                else:
                    k_scale, k_low = ks, kl
            else:
                ze, zo = _decoded_keys(kr, ks, kl, R_K_P2, BLOCK_N, K_BITS, DTYPE, K_CH, K_LOG8, K_PLANES,
                                       NIB_K, not UPCAST)
                z = ze
            pos = kp
            if LATE_V:
                vr_c, vs_c, vl_c = vr, vs, vl
            elif NIB_V:
                ve, vo = _decode_halves(vr, vs, vl, R_V_P2, BLOCK_N, V_BITS, DTYPE, not UPCAST, V_LOG8)
            else:
                v = _decode_latent(vr, vs, vl, R_V_P2, BLOCK_N, V_BITS, DTYPE, V_CH, V_LOG8, V_PLANES,
                                   not UPCAST)
            nxt = offs_n + BLOCK_N
            kr, ks, kl = _fetch_latent(ZK, SK, LK, nxt, end, stride_kn, stride_kr, stride_skn, stride_skg,
                                       R_K, R_K_P2, BLOCK_N, True, K_BITS, K_CH, K_LOG8, WORDS_K, K_PLANES)
            kp = _fetch_pos(POS, nxt, end, stride_posn, BLOCK_N, KEY_MODE, True)
            vr, vs, vl = _fetch_latent(ZV, SV, LV, nxt, end, stride_vn, stride_vr, stride_svn, stride_svg,
                                       R_V, R_V_P2, BLOCK_N, True, V_BITS, V_CH, V_LOG8, WORDS_V, V_PLANES)
            if NIB_K:
                s = _nibble_logits(q1, q2, p1t, p2t, p1t_o, p2t_o, inv_freq, ze, zo, pos, HEAD_DIM, BLOCK_M,
                                   BLOCK_N, KEY_MODE, FAST_SINCOS, DOT_PREC, UPCAST, KEYS_LEFT)
                if FOLD_NIB:  # q'·(code·scale + low) = scale·(q'·(1024 + code)) + (low − 1024·scale)·Σq'
                    s = s * k_scale[None, :] + q1sum[:, None] * (k_low - 1024.0 * k_scale)[None, :]
            else:
                s = _key_logits(q1, q2, p1t, p2t, inv_freq, z, pos, HEAD_DIM, BLOCK_M, BLOCK_N, KEY_MODE,
                                FAST_SINCOS, DOT_PREC, UPCAST, KEYS_LEFT)
        elif FOLD_K:
            codes = _code_tile(ZK, offs_n, end, stride_kn, stride_kr, R_K, R_K_P2, BLOCK_N, MASKED, K_BITS)
            scale, low = _token_scales(SK, LK, offs_n, end, stride_skn, MASKED, K_LOG8, K_BITS)
            k = _codes_to_half(codes)
            s = _dot(q1, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_PREC, UPCAST)
            s = s * scale[None, :] + q1sum[:, None] * low[None, :]
        elif NIB_K:
            ze, zo = _load_nibbles(ZK, SK, LK, offs_n, end, stride_kn, stride_kr, stride_skn, stride_skg,
                                   R_K, R_K_P2, BLOCK_N, MASKED, DTYPE, not UPCAST, K_LOG8)
            pos = _fetch_pos(POS, offs_n, end, stride_posn, BLOCK_N, KEY_MODE, MASKED)
            s = _nibble_logits(q1, q2, p1t, p2t, p1t_o, p2t_o, inv_freq, ze, zo, pos, HEAD_DIM, BLOCK_M,
                               BLOCK_N, KEY_MODE, FAST_SINCOS, DOT_PREC, UPCAST, KEYS_LEFT)
        elif AHEAD:  # this tile's logits came from the last iteration; the next tile's rebuild starts here
            s = s_a
            nxt = offs_n + BLOCK_N
            z_a = _load_latent(ZK, SK, LK, nxt, end, stride_kn, stride_kr, stride_skn, stride_skg,
                               R_K, R_K_P2, BLOCK_N, True, K_BITS, DTYPE, K_CH, K_LOG8)
            pos_a = _fetch_pos(POS, nxt, end, stride_posn, BLOCK_N, KEY_MODE, True)
            a1, a2 = _rebuilt_halves(z_a, p1t, p2t, HALF, BLOCK_N, DOT_PREC, UPCAST)
        else:
            z = _load_latent(ZK, SK, LK, offs_n, end, stride_kn, stride_kr, stride_skn, stride_skg,
                             R_K, R_K_P2, BLOCK_N, MASKED, K_BITS, DTYPE, K_CH, K_LOG8)  # [BLOCK_N, R_K_P2]
            pos = _fetch_pos(POS, offs_n, end, stride_posn, BLOCK_N, KEY_MODE, MASKED)
            s = _key_logits(q1, q2, p1t, p2t, inv_freq, z, pos, HEAD_DIM, BLOCK_M, BLOCK_N, KEY_MODE,
                            FAST_SINCOS, DOT_PREC, UPCAST, KEYS_LEFT)
        if HAS_BIAS:
            if MASKED:
                bias = tl.load(BIAS + offs_n * stride_bn, mask=offs_n < end, other=0.0)
            else:
                bias = tl.load(BIAS + offs_n * stride_bn)
            s += bias.to(tl.float32)[None, :] * bias_scale
        if MASKED:
            visible = (offs_n < end)[None, :]
            if CAUSAL:
                visible = visible & (offs_n[None, :] <= (n_k - n_q + q_idx)[:, None])
            s = tl.where(visible, s, float("-inf"))
        if FOLD_V:
            codes = _code_tile(ZV, offs_n, end, stride_vn, stride_vr, R_V, R_V_P2, BLOCK_N, MASKED, V_BITS)
            scale, low = _token_scales(SV, LV, offs_n, end, stride_svn, MASKED, V_LOG8, V_BITS)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            # bf16, not fp16: p·scale can fall below fp16's normal range (scales of 1e-3 and less);
            # codes ≤ 255 are exact in bf16. Through fp32: the interpreter casts uint8 to bf16 as 0.
            v = codes.to(tl.float32).to(tl.bfloat16)
            acc = _dot((p * scale[None, :]).to(tl.bfloat16), v, acc * alpha[:, None], DOT_PREC, UPCAST)
            acc += tl.sum(p * low[None, :], 1)[:, None]
            m_i = m_new
        elif NIB_V:
            if not PREFETCH:
                ve, vo = _load_nibbles(ZV, SV, LV, offs_n, end, stride_vn, stride_vr, stride_svn, stride_svg,
                                       R_V, R_V_P2, BLOCK_N, MASKED, DTYPE, not UPCAST, V_LOG8)
            elif LATE_V:
                ve, vo = _decode_halves(vr_c, vs_c, vl_c, R_V_P2, BLOCK_N, V_BITS, DTYPE, not UPCAST, V_LOG8)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc_e = _dot(p.to(ve.dtype), ve, acc_e * alpha[:, None], DOT_PREC, UPCAST)
            acc_o = _dot(p.to(vo.dtype), vo, acc_o * alpha[:, None], DOT_PREC, UPCAST)
            m_i = m_new
        else:
            if not PREFETCH:
                v = _load_latent(ZV, SV, LV, offs_n, end, stride_vn, stride_vr, stride_svn, stride_svg,
                                 R_V, R_V_P2, BLOCK_N, MASKED, V_BITS, DTYPE, V_CH, V_LOG8)  # [N, R_V_P2]
            elif LATE_V:
                v = _decode_latent(vr_c, vs_c, vl_c, R_V_P2, BLOCK_N, V_BITS, DTYPE, V_CH, V_LOG8, V_PLANES,
                                   not UPCAST)
            acc, l_i, m_i = _online_softmax_update(acc, l_i, m_i, s, v, DOT_PREC, UPCAST)
        if AHEAD:  # the next tile's rotation and logits, after this tile's softmax in program order
            s_a = _rotated_logits(q1, q2, a1, a2, pos_a, inv_freq, DTYPE, BLOCK_M, BLOCK_N, FAST_SINCOS,
                                  DOT_PREC, UPCAST, KEYS_LEFT)
    if NIB_V:
        acc = _join_acc(acc_e, acc_o, BLOCK_M, R_V_P2, V_BITS)
    return acc, l_i, m_i


@triton.jit
def _epilogue_store(
    acc, l_i, PV, O_rows, row_ok, stride_pvd, stride_pvr, stride_od,
    HEAD_DIM: tl.constexpr, R_V: tl.constexpr, R_V_P2: tl.constexpr, HAS_PV: tl.constexpr,
    V_PLANES: tl.constexpr = False,
):
    """``o = acc / ℓ`` (0 for a row that saw no key), then ``P_v o`` (``[BLOCK_M, d]``) when ``HAS_PV``, else
    the latent ``o`` (``[BLOCK_M, r_v]``); stored at ``O_rows`` (one pointer per row) in its dtype."""
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    offs_rv = _channels(R_V_P2, V_PLANES)  # the accumulator's columns (int2 planes: permuted)
    if HAS_PV:
        offs_d = tl.arange(0, HEAD_DIM)
        pvt_ptrs = PV + offs_rv[:, None] * stride_pvr + offs_d[None, :] * stride_pvd
        pvt = tl.load(pvt_ptrs, mask=(offs_rv < R_V)[:, None], other=0.0).to(tl.float32)  # P_vᵀ [R_V_P2, d]
        o = tl.dot(o, pvt, input_precision="ieee")
        o_ptrs = O_rows[:, None] + offs_d[None, :] * stride_od
        tl.store(o_ptrs, o.to(O_rows.dtype.element_ty), mask=row_ok[:, None])
    else:
        o_ptrs = O_rows[:, None] + offs_rv[None, :] * stride_od
        tl.store(o_ptrs, o.to(O_rows.dtype.element_ty), mask=row_ok[:, None] & (offs_rv < R_V)[None, :])


@triton.jit
def _merge_splits(PART_O, PART_ML, first_row, n_splits, rows_pad, n_l,
                  R_V_P2: tl.constexpr, BLOCK_M: tl.constexpr):
    """Merge the ``S`` partial softmaxes of one (batch row, KV head, query tile) whose split 0 starts at
    row ``first_row`` (``[BLOCK_M]``): ``M = max_s m_s``, ``ℓ = Σ_s 2^(m_s−M) ℓ_s``,
    ``acc = Σ_s 2^(m_s−M) acc_s``.
    The loads bypass L1 (``.cg``): the rows were written by other programs. ``MERGE_UNROLL`` splits per
    iteration keep that many loads in flight: the merge sits on the critical path of the last program (8 %
    of ``pre_rope`` decode at 1×32k, 33 splits, on the H200: docs/notes/kernel-tries.md)."""
    offs_rv = tl.arange(0, R_V_P2)
    acc = tl.zeros([BLOCK_M, R_V_P2], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    for first_split in range(0, n_splits, MERGE_UNROLL):
        for u in tl.static_range(MERGE_UNROLL):
            part_row = first_row + (first_split + u) * rows_pad
            ok = (part_row - first_row) < n_splits * rows_pad  # past the last split: m = −1e30, ℓ = acc = 0
            m_s = tl.load(PART_ML + part_row, mask=ok, other=-1.0e30, cache_modifier=".cg")
            l_s = tl.load(PART_ML + n_l + part_row, mask=ok, other=0.0, cache_modifier=".cg")
            acc_s = tl.load(PART_O + part_row[:, None] * R_V_P2 + offs_rv[None, :], mask=ok[:, None],
                            other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_i, m_s)
            alpha = tl.exp2(m_i - m_new)
            beta = tl.exp2(m_s - m_new)
            acc = acc * alpha[:, None] + acc_s * beta[:, None]
            l_i = l_i * alpha + l_s * beta
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _prior_state(PRIOR_O, PRIOR_LSE, b, heads, q_idx, rows, stride_ob, stride_oh, stride_on, stride_od,
                 stride_prb, stride_prh, stride_prn, acc, l_i, m_i, R_V: tl.constexpr, R_V_P2: tl.constexpr,
                 V_PLANES: tl.constexpr = False):
    """The softmax state of a finished attention over other keys (its normalised latent output and natural
    log-sum-exp, per query row; only ``rows``): ``m = lse·log2(e)``, ``ℓ = 1``, ``acc = o``; rows where it
    saw no key (``lse = −inf``) keep the empty state."""
    lse_rows = PRIOR_LSE + b * stride_prb + heads.to(tl.int64) * stride_prh + q_idx.to(tl.int64) * stride_prn
    lse = tl.load(lse_rows, mask=rows, other=float("-inf"))
    seen = lse > float("-inf")
    offs_rv = _channels(R_V_P2, V_PLANES)  # the accumulator's column order
    o_rows = PRIOR_O + b * stride_ob + heads.to(tl.int64) * stride_oh + q_idx.to(tl.int64) * stride_on
    o = tl.load(o_rows[:, None] + offs_rv[None, :] * stride_od, mask=seen[:, None] & (offs_rv < R_V)[None, :],
                other=0.0).to(tl.float32)
    return tl.where(seen[:, None], o, acc), tl.where(seen, 1.0, l_i), tl.where(seen, lse * _LOG2E, m_i)


@triton.jit
def _store_lse(LSE_rows, m_i, l_i, row_ok):
    """Each row's log-sum-exp of its scaled logits (natural log; ``m`` and ``ℓ`` are in base 2), −inf for a
    row that saw no key: what a caller needs to merge this attention with another over other keys."""
    lse = tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * _LN2, float("-inf"))
    tl.store(LSE_rows, lse, mask=row_ok)


# ----------------------------------------------------------------------------------------------- kernels
@triton.jit
def _lowrank_attn_fwd(
    Q, ZK, ZV, PK, PV, POS, INV_FREQ, BIAS, LENS, NVALID, OUT, PART_O, PART_ML, LOCKS, SK, LK, SV, LV, LSE,
    PRIOR_O, PRIOR_LSE,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_kb, stride_kg, stride_kn, stride_kr,
    stride_vb, stride_vg, stride_vn, stride_vr,
    stride_skb, stride_skg, stride_skn, stride_skgr,
    stride_svb, stride_svg, stride_svn, stride_svgr,
    stride_pkg, stride_pkd, stride_pkr,
    stride_pvg, stride_pvd, stride_pvr,
    stride_posb, stride_posg, stride_posn,
    stride_bb, stride_bg, stride_bn,
    stride_ob, stride_oh, stride_on, stride_od,
    stride_lb, stride_lh, stride_ln,
    stride_prb, stride_prh, stride_prn,
    n_q, n_k, n_kv_heads, rows_pad, qk_scale, rope_scaling,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    R_K: tl.constexpr, R_V: tl.constexpr, R_K_P2: tl.constexpr, R_V_P2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KEY_MODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LENS: tl.constexpr,
    HAS_NVALID: tl.constexpr, HAS_PV: tl.constexpr, SPLIT: tl.constexpr, FAST_SINCOS: tl.constexpr,
    DOT_PREC: tl.constexpr, UPCAST: tl.constexpr, K_BITS: tl.constexpr, V_BITS: tl.constexpr,
    DTYPE: tl.constexpr, FOLD_K: tl.constexpr, FOLD_V: tl.constexpr, PREFETCH: tl.constexpr,
    HAS_LSE: tl.constexpr, K_CH: tl.constexpr, V_CH: tl.constexpr, NIB_K: tl.constexpr, NIB_V: tl.constexpr,
    FOLD_NIB: tl.constexpr, K_LOG8: tl.constexpr, V_LOG8: tl.constexpr, KEYS_LEFT: tl.constexpr,
    K_UNIT: tl.constexpr = 1, V_UNIT: tl.constexpr = 1, HAS_PRIOR: tl.constexpr = False,
    LATE_V: tl.constexpr = False, K_PLANES: tl.constexpr = False, V_PLANES: tl.constexpr = False,
    K_NIBW: tl.constexpr = False, V_NIBW: tl.constexpr = False, AHEAD: tl.constexpr = False,
):
    """One program: query tile ``pid_m`` (rows ``i·GROUP + s``) of batch row ``b`` and KV head ``g``, over
    key split ``pid_s`` of that row's visible keys. ``qk_scale = scale·log2(e)``. With ``SPLIT`` it writes the
    unnormalised ``acc``, ``m`` and ``ℓ`` to ``PART_O [B·G, S, rows_pad, R_V_P2]`` and
    ``PART_ML [2, B·G, S, rows_pad]`` (contiguous, fp32) and takes a ticket from ``LOCKS [B·G, m_blocks]``
    (int32, zeroed); the last of the ``S`` programs of a tile merges them (:func:`_merge_splits`) and writes
    ``OUT``, which saves the second launch that a separate merge kernel costs on the host. Without ``SPLIT``
    the epilogue writes ``OUT`` directly. With ``HAS_NVALID`` the cache's key count is read from ``NVALID``
    (device memory: a static cache's filled slots, which a captured graph cannot pass by value); the key
    tensors are larger and their slots from it on are never read. ``K_BITS``/``V_BITS`` 8 or 4: ``ZK``/``ZV``
    hold codes (uint8) with their scales and lows at ``SK``, ``LK`` / ``SV``, ``LV`` ``[B, G, N, groups]``,
    dequantized in registers; 16: float latents. ``DTYPE``: the latents' dtype (fp16 for key codes),
    in which the tiles meet the tensor cores. ``stride_kn``/``stride_vn`` arrive divided by
    ``K_UNIT``/``V_UNIT`` (:func:`_row_unit`: 2-8 for token strides not a multiple of 16): multiplied back
    here, the compiler knows each row's alignment and loads words or vectors instead of single elements
    (a stride is specialised only when divisible by 16; 56 int4 channels are 28 bytes a token).
    ``HAS_PRIOR``: the softmax starts from an attention over other keys, its latent output at ``PRIOR_O``
    (laid out as ``OUT``) and log-sum-exp at ``PRIOR_LSE``: ``m = lse·log2(e)``, ``ℓ = 1``, ``acc = o``
    (``ℓ = 0`` where that saw no key), in the first split only, so the result is attention over both sets
    (the merge of two calls, without its kernels)."""
    stride_kn = stride_kn * K_UNIT
    stride_vn = stride_vn * V_UNIT
    tl.static_assert(HEAD_DIM % 32 == 0, "head dim must be a multiple of 32 (tl.dot on its halves)")
    tl.static_assert(BLOCK_M >= 16 and BLOCK_N >= 16 and R_K_P2 >= 16 and R_V_P2 >= 16)
    HALF: tl.constexpr = HEAD_DIM // 2
    K_STEP: tl.constexpr = 2 if K_BITS == 8 else 1  # NIB_K: int8 channel pairs, or int4 even and odd
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1).to(tl.int64)
    pid_s = tl.program_id(2)
    n_splits = tl.num_programs(2)
    b = pid_bg // n_kv_heads
    g = pid_bg % n_kv_heads
    offs_m, q_idx, head, row_ok = _query_rows(pid_m, n_q, GROUP, BLOCK_M)
    if HAS_NVALID:
        n_k = tl.load(NVALID).to(tl.int32)

    # Visible keys: [kv_lo, kv_hi) for the tile; [kv_lo, full_hi) is seen by every row of it.
    kv_lo = 0
    if HAS_LENS:
        kv_lo = tl.maximum(n_k - tl.load(LENS + b), 0)
    kv_hi = n_k
    full_hi = n_k
    if CAUSAL:
        last_q = (tl.minimum((pid_m + 1) * BLOCK_M, n_q * GROUP) - 1) // GROUP
        kv_hi = tl.minimum(n_k, n_k - n_q + last_q + 1)
        full_hi = n_k - n_q + (pid_m * BLOCK_M) // GROUP + 1
    per_split = tl.cdiv(tl.cdiv(tl.maximum(kv_hi - kv_lo, 0), n_splits), BLOCK_N) * BLOCK_N
    lo = kv_lo + pid_s * per_split
    hi = tl.minimum(kv_hi, lo + per_split)
    mid = lo + tl.maximum(tl.minimum(hi, full_hi) - lo, 0) // BLOCK_N * BLOCK_N

    # Queries, scaled by scale·log2(e) once: pre_rope keeps both halves of q; post_rope projects q' = P_kᵀ q.
    Q_rows = Q + b * stride_qb + (g * GROUP + head).to(tl.int64) * stride_qh + q_idx.to(tl.int64) * stride_qn
    offs_rk = _channels(R_K_P2, K_PLANES)  # the key tiles' column order (int2 planes)
    PK_g = PK + g * stride_pkg
    inv_freq = tl.zeros([HALF], dtype=tl.float32)
    q1sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    if KEY_MODE == 0:
        offs_h = tl.arange(0, HALF)
        q1 = tl.load(Q_rows[:, None] + offs_h[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        q2 = tl.load(Q_rows[:, None] + (offs_h + HALF)[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        # The rope attention scaling multiplies the rotated key; it goes on the query instead, once.
        q1 = (q1.to(tl.float32) * (qk_scale * rope_scaling)).to(DTYPE)
        q2 = (q2.to(tl.float32) * (qk_scale * rope_scaling)).to(DTYPE)
        # P1ᵀ, P2ᵀ [R_K_P2, d/2]: rows d/2 of P_k each, transposed by the pointer arithmetic; with NIB_K their
        # even channels ([R_K_P2 / 2, d/2]) and, in p1t_o, p2t_o, their odd ones.
        if NIB_K:  # the halves of _decode_halves: channels e and e + K_STEP
            offs_e = _half_channels(R_K_P2, K_STEP)
            p1t_ptrs = PK_g + offs_e[:, None] * stride_pkr + offs_h[None, :] * stride_pkd
            p1t = tl.load(p1t_ptrs, mask=(offs_e < R_K)[:, None], other=0.0).to(DTYPE)
            p2t = tl.load(p1t_ptrs + HALF * stride_pkd, mask=(offs_e < R_K)[:, None], other=0.0).to(DTYPE)
            p1t_o = tl.load(p1t_ptrs + K_STEP * stride_pkr, mask=(offs_e + K_STEP < R_K)[:, None],
                            other=0.0).to(DTYPE)
            p2t_o = tl.load(p1t_ptrs + K_STEP * stride_pkr + HALF * stride_pkd,
                            mask=(offs_e + K_STEP < R_K)[:, None], other=0.0).to(DTYPE)
        else:
            p1t_ptrs = PK_g + offs_rk[:, None] * stride_pkr + offs_h[None, :] * stride_pkd
            p1t = tl.load(p1t_ptrs, mask=(offs_rk < R_K)[:, None], other=0.0).to(DTYPE)
            p2t = tl.load(p1t_ptrs + HALF * stride_pkd, mask=(offs_rk < R_K)[:, None], other=0.0).to(DTYPE)
            p1t_o = p1t
            p2t_o = p2t
        inv_freq = tl.load(INV_FREQ + offs_h)
    elif NIB_K:  # post_rope over key codes met as two channel halves (_decode_halves): q1, q2 = q' there
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        offs_e = _half_channels(R_K_P2, K_STEP)
        pk_ptrs = PK_g + offs_d[:, None] * stride_pkd + offs_e[None, :] * stride_pkr
        pk = tl.load(pk_ptrs, mask=(offs_e < R_K)[None, :], other=0.0).to(DTYPE)  # [d, R_K_P2 / 2]
        pk_o = tl.load(pk_ptrs + K_STEP * stride_pkr, mask=(offs_e + K_STEP < R_K)[None, :],
                       other=0.0).to(DTYPE)
        zero = tl.zeros([BLOCK_M, R_K_P2 // 2], dtype=tl.float32)
        q1 = (_dot(q.to(DTYPE), pk, zero, DOT_PREC, UPCAST) * qk_scale).to(DTYPE)
        q2 = (_dot(q.to(DTYPE), pk_o, zero, DOT_PREC, UPCAST) * qk_scale).to(DTYPE)
        q1sum = tl.sum(q1.to(tl.float32), 1) + tl.sum(q2.to(tl.float32), 1)  # Σ q' (FOLD_NIB)
        p1t = pk
        p2t = pk
        p1t_o = pk
        p2t_o = pk
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0)
        pk_ptrs = PK_g + offs_d[:, None] * stride_pkd + offs_rk[None, :] * stride_pkr
        # q' = P_kᵀ q in the latents' dtype on the tensor cores (exact fp32 for fp32 latents): q' is rounded
        # to that dtype anyway, and an fp32 [d, r] operand spilled registers (benchmarks/kernel_sass.py).
        pk = tl.load(pk_ptrs, mask=(offs_rk < R_K)[None, :], other=0.0).to(DTYPE)  # [d, R_K_P2]
        q1 = _dot(q.to(DTYPE), pk, tl.zeros([BLOCK_M, R_K_P2], dtype=tl.float32), DOT_PREC, UPCAST)
        q1 = (q1 * qk_scale).to(DTYPE)
        q1sum = tl.sum(q1.to(tl.float32), 1)  # Σ q' per row, for the folded lows (FOLD_K)
        q2 = q1
        p1t = pk
        p2t = pk
        p1t_o = pk
        p2t_o = pk

    ZK_bg = ZK + b * stride_kb + g * stride_kg
    ZV_bg = ZV + b * stride_vb + g * stride_vg
    POS_b = POS + b * stride_posb + g * stride_posg
    BIAS_bg = BIAS + b * stride_bb + g * stride_bg
    SK_bg, LK_bg = SK + b * stride_skb + g * stride_skg, LK + b * stride_skb + g * stride_skg
    SV_bg, LV_bg = SV + b * stride_svb + g * stride_svg, LV + b * stride_svb + g * stride_svg
    acc = tl.zeros([BLOCK_M, R_V_P2], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile gives p = 0, not NaN
    if HAS_PRIOR:
        first = (q_idx * 0 + pid_s) == 0  # the first split only ([BLOCK_M]: the interpreter masks by tensors)
        acc, l_i, m_i = _prior_state(PRIOR_O, PRIOR_LSE, b, g * GROUP + head, q_idx, row_ok & first,
                                     stride_ob, stride_oh, stride_on, stride_od, stride_prb, stride_prh,
                                     stride_prn, acc, l_i, m_i, R_V, R_V_P2, V_PLANES)
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q1, q2, p1t, p2t, p1t_o, p2t_o, inv_freq, _LOG2E, lo, mid, q_idx, n_q, n_k,
        ZK_bg, ZV_bg, POS_b, BIAS_bg, SK_bg, LK_bg, SV_bg, LV_bg,
        stride_kn, stride_kr, stride_vn, stride_vr, stride_posn, stride_bn,
        stride_skn, stride_skgr, stride_svn, stride_svgr,
        HEAD_DIM, R_K, R_V, R_K_P2, R_V_P2, BLOCK_M, BLOCK_N, KEY_MODE, CAUSAL, HAS_BIAS, False, FAST_SINCOS,
        DOT_PREC, UPCAST, K_BITS, V_BITS, DTYPE, q1sum, FOLD_K, FOLD_V, PREFETCH, K_CH, V_CH, NIB_K, NIB_V,
        FOLD_NIB, K_LOG8, V_LOG8, KEYS_LEFT, LATE_V, K_PLANES, V_PLANES, K_NIBW, V_NIBW, AHEAD,
    )
    acc, l_i, m_i = _attend_range(
        acc, l_i, m_i, q1, q2, p1t, p2t, p1t_o, p2t_o, inv_freq, _LOG2E, mid, hi, q_idx, n_q, n_k,
        ZK_bg, ZV_bg, POS_b, BIAS_bg, SK_bg, LK_bg, SV_bg, LV_bg,
        stride_kn, stride_kr, stride_vn, stride_vr, stride_posn, stride_bn,
        stride_skn, stride_skgr, stride_svn, stride_svgr,
        HEAD_DIM, R_K, R_V, R_K_P2, R_V_P2, BLOCK_M, BLOCK_N, KEY_MODE, CAUSAL, HAS_BIAS, True, FAST_SINCOS,
        DOT_PREC, UPCAST, K_BITS, V_BITS, DTYPE, q1sum, FOLD_K, FOLD_V, PREFETCH, K_CH, V_CH, NIB_K, NIB_V,
        FOLD_NIB, K_LOG8, V_LOG8, KEYS_LEFT, LATE_V, K_PLANES, V_PLANES, K_NIBW, V_NIBW, AHEAD,
    )

    O_rows = OUT + b * stride_ob + (g * GROUP + head).to(tl.int64) * stride_oh \
        + q_idx.to(tl.int64) * stride_on
    LSE_rows = LSE + b * stride_lb + (g * GROUP + head).to(tl.int64) * stride_lh \
        + q_idx.to(tl.int64) * stride_ln
    if SPLIT:
        part_row = (pid_bg * n_splits + pid_s) * rows_pad + offs_m  # int64
        offs_rv = tl.arange(0, R_V_P2)
        n_l = tl.num_programs(1) * n_splits * rows_pad  # offset of the ℓ block in PART_ML
        tl.store(PART_O + part_row[:, None] * R_V_P2 + offs_rv[None, :], acc)
        tl.store(PART_ML + part_row, m_i)
        tl.store(PART_ML + n_l + part_row, l_i)
        # Every thread's stores come before the ticket, whose release makes them visible to the GPU
        # (the pattern of a grid-wide barrier); the last program's acquire then sees all the splits.
        tl.debug_barrier()
        ticket = tl.atomic_add(LOCKS + pid_bg * tl.num_programs(0) + pid_m, 1, sem="acq_rel")
        if ticket == n_splits - 1:
            acc, l_i, m_i = _merge_splits(PART_O, PART_ML, pid_bg * n_splits * rows_pad + offs_m, n_splits,
                                          rows_pad, n_l, R_V_P2, BLOCK_M)
            _epilogue_store(acc, l_i, PV + g * stride_pvg, O_rows, row_ok, stride_pvd, stride_pvr, stride_od,
                            HEAD_DIM, R_V, R_V_P2, HAS_PV, V_PLANES)
            if HAS_LSE:
                _store_lse(LSE_rows, m_i, l_i, row_ok)
    else:
        _epilogue_store(acc, l_i, PV + g * stride_pvg, O_rows, row_ok, stride_pvd, stride_pvr, stride_od,
                        HEAD_DIM, R_V, R_V_P2, HAS_PV, V_PLANES)
        if HAS_LSE:
            _store_lse(LSE_rows, m_i, l_i, row_ok)


# ----------------------------------------------------------------------------------------- host launcher
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # the interpreter on the CPU: pretend to be an H200 so the heuristics stay the same


def _decode_splits(programs: int, n_k: int, n_sms: int, per_sm: int = 1, resident: int = 2) -> int:
    """Key splits per decode program (at ≥ 256 keys a split). Below one program per SM: ``resident``
    programs per SM (two unless :func:`_resident_programs` counts more for a latency-bound kernel), rounded
    down (33, 4, 2, 8 splits at the four benchmark shapes; 9 instead of 8 at 4×128k took 0.42
    against 0.27 ms on the H200). Between one and two per SM, where that rule gives 1: the count of 1-4
    that fills its last round of ``n_sms`` programs best, ties to the fewest. 176 programs (22 rows × 8
    heads) ran as one round and a third, so the SMs with two programs set the time; 3 splits make four
    full rounds. From two programs an SM on, 1, except for a kernel that runs ``per_sm`` = 2 programs an
    SM at once (decode over codes: 4 warps at up to 255 registers a thread): there the count of 1-6 that
    fills its last round of ``2·n_sms`` best. 38 rows × 8 heads (304 programs, the 12.5 % cache's capacity
    at 32k under 40 GiB) ran in two rounds, the second a seventh full: 0.703 ms with 1 split, 0.562 with 4
    (H200, r 56, int4 ``post_rope``, 2026-12-03); at 47 rows 2 splits, 0.700 → 0.667 ms. The other loops
    over codes, at 32k keys (H100, 2026-12-05, seventh session, ``split_probe.py``; ms with 1, 2, 3, 4
    splits): int4 r 56 ``pre_rope`` at 38 rows 2.030, 1.606, 1.486, 1.415 and at 45 rows 2.041, 1.686,
    1.784, 1.673; int2 channel keys at r 112 and 43 rows, ``pre_rope`` 3.546, 2.535, 2.268, 2.542 and
    ``post_rope`` 1.479, 1.405, 1.248, 1.302. The rule picked 4, 2 and 3 from 1-4: the fastest, or within 1 %.
    With 5 and 6 (H100, eighth session, same probe): at 45 rows 2.039, 1.677, 1.788, 1.674, 1.584, 1.667 and
    at 38 rows 2.018, 1.660, 1.491, 1.404, 1.356, 1.334, each the order of the last round's fill; the rule
    picks 5 and 6, the fastest. (3 stays the pick at 43 rows: 6 fills as well, and ties go to fewer.)"""
    most = max(1, triton.cdiv(n_k, 256))

    def filled(s: int, round_: int) -> float:
        return programs * s / (triton.cdiv(programs * s, round_) * round_)

    if programs >= 2 * n_sms:
        if per_sm < 2:
            return 1
        return max(range(1, min(6, most) + 1), key=lambda s: (filled(s, 2 * n_sms), -s))
    if programs <= n_sms:
        return max(1, min(resident * n_sms // programs, most))
    return max(range(1, min(4, most) + 1), key=lambda s: (filled(s, n_sms), -s))


# decode kernels counted to fit more than two programs an SM take at most this many (see _occupancy_splits)
MAX_RESIDENT = 4
# ... and no more splits than leave this many keys each (the rule's own count stays where it is smaller)
OCCUPANCY_MIN_KEYS = 1024
# _fit_key(...) of a decode config (its splits left out) -> programs an SM holds, or None where not counted
_RESIDENT: dict[tuple, int | None] = {}


def _layout(z) -> tuple[int, bool]:
    """What else of a latent picks the kernel's loops, beside :func:`_fit_key`'s: its rows' unit stride and
    whether they read as words, from strides and alignment."""
    t = z.codes if isinstance(z, QuantizedLatents) else z
    return _row_unit(t), _word_rows(t)


def _resident_programs(kernel, device: torch.device) -> int | None:
    """Programs of the compiled ``kernel`` one SM holds at once: the fewest its registers (allocated 256 a
    warp at a time), its shared memory (plus the 1 KB a block the driver reserves) and its threads allow.
    None where this Triton does not report them, or where the kernel does not fit the GPU (the launch then
    says so)."""
    from triton.runtime.errors import OutOfResources

    try:
        kernel.run  # loads the binary, which is when Triton reads its register count
        regs, warps, shared = int(kernel.n_regs), int(kernel.metadata.num_warps), int(kernel.metadata.shared)
    except (AttributeError, TypeError, OutOfResources):
        return None
    props = torch.cuda.get_device_properties(device)
    per_warp = triton.cdiv(max(regs, 1) * 32, 256) * 256
    by_regs = getattr(props, "regs_per_multiprocessor", 65536) // (per_warp * warps)
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 233472) // (shared + 1024)
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // (32 * warps)
    return max(1, min(by_regs, by_shared, by_threads))


def _occupancy_splits(args: tuple, cfg: dict, return_lse: bool, prior, n_sms: int) -> int:
    """Key splits of a decode launch below one program an SM, from the programs its compiled kernel fits an
    SM (counted once a kernel, :data:`_RESIDENT`). The rule of :func:`_decode_splits` assumes two, which is
    what the ``pre_rope`` and code kernels fit at Llama-3-8B's head shapes (d 128, r 64, triton 3.6: 175-255
    registers a thread). At SmolLM2's (d 64, GQA 3, r 32) they fit three (~167 registers), and 32×8192
    (96 programs) took 4 splits instead of 2: ``pre_rope`` bf16 65.0 → 51.9 µs, int4 keys 90.6 → 60.9, int2
    ``post_rope`` 50.4 → 35.0 (H100, 2026-12-06, fourth session, the rule's count and the launched one in
    the same run at ``8d38f2e``; bf16 ``post_rope``, memory-bound, not faster past 2, so it keeps the
    rule). At Llama-3-8B's shapes only int2 and int3 ``post_rope`` codes at
    r 32 fit three; against the rule's count in the same run, µs: 8×8k 28.6 → 27.3 and 37.0 → 34.5, 16×16k
    93.0 → 83.1 and 127.3 → 110.6, 4×128k 178.4 → 160.5 and 243.3 → 215.3, but 1×32k (8 programs: 49
    splits of 668 keys against 33) 21.7 → 23.3 and 26.0 → 27.6; so the count never leaves a split fewer
    than :data:`OCCUPANCY_MIN_KEYS` keys beyond the rule's own. Capped at :data:`MAX_RESIDENT`. Only
    ``pre_rope`` and code kernels come here (:func:`lowrank_attention`)."""
    q, z_k = args[0], args[1]
    programs = q.shape[0] * z_k.shape[1]
    key = (*_fit_key(args, dict(cfg, num_splits=0), return_lse, prior), _layout(z_k), _layout(args[2]))
    if key not in _RESIDENT:
        kernel = _launch(*args, dict(cfg, num_splits=max(2, cfg["num_splits"])), return_lse, prior,
                         compile_only=True)
        _RESIDENT[key] = _resident_programs(kernel, q.device)
    resident = _RESIDENT[key]
    if resident is None or resident <= 2:
        return cfg["num_splits"]
    codes = isinstance(z_k, QuantizedLatents) or isinstance(args[2], QuantizedLatents)
    more = _decode_splits(programs, z_k.shape[2], n_sms, 2 if codes else 1, min(resident, MAX_RESIDENT))
    return max(cfg["num_splits"], min(more, z_k.shape[2] // OCCUPANCY_MIN_KEYS))


def _default_config(n_rows: int, n_k: int, key_mode: str, programs: int, n_sms: int, r_k: int = 64,
                    codes: bool = False, k_bits: int = 16, nibbles_kv: bool = False, k_channel: bool = False,
                    left_padded: bool = False, int2_kv: bool = False, head_dim: int = 128) -> dict:
    """Tile sizes, warps and splits. Decode (one query's GQA group fits a 16-row tile) streams the cache
    and splits each row's keys so that ``programs × splits`` stays at or just under two programs per SM, at
    ≥ 256 keys a split. Rounding down matters: on the H200 sweep of ``benchmarks/bench_attention.py``,
    4×128k at 50 % took 0.27 ms with 8 splits (256 programs) and 0.42 ms with 9 (288 programs: some SMs
    run a third program, a second partial wave), and this rule picked the fastest measured split count
    at all four benchmark shapes at 50 %, for both key modes. Key tiles of 128 at ranks ≤ 32: the fastest
    tile at all four shapes at 25 % in both key modes in the H200 sweep of 2026-11-30 (8-24 % faster
    than 64), while 64 stays within 3 % of the best at 50 %. Decode over codes (``codes``) reads tiles of 128
    keys one iteration ahead (``prefetch``): the fastest of the sweep at all four shapes, both key modes,
    int8 and int4, on the H200 (2026-12-01; 0.38 against 0.47 ms for int4 ``post_rope`` at 4×128k), while
    over bf16 latents prefetching was 5-20 % slower (it bypasses the pipeliner's asynchronous copies).
    Packed int4 codes are met as even and odd channels (``nibbles``): with prefetch the fastest of the sweep
    in all four int4 rows (1×32k and 4×128k, both key modes; ``post_rope`` 4×128k 0.357 → 0.286 ms, H200,
    2026-12-02); so are ``pre_rope`` int4 keys (``nibble_rebuild``: 0.561 → 0.544 ms at 4×128k, 0.0499 →
    0.0491 at 1×32k) and, for ``post_rope`` int4 keys in one scale group, the scales applied to the logits
    (``nibble_fold``: 0.286 → 0.271 ms, 0.0321 → 0.0318), each the best of its sweep row (H200, 2026-12-02,
    second session). ``pre_rope`` logits as ``(k qᵀ)ᵀ`` (``keys_left``) over bf16 latents and int4 key codes:
    0.519 → 0.508 ms (bf16) and 0.544 → 0.529 (int4) at 4×128k, 0.268 → 0.261 and 0.279 → 0.271 at
    16×16k; over int8 keys it lost (0.547 → 0.576, 0.282 → 0.296), so not there (H200, 2026-12-02, third
    session). ``post_rope`` decode over int4 keys and values in the token layout at padded ranks ≤ 64
    (``nibbles_kv``) takes tiles of 256 keys: a quarter of bf16's bytes a key, so as many bytes a tile as
    bf16's 64; 0.270 → 0.2245 ms at 4×128k and 0.142 → 0.1195 at 16×16k, r 64 (H200, 2026-12-03). Not
    ``pre_rope``: its rebuilt keys spill at 256 (0.530 → 1.197 ms); nor int8 (0.264 → 0.280 ms at 4×128k).
    Those wide tiles do not prefetch (the pipeliner's copies instead, and so no ``nibble_fold``): r 56 at
    4×128k 0.2325 → 0.1833 ms, 16×16k 0.1232 → 0.1002, 29×32k 0.4454 → 0.3475, 43×32k 0.5966 → 0.4815 at
    the same splits, the fastest of each shape's sweep (H200, 2026-12-03, twelfth session). int8 codes in
    the token layout are read as words and met as channel pairs (``pairs``): at r 128, 8×16k and 4×128k,
    ``post_rope`` 0.179 → 0.153 and 0.615 → 0.500 ms, the fastest of the sweep with min–max and with log8
    scales alike (H100, 2026-12-05, sixth session; r 64 −7 % and −3 % the session before). ``pre_rope`` over
    int8 keys wider than 64 channels takes 64-key tiles: the rebuilt 128-key tile spills; at r 128 the
    bytes' loop 0.322 → 0.244 and 1.149 → 0.907 ms, and with ``pairs`` 0.219 and 0.818 (same run).
    int2 codes are read as words and met as bit planes (``planes``), and channel-layout scales as a row a
    token group (``channel_rows``): int2 r 64 token layout, 8×16k and 4×128k, ``post_rope`` 0.106 → 0.076
    and 0.384 → 0.274 ms, ``pre_rope`` 0.172 → 0.150 and 0.640 → 0.564; int2 channel-layout keys at r 112
    ``post_rope`` 0.221 → 0.140 and 0.799 → 0.474; int4 channel-layout keys ``post_rope`` 0.192 → 0.164
    and 0.692 → 0.559 (per-element scales at 64-key tiles, their best, against rows at 128); end to
    end, the ``a125`` per-layer checkpoint 434 → 514 tok/s at 8×16k (H100, 2026-12-05, seventh session).
    ``pre_rope`` over wider keys than 64 channels in int2 or in the channel layout takes 64-key tiles, as
    int8 does: at r 112, 8×16k and 4×128k, int2
    channel keys with planes 0.356 → 0.242 and 1.301 → 0.860 ms, int4 channel keys with rows 0.327 →
    0.228 and 1.198 → 0.823. So do channel-layout keys of either mode under ``lengths`` (scales per element,
    not rows): int4 r 112 ``post_rope`` 0.646 → 0.192 ms at 8×16k, 2.358 → 0.692 at 4×128k. int3 keys
    wider than 64 channels join that rule in ``pre_rope`` (their 128-key tile keeps 288 bytes on the stack,
    triton 3.6, sm_90): token layout at r 128 with ``int3_planes``, 0.459 → 0.331 ms at 8×16k and 1.707 →
    1.214 at 4×128k. Channel-layout int3 ``pre_rope`` keys are met as planes (``int3_planes``): 0.381 →
    0.366 and 1.417 → 1.355 ms; not ``post_rope``'s (0.251 → 0.281 at 128 keys) (H100, 2026-12-06).
    ``pre_rope`` rounds its angles' whole turns on the FMA pipe (``sincos_fadd``) but over int3 keys: at the
    four shapes, r 64, 1.0-8.0 % less time over bf16, int8, int4 and int2 latents (4×128k bf16 0.5058 →
    0.4651 ms), at r 32 0.7-15.1 % (bf16 0.4091 → 0.3473), int4 channel keys at r 112 1.5-2.9 %, int4 r 56
    at 45×32k 3.4 %; over int3 keys 1.4 % less (1×32k) to 1.6 % more (channel keys at 4×128k), so not there
    (H100, 2026-12-06, third session). ``post_rope`` decode over int2 keys and values in the token layout at
    a padded rank of 64 (``int2_kv``, :func:`_token_int2`) runs 2 warps a program on 128-key tiles with
    twice the rule's splits (about four programs an SM instead of two): at r 64, SmolLM2's heads 32×8k
    75.2 → 55.6 µs, Llama-3.2-1B's 8×16k 74.2 → 61.7, Llama-3-8B's 16×16k 146.8 → 126.1 and 4×128k 284.6 →
    222.1 (H100, 2026-12-06, sixth session, the default and the candidate in the same runs; each with 2 to 8
    splits by the rule, so not where the rule gives 1, which was not measured). Not int4: 46.0
    against 50.0 µs at SmolLM2's shapes but 94.9 against 90.2 and 168.0 against 162.3 at Llama-3-8B's.
    ``pre_rope`` over bf16 latents at d 128 and r 64 forms its logits one tile ahead (``ahead``, with the
    logits dot as ``q kᵀ``) where a split holds ≥ :data:`AHEAD_KEYS` keys: 16×16k 0.2424 → 0.2239 ms, 4×128k
    0.4758 → 0.4258, 8×8k 0.0709 → 0.0708 (2048 keys a split), but 1×32k 0.0465 → 0.0504 (~1000 keys a
    split: the prologue's tile and the wasted look-ahead are 2 of 16) (H100, 2026-12-06, seventh session;
    with ``keys_left`` 0.2350 and 0.4537)."""
    if n_rows <= DECODE_BLOCK_M:
        wide = nibbles_kv and key_mode == "post_rope"
        splits = _decode_splits(programs, n_k, n_sms, 2 if codes else 1)
        block_n = 128 if r_k <= 32 or codes else 64
        wide_keys = padded_dim(r_k) > 64
        if codes and key_mode == "pre_rope" and wide_keys and (k_bits in (8, 3, 2) or k_channel):
            block_n = 64  # the rebuilt 128-key tile spills
        if codes and k_channel and left_padded and wide_keys:
            block_n = 64  # per-element scale loads at 128 keys spill
        if wide:
            block_n = WIDE_NIBBLE_TILE
        warps = 4
        if int2_kv and key_mode == "post_rope" and splits > 1:  # measured below a program an SM only
            block_n, warps, splits = 128, 2, 2 * splits
        # logits one tile ahead where measured to win: bf16 r 64 at d 128, 64-key tiles, ≥ 4096 keys a split
        # (a prologue tile and a wasted look-ahead a split cost 2 of ~16 tiles at 1×32k's 1000 keys a split)
        ahead = (key_mode == "pre_rope" and not codes and head_dim == 128 and block_n == 64
                 and padded_dim(r_k) == 64 and n_k >= AHEAD_KEYS * splits)
        return dict(block_m=DECODE_BLOCK_M, block_n=block_n, num_splits=splits, num_warps=warps, num_stages=3,
                    prefetch=codes and not wide, nibbles=codes, nibble_rebuild=codes, nibble_fold=codes,
                    keys_left=_keys_left(k_bits, r_k) and not ahead, ahead=ahead, pairs=codes,
                    channel_rows=codes, planes=codes,
                    nibble_words=False, sincos_fadd=k_bits != 3,
                    int3_planes=codes and key_mode == "pre_rope" and k_bits == 3 and k_channel)
    if key_mode == "post_rope":
        return dict(block_m=128, block_n=64, num_splits=1, num_warps=8, num_stages=2)
    return dict(block_m=128, block_n=32, num_splits=1, num_warps=8, num_stages=2)


def _keys_left(k_bits: int, r_k: int) -> bool:
    """``pre_rope`` logits as ``(k qᵀ)ᵀ`` over bf16 latents and over int4 keys at a power-of-two rank. At
    r 56 over int4 keys ``q kᵀ`` was the faster: 0.5615 → 0.4984 ms at 4×128k, 0.2880 → 0.2554 at 16×16k,
    1.531 → 1.405 at 45×32k (the 12.5 % capacity batch), while at r 64 it lost (0.5043 → 0.5210, 0.2598 →
    0.2687; H100, 2026-12-07, the candidates in the same runs)."""
    return k_bits == 16 or (k_bits == 4 and padded_dim(r_k) == r_k)


def _token_int4(z) -> bool:
    """Whether ``z`` holds int4 codes in the token layout at a padded rank of 32 to 64 (min–max scales): the
    latents ``nibbles_kv`` tiles were measured on, and the ranks the kernel meets as nibbles. Below 32 the
    codes are unpacked whole, and that loop at 256-key tiles without prefetch gave wrong logits on the H200
    (triton 3.6, 2026-12-03: r 11/13 and 16/16, errors 0.3 on outputs of 0.2-0.8, right with prefetch and
    under the interpreter), so those ranks keep the 128-key tile."""
    return (isinstance(z, QuantizedLatents) and z.bits == 4 and z.layout != "channel" and not z.log8
            and 32 <= padded_dim(z.shape[3]) <= 64)


def _token_int2(z) -> bool:
    """Whether ``z`` holds int2 codes in the token layout at a padded rank of 64 (min–max scales): the
    latents the 2-warp ``post_rope`` decode (``int2_kv`` of :func:`_default_config`) was measured on."""
    return (isinstance(z, QuantizedLatents) and z.bits == 2 and z.layout != "channel" and not z.log8
            and padded_dim(z.shape[3]) == 64)


def _word_rows(codes: torch.Tensor) -> bool:
    """Whether int8 codes ``[B, G, N, w]`` can be read as 32-bit words (``pairs``): contiguous channels, a
    stored width that is a multiple of 4 (the rank itself may not be: ``stiefkv.quant`` pads it), and every
    row starting 4-byte aligned."""
    return codes.shape[-1] % 4 == 0 and codes.stride(-1) == 1 and codes.data_ptr() % 4 == 0 \
        and all(st % 4 == 0 for st in codes.stride()[:-1])


def _pad_rank(z: torch.Tensor, P: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zero-pad latents ``[B, G, N, r]`` and their basis ``[G, d, r]`` to the kernel's power-of-two tile
    width, so that no tile load masks its columns. Prefill only: on the H200 (triton 3.6), 128-row prefill
    tiles with a column-masked latent load read shared memory out of bounds (compute-sanitizer: "Invalid
    __shared__ read of size 1024 bytes") or returned wrong values (r_k 24 or 56, or r_v 24, bf16/fp16,
    ``block_n`` 32 and 64, 2026-11-30), while every power-of-two rank and every 16-row decode tile was
    exact. Zero columns change no logit and no output; the copy is small beside the prefill's N² work."""
    pad = padded_dim(z.shape[-1]) - z.shape[-1]
    return F.pad(z, (0, pad)), (F.pad(P, (0, pad)) if P is not None else None)


def _pad_codes(z: QuantizedLatents, P: torch.Tensor | None) -> tuple[QuantizedLatents, torch.Tensor | None]:
    """:func:`_pad_rank` for codes: bytes up to the padded width (zero codes), scale and low groups up to
    the groups it spans (zeros: those channels read as 0; log8 code 0 reads as a small low); other padded
    channels read as their group's low, against zero rows of the basis."""
    width = padded_dim(z.rank)
    nbytes = width // 8 * z.bits  # eight codes in `bits` bytes (pack's words)
    groups = width if z.layout == "channel" else -(-width // _common.QUANT_GROUP)  # the scales' last axis
    codes = F.pad(z.codes[..., :nbytes], (0, max(0, nbytes - z.codes.shape[-1])))
    scale = F.pad(z.scale, (0, groups - z.scale.shape[-1]))
    low = F.pad(z.low, (0, groups - z.low.shape[-1])) if z.low is not None else None
    P = F.pad(P, (0, width - z.rank)) if P is not None else None
    return QuantizedLatents(codes, scale, low, z.bits, width, z.layout, z.log8), P


def _check_codes(z: QuantizedLatents, name: str, q: torch.Tensor) -> torch.Tensor:
    """Refuse codes the kernel cannot read; return a meta tensor of the latents' shape in the queries'
    dtype for the shared checks."""
    if z.bits not in KERNEL_BITS:
        raise ValueError(f"{name}: the kernel reads {' or '.join(map(str, KERNEL_BITS))}-bit codes, got "
                         f"{z.bits}; dequantize them (QuantizedLatents.dequantize) or use the reference")
    _common.check_codes(z, name)
    B, G, N, r = z.shape
    if z.codes.stride(3) != 1:
        raise ValueError(f"{name}.codes must be contiguous along a token's bytes")
    return torch.empty(B, G, N, r, device="meta", dtype=q.dtype)


def _check_inputs(q, z_k, z_v, P_k, P_v, key_mode, positions, rope, bias, lengths, n_valid=None,
                  prior=None) -> None:
    if key_mode not in KEY_MODES:
        raise ValueError(f"key_mode must be one of {KEY_MODES}, got {key_mode!r}")
    if q.dim() != 4 or z_k.dim() != 4 or z_v.dim() != 4:
        raise ValueError(f"q, z_k, z_v must be 4-D; got {tuple(q.shape)}, {tuple(z_k.shape)}, "
                         f"{tuple(z_v.shape)}")
    B, H, _, d = q.shape
    G, Nk, r_k = z_k.shape[1], z_k.shape[2], z_k.shape[3]
    r_v = z_v.shape[3]
    if H % G:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({G})")
    if H // G > DECODE_BLOCK_M:
        raise ValueError(f"GQA group of {H // G} query heads per KV head is larger than {DECODE_BLOCK_M}")
    if z_k.shape[0] != B or tuple(z_v.shape[:3]) != (B, G, Nk):
        raise ValueError(f"z_k {tuple(z_k.shape)} and z_v {tuple(z_v.shape)} must be [B={B}, G, Nk, r]")
    if tuple(P_k.shape) != (G, d, r_k):
        raise ValueError(f"P_k must be [G={G}, d={d}, r_k={r_k}], got {tuple(P_k.shape)}")
    if P_v is not None and tuple(P_v.shape) != (G, d, r_v):
        raise ValueError(f"P_v must be [G={G}, d={d}, r_v={r_v}], got {tuple(P_v.shape)}")
    if d % 32 or d & (d - 1):
        raise ValueError(f"the kernel needs a power-of-two head dim ≥ 32, got {d}; use the reference")
    if z_k.dtype not in (torch.bfloat16, torch.float16, torch.float32) or z_v.dtype != z_k.dtype:
        raise ValueError(f"latents must share one of bf16/fp16/fp32, got {z_k.dtype} and {z_v.dtype}")
    if key_mode == "pre_rope":
        if positions is None or rope is None:
            raise ValueError("key_mode='pre_rope' needs the key positions and the rope spec")
        if tuple(positions.shape) not in ((B, Nk), (B, G, Nk)):
            raise ValueError(f"positions must be [B={B}, Nk={Nk}] or per KV head [B={B}, G={G}, Nk={Nk}], "
                             f"got {tuple(positions.shape)}")
        if rope.inv_freq.numel() != d // 2:
            raise ValueError(f"rope.inv_freq must have d/2={d // 2} entries, got {rope.inv_freq.numel()}")
    if bias is not None and tuple(bias.shape) != (B, G, Nk):
        raise ValueError(f"bias must be [B={B}, G={G}, Nk={Nk}], got {tuple(bias.shape)}")
    if lengths is not None and tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths must be [B={B}], got {tuple(lengths.shape)}")
    if n_valid is not None and (n_valid.numel() != 1 or n_valid.dtype != torch.int32
                                or n_valid.device != q.device):
        raise ValueError(f"n_valid must be one int32 on the queries' device ({q.device}), got "
                         f"{tuple(n_valid.shape)} {n_valid.dtype} on {n_valid.device}")
    # Batch and head offsets are int64 in the kernels; offsets along the keys of one (row, head) are int32.
    if max(Nk * z_k.stride(2), Nk * z_v.stride(2), q.shape[2] * q.stride(2)) >= 2**31:
        raise ValueError("one (batch row, head) of the cache spans more than 2**31 elements; split the call")
    prior = tuple(prior) if isinstance(prior, (tuple, list)) else ()
    tensors = [t for t in (q, z_k, z_v, P_k, P_v, bias, *prior) if isinstance(t, torch.Tensor)]
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        raise RuntimeError("the Triton low-rank attention is inference-only (no backward); call it under "
                           "torch.no_grad() or through stiefkv.kernels.lowrank_attention, whose 'auto' "
                           "backend takes the reference where a gradient is needed")


def _refuse_prior(prior, q: torch.Tensor, r_v: int, P_v) -> None:
    """A ``prior`` continues an attention in the latent space: refused beside ``P_v`` or in another shape."""
    if P_v is not None:
        raise ValueError("prior= continues an attention in the latent space: pass P_v=None (and apply P_v "
                         "after, or fold it into o_proj), or call stiefkv.kernels.lowrank_attention, which "
                         "merges the two outputs")
    check_prior(prior, q, r_v)


def _check_prior(prior, q: torch.Tensor, r_v: int, width: int, P_v) -> tuple[torch.Tensor, torch.Tensor]:
    """``prior`` as the kernel reads it: a latent output ``[B, H, Nq, r_v]`` in the queries' dtype, padded
    with zeros to the value latents' ``width`` (a prefill pads odd ranks), and its log-sum-exp
    ``[B, H, Nq]`` float32, both contiguous."""
    _refuse_prior(prior, q, r_v, P_v)
    o, lse = prior
    o = o.to(q.dtype)
    if width > r_v:  # a pad of nothing would still copy: one kernel a layer in the split decode
        o = F.pad(o, (0, width - r_v))
    return o.contiguous(), lse.float().contiguous()


def _row_unit(z: torch.Tensor) -> int:
    """The largest power of two up to 8 that divides a token stride the compiler cannot specialise (not a
    multiple of 16), else 1: see ``K_UNIT`` in :func:`_lowrank_attn_fwd`."""
    step = z.stride(2)
    return math.gcd(step, 8) if step % 16 else 1


def _unit_strides(z: torch.Tensor, unit: int) -> tuple[int, ...]:
    b, g, n, r = z.stride()
    return b, g, n // unit, r


# Keys a prefill over codes dequantizes at a time (None or 0: the whole cache at once). The whole layer's
# bf16 copy was the 12.5 % cache's 3.65 GiB prefill transient at 38 rows × 32k; in slices of 4096 keys the
# same cache holds 43 rows under 40 GiB and decodes 4.04× the uncompressed model's tokens/s at its capacity
# (3.13× at 38 rows before; H200, docs/notes/serving.md, eleventh session).
PREFILL_CODE_SLICE: int | None = 4096
# The key modes whose prefill slices of keys that every query sees whole (no causal part, no padding, no
# bias) go through keys rebuilt once at full width and FlashAttention (:mod:`stiefkv.kernels.rebuilt`)
# instead of the low-rank prefill kernel, which rebuilds each key tile once per 128-row query tile. Timed on
# an H100 (2026-12-07, benchmarks/experiments/below_band.py, SmolLM2's heads, 32 rows x 128 queries behind
# 8000 keys, a layer): pre_rope wins (bf16 latents 1.423 -> 0.901 ms, int2 codes 1.620 -> 1.400), post_rope
# loses (bf16 0.302 -> 0.861, int2 1.045 -> 1.361: the kernel attends at the rank, FlashAttention at d).
PREFILL_REBUILT: tuple[str, ...] = ("pre_rope",)


def _slice_keys(z, a: int, c: int):
    """Keys ``[a, c)`` of latents ``[B, G, N, r]``, float or codes (``a`` a multiple of QUANT_GROUP for the
    channel layout, whose scales are per group of tokens)."""
    return z.tokens(a, c) if isinstance(z, QuantizedLatents) else z[:, :, a:c]


def _as_floats(z, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    """Latents ``z`` as floats in ``dtype``, zero-padded to ``width`` channels if given: codes dequantized
    in one Triton pass (``dequantize.py``; imported here because that module reads this one's log8
    decoder) straight to that width, float latents as they are."""
    if isinstance(z, QuantizedLatents):
        from stiefkv.kernels.dequantize import dequantize_latents

        return dequantize_latents(z, dtype, width)
    return z if width is None or width == z.shape[3] else F.pad(z, (0, width - z.shape[3]))


def _floats(z, P: torch.Tensor | None, dtype: torch.dtype):
    """``(latents, basis)`` for a prefill tile: float latents and their basis as they are (the call pads
    them, :func:`_pad_rank`), codes dequantized straight to the padded rank (:func:`_as_floats`), the basis
    padded to match (a separate pad of the dequantized copy cost a fill and a copy of it)."""
    if not isinstance(z, QuantizedLatents):
        return z, P
    width = padded_dim(z.rank)
    return _as_floats(z, dtype, width), (F.pad(P, (0, width - z.rank)) if P is not None else None)


def _prefill_in_key_slices(q, z_k, z_v, P_k, P_v, key_mode, positions, rope, bias, causal, lengths, n_valid,
                           scale, return_lse, prior, code_slice):
    """Prefill over codes with the dequantized copy bounded: the keys before the queries' own (seen by every
    query) in slices of ``code_slice``, then the rest (the queries' own, causal), each dequantized alone
    and attended in the latent space with its log-sum-exp; the parts merge by log-sum-exp (after ``prior``,
    if given), and ``P_v`` applies once at the end. A slice's left padding is the part of the row's
    padding it holds; ``n_valid`` is read to the host (prefill is never captured). Where ``key_mode`` is
    in :data:`PREFILL_REBUILT`, slices below the queries that hold no padding go through keys rebuilt at
    full width (:mod:`stiefkv.kernels.rebuilt`), the slices narrowed by the padded rank over ``d`` so that
    the transient stays the same bytes."""
    B, H, Nq, d = q.shape
    Nk = int(n_valid.item()) if n_valid is not None else z_k.shape[2]
    rebuilds = key_mode in PREFILL_REBUILT and bias is None and rebuilt.takes(q, z_k, z_v)
    if rebuilds:  # rebuilt keys and padded values are d wide, the kernel's copy the padded rank: same bytes
        code_slice = code_slice * max(padded_dim(z_k.shape[3]), padded_dim(z_v.shape[3])) // d
    step = max(_common.QUANT_GROUP, code_slice // _common.QUANT_GROUP * _common.QUANT_GROUP)
    own = max(0, Nk - Nq) // _common.QUANT_GROUP * _common.QUANT_GROUP  # channel scales: aligned starts
    bounds = [(a, min(a + step, own)) for a in range(0, own, step)] + [(own, Nk)]
    state = None if prior is None else (prior[0].float(), prior[1].float())  # (output, log-sum-exp)
    # keys from ``whole`` on are held by every row (left padding ends there): read to the host once
    whole = 0 if lengths is None else Nk - int(lengths.min())
    for a, c in bounds:
        own_keys = causal and c == Nk  # only the last part holds the queries' own keys
        if rebuilds and not own_keys and a >= whole and c > a:  # FlashAttention over no keys: lse +inf
            zk = _as_floats(_slice_keys(z_k, a, c), q.dtype)
            zv = _as_floats(_slice_keys(z_v, a, c), q.dtype, d)
            o, lse = rebuilt.attend_rebuilt(q, zk, zv, P_k, key_mode=key_mode, rope=rope,
                                            positions=None if positions is None else positions[..., a:c],
                                            scale=d**-0.5 if scale is None else scale)
            o = o[..., :z_v.shape[3]]
            state = (o, lse) if state is None else merge_prior(state, o, lse, torch.float32, True)
            continue
        held = None if lengths is None else (c - torch.clamp(Nk - lengths, min=a)).clamp(0, c - a)
        part = dict(positions=None if positions is None else positions[..., a:c],
                    bias=None if bias is None else bias[..., a:c], lengths=held)
        zk, Pk = _floats(_slice_keys(z_k, a, c), P_k, q.dtype)
        zv, _ = _floats(_slice_keys(z_v, a, c), None, q.dtype)
        o, lse = lowrank_attention(q, zk, zv, Pk, None, key_mode=key_mode, rope=rope, causal=own_keys,
                                   scale=scale, return_lse=True, code_slice=0, **part)
        o = o[..., :z_v.shape[3]]  # codes' values come back at the padded rank
        state = (o.float(), lse) if state is None else merge_prior(state, o, lse, torch.float32, True)
    o, lse = state
    if P_v is not None:  # head h reads its KV head's basis: [B, G, H/G, Nq, r] against [G, d, r]
        G = P_v.shape[0]
        o = torch.einsum("bgmnr,gdr->bgmnd", o.view(B, G, H // G, Nq, -1), P_v.float()).reshape(B, H, Nq, -1)
    o = o.to(q.dtype)
    return (o, lse) if return_lse else o


class TilesTooLarge(ValueError):
    """The kernel's tiles at these ranks exceed the GPU's shared memory at every tile size it tries."""


# _fit_key(...) -> the config that launched, or the TilesTooLarge message where none did
_FITTED: dict[tuple, dict | str] = {}


def _smaller_tiles(cfg: dict) -> dict | None:
    """The next config to try where ``cfg`` ran out of shared memory: one pipeline stage, then key tiles
    halved down to 16, then (prefill) query tiles of 64 rows; None past that."""
    if cfg["num_stages"] > 1:
        return dict(cfg, num_stages=1)
    if cfg["block_n"] > MIN_DOT:
        return dict(cfg, block_n=cfg["block_n"] // 2)
    if cfg["block_m"] > 64:
        return dict(cfg, block_m=64)
    return None


def _latent_kind(z) -> tuple:
    """What of a latent input changes the compiled kernel: its dtype, or its codes' bits, layout, scales."""
    if isinstance(z, QuantizedLatents):
        return ("codes", z.bits, z.layout, z.log8, z.scale.dtype)
    return ("float", z.dtype)


def _fit_key(args: tuple, cfg: dict, return_lse: bool, prior) -> tuple:
    """Everything that changes the kernel :func:`_launch` compiles for ``args`` and ``cfg`` (so its shared
    memory): shapes that are constexprs, dtypes and codes, the optional inputs, the device."""
    q, z_k, z_v, P_k, P_v, key_mode, positions, rope, bias, causal, lengths, n_valid, scale = args
    return (z_k.shape[3], z_v.shape[3], q.shape[3], q.shape[1] // z_k.shape[1], q.dtype, _latent_kind(z_k),
            _latent_kind(z_v), P_v is None, bias is None, lengths is None, n_valid is None, bool(causal),
            key_mode, return_lse, prior is None, q.device, tuple(sorted(cfg.items())))


def _launch_fitting(args: tuple, cfg: dict, return_lse: bool, prior, *, fit: bool = True):
    """:func:`_launch` at ranks above the head dimension (bases shared by a layer's KV heads: one latent a
    token of rank up to ``G·d``), whose tiles of bases and latents may not fit the GPU's shared memory at the
    default config (on the H200, ``[G, d, r]`` bases at d 128 and r 256 or 512: 237-467 KB asked, 227 KB
    there): smaller tiles (:func:`_smaller_tiles`) until one launches, remembered per kernel
    (:func:`_fit_key`); a :class:`TilesTooLarge` naming the ranks when none does, remembered too (the same
    message again, no new compilation). ``fit=False`` (tiles the caller chose): that config or the error."""
    from triton.runtime.errors import OutOfResources

    key = _fit_key(args, cfg, return_lse, prior)
    fitted = _FITTED.get(key, cfg)
    if isinstance(fitted, str):
        raise TilesTooLarge(fitted)
    tried, asked = cfg, None
    while fitted is not None:
        try:
            out = _launch(*args, fitted, return_lse, prior)
            _FITTED[key] = fitted
            return out
        except OutOfResources as err:
            tried, asked = fitted, getattr(err, "required", None)
            fitted = _smaller_tiles(fitted) if fit else None
    q, z_k, z_v = args[:3]
    tiles = f"tiles of {tried['block_m']} queries × {tried['block_n']} keys in {tried['num_stages']} stage(s)"
    message = (f"lowrank_attention: latents of ranks ({z_k.shape[3]}, {z_v.shape[3]}) at head dimension "
               f"{q.shape[3]} need more shared memory than this GPU has ({asked} bytes asked in {tiles}"
               f"{', the smallest tried' if fit else ', as given'}); run them through the PyTorch reference "
               "(backend='auto' does), or calibrate with lower ranks")
    _FITTED[key] = message
    raise TilesTooLarge(message)


def _launch(q, z_k, z_v, P_k, P_v, key_mode, positions, rope, bias, causal, lengths, n_valid, scale, cfg,
            return_lse=False, prior=None, compile_only=False):
    """One launch of the kernel for ``cfg``; ``compile_only``: compile it (Triton's warmup) and return the
    compiled kernel instead (:func:`_occupancy_splits` counts its registers)."""
    B, H, Nq, d = q.shape
    G, Nk, r_k = z_k.shape[1], z_k.shape[2], z_k.shape[3]
    r_v = z_v.shape[3]
    group = H // G
    n_rows = Nq * group
    block_m, block_n, splits = cfg["block_m"], cfg["block_n"], cfg["num_splits"]
    m_blocks = triton.cdiv(n_rows, block_m)
    rows_pad = m_blocks * block_m
    r_k_p2, r_v_p2 = padded_dim(r_k), padded_dim(r_v)
    out = torch.empty(B, H, Nq, d if P_v is not None else r_v, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32) if return_lse else out
    pre = key_mode == "pre_rope"
    k_codes, v_codes = isinstance(z_k, QuantizedLatents), isinstance(z_v, QuantizedLatents)
    # the tensor cores' dtype: fp16 for key codes under 16-bit queries (see _decode_latent), else fp32
    half = q.dtype in (torch.float16, torch.bfloat16)
    dtype = (torch.float16 if half else torch.float32) if k_codes else z_k.dtype
    # placeholders for float latents, and for the lows of log8 codes (their scale codes give them)
    sk, lk = (z_k.scale, z_k.scale if z_k.log8 else z_k.low) if k_codes else (P_k, P_k)
    sv, lv = (z_v.scale, z_v.scale if z_v.log8 else z_v.low) if v_codes else (P_k, P_k)
    k_log8, v_log8 = k_codes and z_k.log8, v_codes and z_v.log8
    k_bits, v_bits = (z_k.bits if k_codes else 16), (z_v.bits if v_codes else 16)
    k_channel = k_codes and z_k.layout == "channel"
    v_channel = v_codes and z_v.layout == "channel"
    sk_strides = z_k.scale.stride() if k_codes else (0, 0, 0, 0)
    sv_strides = z_v.scale.stride() if v_codes else (0, 0, 0, 0)
    z_k = z_k.codes if k_codes else z_k
    z_v = z_v.codes if v_codes else z_v
    k_unit, v_unit = _row_unit(z_k), _row_unit(z_v)
    pos = positions if pre else z_k
    inv_freq = rope.inv_freq.to(q.device, torch.float32).contiguous() if pre else z_k
    pv = P_v if P_v is not None else P_k  # placeholder pointer when the latent output is returned
    lens = lengths.to(q.device, torch.int32).contiguous() if lengths is not None else z_k
    bias_t = bias if bias is not None else z_k
    n_valid_t = n_valid if n_valid is not None else z_k
    if splits > 1:
        part_o = torch.empty(B * G, splits, rows_pad, r_v_p2, device=q.device, dtype=torch.float32)
        part_ml = torch.empty(2, B * G, splits, rows_pad, device=q.device, dtype=torch.float32)
        locks = torch.zeros(B * G * m_blocks, device=q.device, dtype=torch.int32)
    else:
        part_o = part_ml = locks = z_k  # unused
    dot_prec = "ieee" if dtype == torch.float32 else "tf32"
    # int4 token-layout codes met as even and odd channels (two dots; not with a fold), and int8 ones read
    # as words and met as channel pairs
    nibbles = bool(cfg.get("nibbles")) and not cfg.get("fold_scales")
    # pairs only with prefetch: without it a post_rope decode over log8 codes (r 28/44, latent output) gave
    # wrong outputs on the H100 (triton 3.6, 2026-12-05) that the interpreter does not reproduce, and it was
    # the slower loop at every shape timed (docs/notes/kernel-tries.md)
    pairs = bool(cfg.get("pairs")) and bool(cfg.get("prefetch")) and not cfg.get("fold_scales")
    pair_k = pairs and k_bits == 8 and not k_channel and _word_rows(z_k) and r_k_p2 >= 32 \
        and (not pre or bool(cfg.get("nibble_rebuild")))
    pair_v = pairs and v_bits == 8 and not v_channel and _word_rows(z_v) and r_v_p2 >= 32
    # channel-layout scales as a row a token group (2) when every tile starts at a multiple of its size (no
    # left padding: lengths shift the first key), else per element (1); int2 planes take the rows, since
    # their permuted columns make per-element scale loads scalar (triton 3.6, sm_90: 131 LDG a tile, spills)
    planes = bool(cfg.get("planes")) and bool(cfg.get("prefetch")) and not cfg.get("fold_scales")
    ch_mode = 2 if (cfg.get("channel_rows") or planes) and lengths is None else 1
    # int2 codes read as words and met as bit planes (channel layout: with its scales by rows only)
    rows = ch_mode == 2
    plane_k = planes and k_bits == 2 and _word_rows(z_k) and r_k_p2 >= 32 and (not k_channel or rows)
    plane_v = planes and v_bits == 2 and _word_rows(z_v) and r_v_p2 >= 32 and (not v_channel or rows)
    # int3 codes met as bit planes, read as the bytes' loop reads them
    planes3 = bool(cfg.get("int3_planes")) and bool(cfg.get("prefetch")) and not cfg.get("fold_scales")
    plane_k = plane_k or (planes3 and k_bits == 3 and r_k_p2 >= 32 and (not k_channel or rows))
    plane_v = plane_v or (planes3 and v_bits == 3 and r_v_p2 >= 32 and (not v_channel or rows))
    nib_k = nibbles and k_bits == 4 and not k_channel and r_k_p2 >= 32 \
        and (not pre or bool(cfg.get("nibble_rebuild")))
    nib_v = nibbles and v_bits == 4 and not v_channel and r_v_p2 >= 32
    # int4 nibbles read as words, with prefetch only
    prefetch = bool(cfg.get("prefetch"))
    nib_words = bool(cfg.get("nibble_words")) and prefetch
    # logits one tile ahead (pre_rope) over float latents without prefetch: over prefetched codes it lost
    # (H100, 2026-12-07: int4 r 64 at 16x16k 0.632 ms against 0.264 without, 0.302 at 64-key tiles)
    ahead = bool(cfg.get("ahead")) and pre and not k_codes and not prefetch
    # shared positions [B, Nk] are read per KV head with a zero head stride
    pos_strides = (0, 0, 0)
    if pre:
        pos_strides = (pos.stride(0), 0, pos.stride(1)) if pos.dim() == 2 else pos.stride()
    bias_strides = (bias.stride(0), bias.stride(1), bias.stride(2)) if bias is not None else (0, 0, 0)
    pv_strides = pv.stride()
    out_strides = out.stride()
    grid = (m_blocks, B * G, splits)
    run = functools.partial(_lowrank_attn_fwd.warmup, grid=grid) if compile_only else _lowrank_attn_fwd[grid]
    kernel = run(
        q, z_k, z_v, P_k, pv, pos, inv_freq, bias_t, lens, n_valid_t, out, part_o, part_ml, locks,
        sk, lk, sv, lv, lse, *(prior if prior is not None else (out, lse)),
        *q.stride(), *_unit_strides(z_k, k_unit), *_unit_strides(z_v, v_unit), *sk_strides, *sv_strides,
        *P_k.stride(), *pv_strides,
        *pos_strides, *bias_strides, *out_strides, *(lse.stride()[:3] if return_lse else (0, 0, 0)),
        *(prior[1].stride() if prior is not None else (0, 0, 0)),
        Nq, Nk, G, rows_pad, scale * LOG2E, float(rope.attention_scaling) if pre else 1.0,
        GROUP=group, HEAD_DIM=d, R_K=r_k, R_V=r_v, R_K_P2=r_k_p2, R_V_P2=r_v_p2,
        BLOCK_M=block_m, BLOCK_N=block_n,
        KEY_MODE=0 if pre else 1, CAUSAL=bool(causal), HAS_BIAS=bias is not None,
        HAS_LENS=lengths is not None, HAS_NVALID=n_valid is not None, HAS_PV=P_v is not None,
        SPLIT=splits > 1,
        FAST_SINCOS=sincos_mode(pre and cfg["fast_sincos"], bool(cfg.get("sincos_fadd"))),
        DOT_PREC=dot_prec,
        UPCAST=interpreting(),  # every dot: a bf16 value tile may meet fp16 key codes
        K_BITS=k_bits, V_BITS=v_bits, DTYPE=_TL_DTYPES[dtype],
        FOLD_K=bool(cfg.get("fold_scales")) and k_codes and not pre and r_k_p2 <= _common.QUANT_GROUP
        and not k_channel,
        FOLD_V=bool(cfg.get("fold_scales")) and v_codes and r_v_p2 <= _common.QUANT_GROUP and not v_channel,
        K_CH=k_channel * ch_mode, V_CH=v_channel * ch_mode, K_PLANES=plane_k, V_PLANES=plane_v,
        K_NIBW=nib_words and nib_k and _word_rows(z_k), V_NIBW=nib_words and nib_v and _word_rows(z_v),
        NIB_K=nib_k or pair_k,
        # not under fp32 queries: 1024·scale·Σq' cancels, ~1e-3 of large logits, past the fp32 tolerance
        FOLD_NIB=nibbles and bool(cfg.get("nibble_fold")) and bool(cfg.get("prefetch")) and k_bits == 4
        and not k_channel and not pre and 32 <= r_k_p2 <= _common.QUANT_GROUP and half,
        NIB_V=nib_v or pair_v,
        K_LOG8=k_log8, V_LOG8=v_log8, KEYS_LEFT=pre and bool(cfg.get("keys_left")),
        PREFETCH=prefetch, HAS_LSE=return_lse, K_UNIT=k_unit, V_UNIT=v_unit,
        HAS_PRIOR=prior is not None, LATE_V=prefetch and bool(cfg.get("late_values")),
        AHEAD=ahead,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **({"maxnreg": cfg["max_registers"]} if cfg.get("max_registers") and not interpreting() else {}),
    )
    if compile_only:
        return kernel
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------------------------------------ function
def lowrank_attention(
    q: torch.Tensor,
    z_k: torch.Tensor,
    z_v: torch.Tensor,
    P_k: torch.Tensor,
    P_v: torch.Tensor | None,
    *,
    key_mode: str = "pre_rope",
    positions: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
    bias: torch.Tensor | None = None,
    causal: bool = True,
    lengths: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    scale: float | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fast_sincos: bool | None = None,
    fold_scales: bool = False,
    prefetch: bool | None = None,
    nibbles: bool | None = None,
    nibble_rebuild: bool | None = None,
    nibble_fold: bool | None = None,
    keys_left: bool | None = None,
    max_registers: int | None = None,
    late_values: bool | None = None,
    pairs: bool | None = None,
    channel_rows: bool | None = None,
    planes: bool | None = None,
    int3_planes: bool | None = None,
    sincos_fadd: bool | None = None,
    nibble_words: bool | None = None,
    ahead: bool | None = None,
    code_slice: int | None = None,
    return_lse: bool = False,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
    return_config: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | dict:
    """Softmax attention over a latent KV cache (Triton); same contract as
    :func:`stiefkv.kernels.reference.lowrank_attention`.

    Parameters
    ----------
    q : ``[B, H, Nq, d]`` rotated queries. z_k : ``[B, G, Nk, r_k]``, z_v : ``[B, G, Nk, r_v]`` latents
        (bf16, fp16 or fp32; any strides), or either as :class:`QuantizedLatents` (8, 4, 3 or 2-bit codes,
        dequantized in registers to the queries' dtype). P_k : ``[G, d, r_k]``, P_v : ``[G, d, r_v]`` or
        ``None`` (latent output ``[B, H, Nq, r_v]``).
    key_mode, positions ``[B, Nk]`` (or ``[B, G, Nk]``), rope, bias ``[B, G, Nk]``, causal, lengths ``[B]``,
        n_valid, scale : as the reference; ``n_valid`` is read by the kernel from device memory, never by
        the host (graph capture).
    num_splits, block_n, num_warps, num_stages, fast_sincos : tuning overrides (tests, benchmarks); ``None``
        picks the defaults of :func:`_default_config`. ``num_splits > 1`` is honoured for decode only.
        ``fast_sincos`` (``pre_rope``): the hardware sin/cos (:func:`_sincos_fast`) instead of the
        polynomial one; on by default on CUDA (19-29 % less decode time on the H200,
        docs/notes/kernel-tries.md), off under the interpreter, which has no hardware sin/cos.
        ``fold_scales`` (codes in one scale group): apply the scales and lows to the logits (``post_rope``
        keys) and to the probabilities (values) instead of dequantizing each tile; a candidate, off: slower
        than the default at every shape on the H200 (2026-12-01, with int-to-float key codes; its keys now
        take the fp16 bit trick, not measured since).
        ``prefetch``: read each key and value tile (latents or codes, scales, lows, positions) one tile ahead
        in registers (not with ``fold_scales``); decode only, like ``num_splits``; ``None``: on for codes
        but the wide int4 ``post_rope`` tile (see :func:`_default_config`), so that ``nibble_fold`` and
        ``late_values``, which need it, are off there unless ``prefetch=True`` is asked.
        ``nibbles``: int4 codes in the token layout (values, and ``post_rope`` keys; padded ranks ≥ 32) are
        met as their even and odd channels, the low and high nibbles of each byte, in two dots of half the
        depth, instead of being interleaved back into one tile; ``None``: on for decode over codes (see
        :func:`_default_config`). ``nibble_rebuild``: ``pre_rope`` keys too (the rebuild in four dots of
        half the depth). ``nibble_fold``: ``post_rope`` int4 keys (ranks 32-64, with ``prefetch``, 16-bit
        queries) meet the queries as ``1024 + code`` and each token's scale and low are applied to its
        logits. Both ``None``: on with ``nibbles`` (see :func:`_default_config`).
        ``keys_left`` (``pre_rope``): the logits as ``(k qᵀ)ᵀ``, the rebuilt and rotated keys the dot's
        left operand read from registers, instead of ``q kᵀ`` with the keys staged through shared memory;
        ``None``: on for decode over float latents (measured: bf16) and int4 key codes at a power-of-two
        rank (measured: token layout, float16 scales), off over 8-, 3- and 2-bit keys and int4 keys at a
        padded rank (see :func:`_keys_left`).
        ``max_registers``: a ceiling on registers a thread (Triton's ``maxnreg``; CUDA only), a candidate for
        fitting more programs an SM at the price of spills; ``None``: the compiler's choice.
        ``late_values`` (with ``prefetch``): decode a tile's value codes just before the value dot instead
        of at the top of the loop, so the decoded tile is not live beside the logits; a candidate, off.
        ``pairs``: int8 codes in the token layout (values, and ``post_rope`` keys, ``pre_rope`` keys with
        ``nibble_rebuild``; a stored width a multiple of 4, padded ranks ≥ 32, rows 4-byte aligned) are read
        as 32-bit words and met as two tiles of channel pairs (``4w, 4w + 1`` and ``4w + 2, 4w + 3``), one
        byte permute a pair (:func:`_word_pairs`), in two dots of half the depth as ``nibbles`` does; with
        ``prefetch`` only (the bytes' loop otherwise); ``None``: on for decode over codes (measured: int8
        keys and values, both key modes, ranks 64 and 128; see :func:`_default_config`).
        ``channel_rows``: codes in the channel layout (a scale and low per channel and 64 tokens) read their
        scales as one row a token group the tile spans, broadcast over its keys, instead of a scale and low
        loaded per element; tiles are aligned to their size unless ``lengths`` is given, so not there;
        ``None``: on for decode over codes (see :func:`_default_config`).
        ``planes``: int2 codes (a stored width a multiple of 4 bytes, padded ranks ≥ 32, rows 4-byte aligned;
        the channel layout with its scales read as rows, ``channel_rows``, so not under ``lengths``) read as
        32-bit words and decoded by one shift and one ``lop3`` a pair of codes into
        bit-plane column order (:func:`_plane_codes`), the basis or query rows and the output columns read
        and written at the matching channels (:func:`_channels`); with ``prefetch`` only; ``None``: on for
        decode over codes (see :func:`_default_config`).
        ``int3_planes``: int3 codes (padded ranks ≥ 32; the channel layout with its scales read as rows)
        read as the bytes' loop reads them, eight codes a word, and decoded field by field into the bit-plane
        column order of ``planes`` instead of interleaved back into channel order; with ``prefetch`` only;
        ``None``: on for ``pre_rope`` decode over int3 channel-layout keys, the case it was timed to win
        (see :func:`_default_config`).
        ``nibble_words``: int4 token-layout codes met as nibbles (``nibbles``) are read as 32-bit words, eight
        codes a register, so that no bytes are packed into a register before the nibbles' byte permutes
        (:func:`_word_nibbles`); with ``prefetch`` only; a candidate, off: at r 64 it lost to the default
        at 16×16k and 4×128k in both key modes (H100, 2026-12-05; docs/notes/kernel-tries.md).
        ``sincos_fadd`` (``pre_rope`` with ``fast_sincos``): the whole turns of each angle rounded by an
        add and a subtract (:func:`_turns`) instead of ``FRND``, the same integer, so that the reduction no
        longer shares the XU pipe with the MUFU sin/cos (Nsight Compute, H100: that pipe takes 110 of a
        64-key tile's 748 instructions a warp, a third of them ``FRND``); the decode default but over int3
        keys (ignored without ``fast_sincos``; see :func:`_default_config`).
        ``ahead`` (``pre_rope``): each tile's logits formed one iteration ahead, so that the next tile's
        rebuild, sin/cos and rotation and this tile's softmax and value dot are independent work in one
        iteration (:func:`_attend_range`); over float latents without ``prefetch`` only (left off
        elsewhere: over prefetched codes it was timed and lost); ``None``: on for float latents (timed in
        bf16) at d 128 and r 64 where a split holds ≥ :data:`AHEAD_KEYS` keys, with ``keys_left`` off (see
        :func:`_default_config`).
        ``code_slice`` (prefill over codes): dequantize and attend the keys before the queries' own at most
        this many at a time, merged by log-sum-exp (:func:`_prefill_in_key_slices`), so the bf16 copy is a
        slice's and not the cache's; ``None``: :data:`PREFILL_CODE_SLICE`, 0 for whole.
        ``return_config``: return the configuration this call would launch (tiles, warps, splits, the
        loops' options) instead of launching it, so benchmarks record what ran; not with ``code_slice``'s
        slicing, whose parts each resolve their own; at ranks above ``d``, before any smaller tiles are
        fitted to the GPU's shared memory.

    Returns
    -------
    ``[B, H, Nq, d]`` (or ``[B, H, Nq, r_v]``) in ``q.dtype``; a row with no visible key is 0. With
    ``prior`` (``o``, ``lse``), an attention over other keys (latent output, ``P_v=None``), the result is
    attention over both key sets, as :func:`~stiefkv.kernels._common.merge_by_lse` would give. With
    ``return_lse``, also each row's log-sum-exp of its scaled logits ``[B, H, Nq]`` (float32, −inf for a row
    with no visible key), to merge it with attention over other keys.
    """
    if not q.is_cuda and not interpreting():
        raise RuntimeError("the Triton low-rank attention runs on CUDA tensors (or on the CPU under "
                           "TRITON_INTERPRET=1); stiefkv.kernels.lowrank_attention picks the reference here")
    k_meta = _check_codes(z_k, "z_k", q) if isinstance(z_k, QuantizedLatents) else z_k
    v_meta = _check_codes(z_v, "z_v", q) if isinstance(z_v, QuantizedLatents) else z_v
    _check_inputs(q, k_meta, v_meta, P_k, P_v, key_mode, positions, rope, bias, lengths, n_valid, prior)
    B, H, Nq, d = q.shape
    G, Nk = z_k.shape[1], z_k.shape[2]
    n_rows = Nq * (H // G)
    r_v = z_v.shape[3]
    code_slice = PREFILL_CODE_SLICE if code_slice is None else code_slice
    # float latents too where the keys before the queries' own go through rebuilt keys (PREFILL_REBUILT)
    sliced = code_slice and n_rows > DECODE_BLOCK_M and (
        isinstance(z_k, QuantizedLatents) or isinstance(z_v, QuantizedLatents)
        or (key_mode in PREFILL_REBUILT and bias is None and rebuilt.takes(q, z_k, z_v)))
    if sliced and (n_valid is not None or Nk - Nq > code_slice):
        if return_config:
            raise ValueError("return_config: this prefill attends over its codes in key slices, each "
                             "launched with its own configuration; pass code_slice=0 to see one launch's")
        if prior is not None:  # the slices merge it in the latent space: refused with P_v as the kernel does
            _refuse_prior(prior, q, r_v, P_v)
        return _prefill_in_key_slices(q, z_k, z_v, P_k, P_v, key_mode, positions, rope, bias, causal, lengths,
                                      n_valid, scale, return_lse, prior, int(code_slice))
    if n_rows > DECODE_BLOCK_M and not interpreting():
        # Prefill over codes dequantizes first on the GPU: the in-register path is exact under the
        # interpreter, but a post_rope int8 prefill (ranks 40/24 padded to 64/32) hit an illegal memory access
        # on the H200 (triton 3.6, 2026-12-01) that the device time left could not locate. Decode reads codes
        # in place (checked on the GPU against the reference).
        (z_k, P_k), (z_v, P_v) = _floats(z_k, P_k, q.dtype), _floats(z_v, P_v, q.dtype)
    if n_rows > DECODE_BLOCK_M:  # prefill: see _pad_rank
        if z_k.shape[3] != padded_dim(z_k.shape[3]):
            z_k, P_k = (_pad_codes if isinstance(z_k, QuantizedLatents) else _pad_rank)(z_k, P_k)
        if z_v.shape[3] != padded_dim(z_v.shape[3]):  # not where _floats padded the codes' values
            z_v, P_v = (_pad_codes if isinstance(z_v, QuantizedLatents) else _pad_rank)(z_v, P_v)
    codes = isinstance(z_k, QuantizedLatents) or isinstance(z_v, QuantizedLatents)
    k_bits = z_k.bits if isinstance(z_k, QuantizedLatents) else 16
    cfg = _default_config(n_rows, Nk, key_mode, B * G, _num_sms(q.device), z_k.shape[3], codes, k_bits,
                          _token_int4(z_k) and _token_int4(z_v),
                          isinstance(z_k, QuantizedLatents) and z_k.layout == "channel", lengths is not None,
                          _token_int2(z_k) and _token_int2(z_v), head_dim=d)
    if fast_sincos and interpreting():
        raise ValueError("fast_sincos=True needs a CUDA device: the Triton interpreter has no hardware "
                         "sin/cos")
    if fast_sincos is None:
        fast_sincos = not interpreting()
    if sincos_fadd and not fast_sincos:
        raise ValueError("sincos_fadd=True changes the hardware sin/cos's range reduction: it needs "
                         "fast_sincos (a CUDA device); drop sincos_fadd or pass fast_sincos=True on CUDA")
    if prefetch and fold_scales:
        raise ValueError("prefetch and fold_scales are two candidates for the same loop; pick one")
    if fold_scales:
        prefetch = False
    overrides = dict(num_splits=num_splits, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                     prefetch=prefetch, nibbles=nibbles, nibble_rebuild=nibble_rebuild,
                     nibble_fold=nibble_fold, keys_left=keys_left, max_registers=max_registers,
                     late_values=late_values, pairs=pairs, channel_rows=channel_rows, planes=planes,
                     int3_planes=int3_planes, nibble_words=nibble_words, sincos_fadd=sincos_fadd,
                     ahead=ahead)
    cfg.update({k: v for k, v in overrides.items() if v is not None}, fast_sincos=bool(fast_sincos),
               fold_scales=fold_scales)
    if n_rows > cfg["block_m"]:
        cfg["num_splits"] = 1
    if n_rows > DECODE_BLOCK_M:
        # Prefill tiles (128 rows, wgmma) do not prefetch: a register-built tile transposed into the logits'
        # dot hit an illegal memory access on the H200 (triton 3.6, prefetch=True, post_rope, r 16 and
        # r 56/24 at 76 and 150 rows, 2026-12-01), as the codes' prefill did (above).
        cfg["prefetch"] = False
    scale = d**-0.5 if scale is None else float(scale)
    if prior is not None:
        prior = _check_prior(prior, q, r_v, z_v.shape[3], P_v)
    args = (q, z_k, z_v, P_k, P_v, key_mode, positions, rope, bias, causal, lengths, n_valid, scale)
    n_sms = _num_sms(q.device)
    # the occupancy count was measured on 4-warp kernels; the 2-warp int2 loop takes its own doubled count
    if num_splits is None and n_rows <= DECODE_BLOCK_M and B * G <= n_sms and cfg["num_splits"] > 1 \
            and (key_mode == "pre_rope" or codes) and cfg["num_warps"] == 4 and q.is_cuda \
            and not interpreting():
        cfg["num_splits"] = _occupancy_splits(args, cfg, return_lse, prior, n_sms)
    if return_config:
        return cfg
    if max(padded_dim(z_k.shape[3]), padded_dim(z_v.shape[3])) <= d:  # ranks ≤ d: tiles measured to fit
        out = _launch(*args, cfg, return_lse, prior)
    else:  # tiles the caller chose (benchmarks' sweeps) are launched as given or refused, never shrunk
        out = _launch_fitting(args, cfg, return_lse, prior, fit=block_n is None and num_stages is None)
    out, lse = out if return_lse else (out, None)
    if P_v is None and z_v.shape[3] != r_v:  # latent output of a padded value rank
        out = out[..., :r_v].contiguous()
    return (out, lse) if return_lse else out
