"""Quantize-on-write: new tokens' latents quantized and packed into a static cache's code buffers, one launch.

A static store that holds codes (``stiefkv.static_cache``) writes each decoded token quantized. Done with
PyTorch operators, that is a few dozen small kernels per latent and layer (the group ranges, the float16
scale and low or the log8 code, the rounding, the packing, three scatters): ~1300-3100 extra launches per
decode step of an 8B-shaped model, most of what codes cost a captured step beyond bf16 latents
(docs/notes/serving.md). :func:`quantize_into` does it in one launch per latent, bit for bit as
``stiefkv.quant.quantize`` followed by ``index_copy_`` (the per-token layout, min–max or log8 scales; the
tests compare every byte).

One program quantizes one group of :data:`QUANT_GROUP` channels of one token of one (batch row, KV head):
its range over the real channels, the float16 ``low`` and ``scale = (hi − low) / levels`` rounded to float16
(or the uint8 log8 code of ``max(|lo|, |hi|) · 2 / levels``, decoded as the attention kernels decode it), the
codes ``round((x − low) / step)`` (half to even, IEEE division), then eight codes to ``bits`` little-endian
bytes. A NaN in a group makes its scale NaN (log8: ``LOG8_NAN``) and its codes 0, as PyTorch does; a low of
zero keeps the sign the group's minimum gives it, where PyTorch's reduction order may pick the other (the
values read back are the same). Source rows come from ``z`` by token, or, for a store with an exact window,
from its ring at the slot the window pushes out (``ring``): all indices are read from device memory, so a
captured graph replays it.

:func:`quantize_group_into` is the channel layout's write (KIVI-style keys: per channel over groups of
:data:`QUANT_GROUP` tokens): a program quantizes one block of channels of the group that the token just
written makes due, from the store's ring, and writes nothing on the other 63 steps of a group.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stiefkv.kernels import _common
from stiefkv.kernels._common import KERNEL_BITS, QUANT_GROUP
from stiefkv.kernels.lowrank import (
    LOG8_E1,
    LOG8_E2,
    LOG8_E3,
    LOG8_E4,
    LOG8_E5,
    LOG8_E6,
    LOG8_E7,
    LOG8_NAN,
    _log8,
)

GROUP = tl.constexpr(QUANT_GROUP)
LOG8_OFFSET = tl.constexpr(_common.LOG8_OFFSET)
SMALLEST_STEP = tl.constexpr(2.0 ** -14)  # log8 codes start at float16's smallest normal
ROUNDER = tl.constexpr(12582912.0)  # 1.5·2^23: v + this − this is v rounded half to even (|v| < 2^22)
# tokens a program of a prefill chunk's write quantizes (decode's one token takes a program of one warp):
# a program a token made the interpreter's tests crawl, and a 128-token chunk 8 times the programs
CHUNK_TOKENS = 16


@triton.jit
def _round_half_even(v):
    """``torch.round`` of fp32 values within ±2^22 (the caller clamps first): adding and subtracting 1.5·2^23
    leaves the nearest integer, ties to even, in IEEE arithmetic (no hardware-specific rounding mode)."""
    return (v + ROUNDER) - ROUNDER


@triton.jit
def _log8_code(step, LARGEST: tl.constexpr):
    """``stiefkv.quant.log8_code``: the code of the smallest log8 scale ≥ ``step`` (fp32 ≥ 0), by the
    exponent and mantissa bits (no logarithm), clamped to ``LARGEST``; ``LOG8_NAN`` where not finite."""
    s = tl.where(step < SMALLEST_STEP, SMALLEST_STEP, step)
    bits = s.to(tl.int32, bitcast=True)
    mant = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)  # 2m of frexp, in [1, 2)
    j = (mant > 1.0).to(tl.int32) + (mant > LOG8_E1).to(tl.int32) + (mant > LOG8_E2).to(tl.int32) \
        + (mant > LOG8_E3).to(tl.int32) + (mant > LOG8_E4).to(tl.int32) + (mant > LOG8_E5).to(tl.int32) \
        + (mant > LOG8_E6).to(tl.int32) + (mant > LOG8_E7).to(tl.int32)
    k = 8 * (((bits >> 23) & 0xFF) - 127) + j + LOG8_OFFSET
    k = tl.minimum(tl.maximum(k, 0), LARGEST)
    finite = (step == step) & (step < float("inf"))
    return tl.where(finite, k, LOG8_NAN)


@triton.jit
def _group_range(x, real, AXIS: tl.constexpr):
    """A group's min and max along ``AXIS`` over its ``real`` entries (fp32), NaN where any holds NaN:
    ``tl.min``/``max`` skip NaN, ``torch.amin``/``amax`` propagate it."""
    lo = tl.min(tl.where(real, x, float("inf")), AXIS)
    hi = tl.max(tl.where(real, x, float("-inf")), AXIS)
    nan = tl.max((real & (x != x)).to(tl.int32), AXIS) > 0
    return tl.where(nan, float("nan"), lo), tl.where(nan, float("nan"), hi)


@triton.jit
def _grid_codes(x, low, step, LEVELS: tl.constexpr):
    """``round((x − low) / step)`` clamped to ``[0, LEVELS]`` (fp32, IEEE division, half to even), and where
    that quotient was NaN."""
    v = tl.div_rn(x - low, step)
    nan_v = v != v  # tl.maximum below drops a NaN on the GPU
    v = tl.minimum(tl.maximum(v, -1.0), LEVELS + 1.0)
    return tl.minimum(tl.maximum(_round_half_even(v), 0.0), LEVELS * 1.0), nan_v


@triton.jit
def _fp16_grid(lo, hi, LEVELS: tl.constexpr):
    """``stiefkv.quant._grid``: the float16 low and scale of the range ``[lo, hi]`` (scale ``(hi − low) /
    levels`` from the rounded low, IEEE division) and, in fp32, the low and the step codes divide by (1 for a
    constant group: code 0, back as its low)."""
    low16 = lo.to(tl.float16)
    low = low16.to(tl.float32)
    scale16 = tl.div_rn(hi - low, LEVELS * 1.0).to(tl.float16)
    step = tl.where(scale16.to(tl.float32) > 0, scale16.to(tl.float32), 1.0)
    return low16, scale16, low, step


@triton.jit
def _store_words(ptrs, words, first_byte, width: tl.constexpr, BITS: tl.constexpr):
    """Words of eight codes (code ``i`` at bit ``BITS·i``) as ``BITS`` little-endian bytes from ``ptrs`` (each
    word's first byte, at byte ``first_byte`` of its row); bytes at ``width`` and past it are not written."""
    for i in tl.static_range(BITS):
        tl.store(ptrs + i, ((words >> (8 * i)) & 0xFF).to(tl.uint8), mask=first_byte + i < width)


@triton.jit
def _quantize_into_kernel(
    Z, SLOTS, CODES, SCALE, LOW,
    stride_zb, stride_zg, stride_zn, stride_zr,
    stride_cb, stride_cg, stride_cn,
    stride_sb, stride_sg, stride_sn,
    n_kv_heads, n_tokens,
    R: tl.constexpr, BITS: tl.constexpr, LOG8: tl.constexpr, LARGEST: tl.constexpr,
    RECENT: tl.constexpr, WINDOW: tl.constexpr, TOKENS: tl.constexpr,
):
    """Program (block of ``TOKENS`` tokens, batch row × KV head, group): ``WINDOW == 0``: ``Z``'s tokens
    ``t`` to slots ``SLOTS[t]``; else (one token) the ring entry ``(SLOTS[0] − RECENT) mod WINDOW`` of ``Z``
    to slot ``max(SLOTS[0] − RECENT, 0)`` (before any token is due, slot 0 gets codes no one reads)."""
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    bg = tl.program_id(1).to(tl.int64)
    grp = tl.program_id(2)
    b = bg // n_kv_heads
    g = bg % n_kv_heads
    live = t < n_tokens
    slot = tl.load(SLOTS + t, mask=live, other=0).to(tl.int64)
    if WINDOW > 0:
        token = slot - RECENT
        row = ((token % WINDOW) + WINDOW) % WINDOW
        slot = tl.maximum(token, 0)
    else:
        row = t.to(tl.int64)
    LEVELS: tl.constexpr = (1 << BITS) - 1
    offs = grp * GROUP + tl.arange(0, GROUP)
    real = (offs < R)[None, :]
    x = tl.load(Z + b * stride_zb + g * stride_zg + row[:, None] * stride_zn + offs[None, :] * stride_zr,
                mask=live[:, None] & real, other=0.0).to(tl.float32)  # [tokens, channels]
    lo, hi = _group_range(x, real, 1)  # NaN propagates (log8: LOG8_NAN)
    s_off = b * stride_sb + g * stride_sg + slot * stride_sn + grp
    if LOG8:
        code = _log8_code(tl.maximum(tl.abs(lo), tl.abs(hi)) * (2.0 / LEVELS), LARGEST)
        step, low = _log8(code, BITS)
        tl.store(SCALE + s_off, code.to(tl.uint8), mask=live)
    else:
        low16, scale16, low, step = _fp16_grid(lo, hi, LEVELS)
        tl.store(SCALE + s_off, scale16, mask=live)
        tl.store(LOW + s_off, low16, mask=live)
    code, nan_v = _grid_codes(x, low[:, None], step[:, None], LEVELS)
    # a NaN gives code 0, as PyTorch's NaN-to-uint8 does here (the group's scale says NaN)
    c = tl.where(real & ~nan_v, code, 0.0).to(tl.int64)
    # eight codes to one word of 8·BITS bits (code i at bit BITS·i), written as BITS little-endian bytes
    shifts = (BITS * tl.arange(0, 8)).to(tl.int64)
    words = tl.sum(tl.reshape(c, [TOKENS, GROUP // 8, 8]) << shifts[None, None, :], 2)
    width: tl.constexpr = (R + 7) // 8 * BITS  # the stored bytes (the last eight codes padded)
    first = grp * (GROUP // 8) * BITS + tl.arange(0, GROUP // 8) * BITS
    first = tl.where(live[:, None], first[None, :], width)  # a token past the block's end writes nothing
    _store_words(CODES + b * stride_cb + g * stride_cg + slot[:, None] * stride_cn + first, words, first,
                 width, BITS)


def quantize_into(z: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                  low: torch.Tensor | None, *, bits: int, log8: bool = False, largest: int = 255,
                  ring: tuple[int, int] | None = None) -> None:
    """Quantize latents ``z`` ``[B, G, n, r]`` per token (groups of :data:`QUANT_GROUP` channels) into the
    buffers ``codes`` ``[B, G, L, ceil(r / 8) · bits]`` (uint8), ``scale`` and ``low`` ``[B, G, L, groups]``
    (float16; log8: ``scale`` uint8 codes, ``low`` None) at the slots ``slots`` ``[n]`` (int, on the device),
    as ``stiefkv.quant.quantize`` then ``index_copy_`` along the token axis would.

    ``largest``: the largest log8 code at ``bits`` (``stiefkv.quant.LOG8_LARGEST``). ``ring=(recent,
    window)``: ``z`` is a store's ring of exact tokens ``[B, G, window, r]`` and ``slots`` ``[1]`` the slot
    just written; the token it pushes out of the window (``slot − recent``) is quantized from its ring entry
    into its slot (slot 0 before any is due). Triton only: CUDA tensors, or the CPU under the interpreter.
    """
    if bits not in KERNEL_BITS:
        raise ValueError(f"bits must be one of {KERNEL_BITS}, got {bits}")
    B, G, n, r = z.shape
    groups = -(-r // QUANT_GROUP)
    if codes.shape[:2] != (B, G) or codes.shape[3] != -(-r // 8) * bits or scale.shape[3] != groups:
        raise ValueError(f"buffers {tuple(codes.shape)} / {tuple(scale.shape)} do not hold {r}-channel "
                         f"latents of {bits} bits for {B} rows and {G} KV heads")
    if any(t is not None and t.stride(-1) != 1 for t in (codes, scale, low)):
        raise ValueError("the code, scale and low buffers need a unit stride along their last axis")
    if (low is None) != log8:
        raise ValueError("log8 scales take no low; float16 scales need one")
    if ring is not None and slots.numel() != 1:
        raise ValueError(f"a ring write takes the one slot just written, got {slots.numel()}")
    tokens = 1 if ring is not None else n
    if slots.numel() != tokens:
        raise ValueError(f"{tokens} tokens but {slots.numel()} slots")
    if tokens == 0:
        return
    recent, window = ring if ring is not None else (0, 0)
    low_t = low if low is not None else scale
    block = 1 if tokens == 1 else CHUNK_TOKENS
    _quantize_into_kernel[(-(-tokens // block), B * G, groups)](
        z, slots, codes, scale, low_t,
        *z.stride(), *codes.stride()[:3], *scale.stride()[:3],
        G, tokens, R=r, BITS=bits, LOG8=log8, LARGEST=largest, RECENT=recent, WINDOW=window, TOKENS=block,
        num_warps=1 if block == 1 else 4,
    )


@triton.jit
def _quantize_group_kernel(
    RING, SLOTS, CODES, SCALE, LOW,
    stride_rb, stride_rg, stride_rn, stride_rr,
    stride_cb, stride_cg, stride_cn,
    stride_sb, stride_sg, stride_sn,
    n_kv_heads, chunk_first,
    R: tl.constexpr, BITS: tl.constexpr, RECENT: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (batch row × KV head, block of ``GROUP`` channels, group of the chunk): when slot ``SLOTS[0]``
    completes a group of ``GROUP`` tokens past the window (``end = SLOTS[0] + 1 − RECENT``, a positive
    multiple of ``GROUP``), the tokens ``end − GROUP … end − 1`` from their ring entries, quantized per
    channel into their slots and the group's row of scales and lows; otherwise it writes nothing.
    ``CHUNK`` (a prefill chunk's groups, every one due): group ``j``'s tokens are rows ``j·GROUP …`` of
    ``RING`` and slots ``chunk_first + j·GROUP …``."""
    bg = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = bg // n_kv_heads
    g = bg % n_kv_heads
    if CHUNK:
        j = tl.program_id(2).to(tl.int64)
        end = chunk_first + (j + 1) * GROUP
        rows = j * GROUP + tl.arange(0, GROUP)
    else:
        end = tl.load(SLOTS).to(tl.int64) + 1 - RECENT
        rows = (end - GROUP + tl.arange(0, GROUP)) % WINDOW
    if (end > 0) & (end % GROUP == 0):  # decode: 63 steps of 64 read and write nothing
        first = end - GROUP
        tokens = first + tl.arange(0, GROUP)
        LEVELS: tl.constexpr = (1 << BITS) - 1
        offs = blk * GROUP + tl.arange(0, GROUP)
        real = (offs < R)[None, :]
        x = tl.load(RING + b * stride_rb + g * stride_rg + rows[:, None] * stride_rn
                    + offs[None, :] * stride_rr, mask=real, other=0.0).to(tl.float32)  # [tokens, channels]
        lo, hi = _group_range(x, real, 0)  # per channel, over the group's tokens
        low16, scale16, low, step = _fp16_grid(lo, hi, LEVELS)
        s_off = b * stride_sb + g * stride_sg + (first // GROUP) * stride_sn + offs
        tl.store(SCALE + s_off, scale16, mask=offs < R)
        tl.store(LOW + s_off, low16, mask=offs < R)
        code, nan_v = _grid_codes(x, low[None, :], step[None, :], LEVELS)
        c = tl.where(real & ~nan_v, code, 0.0).to(tl.int64)
        # each token's eight codes to one word of 8·BITS bits, as the per-token kernel packs them
        shifts = (BITS * tl.arange(0, 8)).to(tl.int64)
        words = tl.sum(tl.reshape(c, [GROUP, GROUP // 8, 8]) << shifts[None, None, :], 2)
        width: tl.constexpr = (R + 7) // 8 * BITS
        first_byte = blk * (GROUP // 8) * BITS + tl.arange(0, GROUP // 8) * BITS
        C_rows = CODES + b * stride_cb + g * stride_cg + tokens[:, None] * stride_cn
        _store_words(C_rows + first_byte[None, :], words, first_byte[None, :], width, BITS)


def quantize_group_into(ring: torch.Tensor, slot: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                        low: torch.Tensor, *, bits: int, recent: int) -> None:
    """The channel layout's decode write: once slot ``slot`` (``[1]`` int on the device, just written to
    ``ring`` ``[B, G, window, r]``) makes a group of :data:`QUANT_GROUP` tokens due (all but the ``recent``
    newest, a whole group), quantize them per channel on min–max ranges into ``codes`` ``[B, G, L,
    ceil(r / 8) · bits]`` at their slots and ``scale``, ``low`` ``[B, G, L / QUANT_GROUP, r]`` (float16) at
    the group's row; nothing where none is due. Bit for bit ``stiefkv.quant.quantize`` of the group then
    ``index_copy_`` (``WindowedCodes.write_one``'s ~50 operators), in one launch that reads the slot from
    device memory (a captured graph replays it). Triton only: CUDA tensors, or the CPU under the
    interpreter."""
    if bits not in KERNEL_BITS:
        raise ValueError(f"bits must be one of {KERNEL_BITS}, got {bits}")
    B, G, window, r = ring.shape
    if slot.numel() != 1:
        raise ValueError(f"the channel write takes the one slot just written, got {slot.numel()}")
    if window < recent + QUANT_GROUP:
        raise ValueError(f"a ring of {window} entries cannot hold {recent} recent tokens and a group of "
                         f"{QUANT_GROUP}")
    _check_group_buffers(codes, scale, low, B, G, r, bits)
    _quantize_group_kernel[(B * G, -(-r // QUANT_GROUP), 1)](
        ring, slot, codes, scale, low, *ring.stride(), *codes.stride()[:3], *scale.stride()[:3],
        G, 0, R=r, BITS=bits, RECENT=recent, WINDOW=window, CHUNK=False, num_warps=4,
    )


def quantize_groups_into(z: torch.Tensor, first: int, codes: torch.Tensor, scale: torch.Tensor,
                         low: torch.Tensor, *, bits: int) -> None:
    """The channel layout's prefill write: ``z`` ``[B, G, n, r]`` (``n`` a multiple of :data:`QUANT_GROUP`)
    holds whole groups of tokens due at slots ``first … first + n − 1`` (``first`` a multiple of the group,
    the host's count); quantize each group per channel on min–max ranges into ``codes`` at those slots and
    ``scale``, ``low`` at the groups' rows, in one launch. Bit for bit ``stiefkv.quant.quantize`` of the
    chunk then ``WindowedCodes._store`` (~56 operators a chunk). Triton only: CUDA tensors, or the CPU under
    the interpreter."""
    if bits not in KERNEL_BITS:
        raise ValueError(f"bits must be one of {KERNEL_BITS}, got {bits}")
    B, G, n, r = z.shape
    if n % QUANT_GROUP or first % QUANT_GROUP or first < 0:
        raise ValueError(f"a chunk's channel groups are whole groups of {QUANT_GROUP} tokens at a group's "
                         f"first slot: got {n} tokens at slot {first}")
    _check_group_buffers(codes, scale, low, B, G, r, bits)
    if n == 0:
        return
    _quantize_group_kernel[(B * G, -(-r // QUANT_GROUP), n // QUANT_GROUP)](
        z, z, codes, scale, low, *z.stride(), *codes.stride()[:3], *scale.stride()[:3],
        G, first, R=r, BITS=bits, RECENT=0, WINDOW=0, CHUNK=True, num_warps=4,
    )


def _check_group_buffers(codes, scale, low, B: int, G: int, r: int, bits: int) -> None:
    if codes.shape[:2] != (B, G) or codes.shape[3] != -(-r // 8) * bits or scale.shape[3] != r \
            or low.shape != scale.shape:
        raise ValueError(f"buffers {tuple(codes.shape)} / {tuple(scale.shape)} do not hold {r}-channel "
                         f"latents of {bits} bits per channel for {B} rows and {G} KV heads")
    if any(t.stride(-1) != 1 for t in (codes, scale, low)):
        raise ValueError("the code, scale and low buffers need a unit stride along their last axis")


@triton.jit
def _bf16_rne(x):
    """fp32 ``x`` rounded to the nearest bfloat16, ties to even, still in fp32 (so the cast that follows is
    exact): the interpreter's cast truncates, the GPU's rounds; this is both's ``Tensor.to(bfloat16)``."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x)


@triton.jit
def _round_trip_into_kernel(
    Z, SLOTS, OUT,
    stride_zb, stride_zg, stride_zn, stride_zr,
    stride_ob, stride_og, stride_on, stride_or,
    n_kv_heads, n_tokens,
    R: tl.constexpr, BITS: tl.constexpr, LARGEST: tl.constexpr, WINDOW: tl.constexpr, TOKENS: tl.constexpr,
):
    """Program (block of ``TOKENS`` tokens, batch row × KV head, group): ``Z``'s tokens ``t`` through log8
    codes of ``BITS`` bits and back, into entries ``SLOTS[t] mod WINDOW`` of ``OUT`` (``WINDOW == 0``:
    entries ``SLOTS[t]``)."""
    t = (tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)).to(tl.int64)
    bg = tl.program_id(1).to(tl.int64)
    grp = tl.program_id(2)
    b = bg // n_kv_heads
    g = bg % n_kv_heads
    live = t < n_tokens
    row = tl.load(SLOTS + t, mask=live, other=0).to(tl.int64)
    if WINDOW > 0:
        row = row % WINDOW
    LEVELS: tl.constexpr = (1 << BITS) - 1
    offs = grp * GROUP + tl.arange(0, GROUP)
    real = (offs < R)[None, :]
    x = tl.load(Z + b * stride_zb + g * stride_zg + t[:, None] * stride_zn + offs[None, :] * stride_zr,
                mask=live[:, None] & real, other=0.0).to(tl.float32)  # [tokens, channels]
    lo, hi = _group_range(x, real, 1)
    step, low = _log8(_log8_code(tl.maximum(tl.abs(lo), tl.abs(hi)) * (2.0 / LEVELS), LARGEST), BITS)
    step, low = step[:, None], low[:, None]
    code, _ = _grid_codes(x, low, step, LEVELS)
    # a NaN step (a group holding NaN or inf) reads back NaN, as PyTorch's does; product, then sum, each
    # rounded (the launch turns FMA contraction off): bit for bit PyTorch's two operators
    out = code * step + low
    if OUT.dtype.element_ty == tl.bfloat16:
        out = _bf16_rne(out)
    tl.store(OUT + b * stride_ob + g * stride_og + row[:, None] * stride_on + offs[None, :] * stride_or,
             out.to(OUT.dtype.element_ty), mask=live[:, None] & real)


def round_trip_into(z: torch.Tensor, slots: torch.Tensor, ring: torch.Tensor, *, bits: int = 8,
                    largest: int = 255, wrap: bool = True) -> None:
    """Latents ``z`` ``[B, G, n, r]`` through per-token log8 codes of ``bits`` bits (groups of
    :data:`QUANT_GROUP` channels) and back, token ``t`` written into ``ring`` ``[B, G, window, r]`` at entry
    ``slots[t] mod window`` (``slots`` ``[n]`` int on the device): bit for bit ``ring.index_copy_(2, slots %
    window, stiefkv.quant.round_trip(z, QuantSpec(bits, "token", log8=True)).to(ring.dtype))``, in one
    launch. How a ``window8`` store holds its tokens exact (``stiefkv.quant.held_exact``): ~90 operators
    otherwise; a decoded token into its ring entry, or a prefill chunk into a buffer of its own with
    ``wrap=False`` (entry ``slots[t]`` itself, ``< window``: one compiled kernel for every chunk length, where
    the window, a compile-time constant, would take one a length). The entries must differ (each token's
    program writes its own)."""
    B, G, n, r = z.shape
    if slots.numel() != n:
        raise ValueError(f"{n} tokens but {slots.numel()} slots")
    if ring.shape[:2] != (B, G) or ring.shape[3] != r:
        raise ValueError(f"a ring {tuple(ring.shape)} does not hold {r}-channel latents of {B} rows and {G} "
                         "KV heads")
    if n == 0:
        return
    block = 1 if n == 1 else CHUNK_TOKENS
    _round_trip_into_kernel[(-(-n // block), B * G, -(-r // QUANT_GROUP))](
        z, slots, ring, *z.stride(), *ring.stride(),
        G, n, R=r, BITS=bits, LARGEST=largest, WINDOW=ring.shape[2] if wrap else 0, TOKENS=block,
        num_warps=1 if block == 1 else 4, enable_fp_fusion=False,
    )
