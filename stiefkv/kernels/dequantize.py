"""Codes back to floats in one pass: :class:`QuantizedLatents` → ``[B, G, N, rank]`` in the queries' dtype.

The prefill over codes attends a dequantized copy of the held latents (slice by slice; the in-register
path hit an illegal memory access in 128-row prefill tiles on the H200, ``lowrank.py``). Done with PyTorch
operators (:meth:`QuantizedLatents.dequantize`: int64 codes, float32 scales repeated per channel, several
passes over each), that copy cost ~1.1 of the 1.49 s a prefill forward of 43 rows × 95 tokens took behind
32k held tokens of a 12.5 % cache (H200, ``profile_serve_step.py --prefill``): ~75 % of the prefill. Here one
program reads ``BLOCK`` output elements' codes and scales and writes them once.

Element ``(token t, channel c)`` of a row is code ``c`` (bits ``bits·c … bits·c + bits − 1`` of the row's
little-endian bytes, ``stiefkv.quant.pack``: a 3-bit code may straddle two bytes) times its group's scale
plus its low (per token and group of :data:`QUANT_GROUP` channels, or per channel and group of tokens in
the channel layout; from the log8 code with ``log8``), computed in float32 as the reference does, then
rounded to the output dtype (to nearest, ties to even, on the interpreter too). Every index is flat and
one-dimensional, so no load is masked in two dimensions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from stiefkv.kernels._common import QUANT_GROUP, QuantizedLatents, interpreting
from stiefkv.kernels.lowrank import _log8

GROUP = tl.constexpr(QUANT_GROUP)
BLOCK = 1024  # output elements a program: a memory-bound pass, tiles only need to be wide


@triton.jit
def _to_bf16(x):
    """float32 → bfloat16 rounded to nearest, ties to even, in integer arithmetic: as the GPU and torch
    round, where Triton's interpreter truncates (a bias that moved prefill outputs past the tests'
    tolerance). NaN stays NaN (its payload could round up into infinity)."""
    bits = x.to(tl.int32, bitcast=True)
    up = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    up = tl.where(x != x, 0x7FC0, up)
    return up.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _dequantize_fwd(Z, S, L, OUT, N, G,
                    stride_zb, stride_zg, stride_zn, stride_zr, stride_sb, stride_sg, stride_sn, stride_sc,
                    R: tl.constexpr, W: tl.constexpr, BITS: tl.constexpr, CH: tl.constexpr,
                    LOG8: tl.constexpr, BLOCK_E: tl.constexpr,
                    SLOTS=None, NEWEST=None, FIRST=None, RING=None,
                    stride_rb=0, stride_rg=0, stride_rn=0, stride_rr=0,
                    HAS_SLOTS: tl.constexpr = False, HAS_RING: tl.constexpr = False,
                    WINDOW: tl.constexpr = 1):
    # one (batch row, KV head) a program row: its base offsets in 64 bits, the rest in 32 (the first
    # version's 64-bit divisions per element ran at a tenth of the copy bandwidth), R a constant divisor.
    # HAS_SLOTS: output row t is slot SLOTS[t]; HAS_RING: rows with NEWEST[t] ≥ FIRST[0] (tokens the store
    # holds exact) come from ring entry SLOTS[t] mod WINDOW instead of the codes
    bg = tl.program_id(1)
    b, g = (bg // G).to(tl.int64), (bg % G).to(tl.int64)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    c = e % W  # channels R … W − 1 (the prefill tiles' padding) are written as 0
    t = e // W
    inside = e < N * W
    ok = inside & (c < R)
    if HAS_SLOTS:
        t = tl.load(SLOTS + t, mask=inside, other=0).to(tl.int32)
    bit = c * BITS
    row = Z + b * stride_zb + g * stride_zg + t * stride_zn
    word = tl.load(row + (bit // 8) * stride_zr, mask=ok, other=0).to(tl.int32)
    if BITS == 3:  # codes 2 and 5 of each eight cross a byte boundary
        spill = ok & ((bit % 8) + BITS > 8)
        word = word | (tl.load(row + (bit // 8 + 1) * stride_zr, mask=spill, other=0).to(tl.int32) << 8)
    code = ((word >> (bit % 8)) & ((1 << BITS) - 1)).to(tl.float32)
    head = S + b * stride_sb + g * stride_sg
    if CH:  # scales [B, G, token groups, rank]
        at = (t // GROUP) * stride_sn + c * stride_sc
    else:  # scales [B, G, N, channel groups]
        at = t * stride_sn + (c // GROUP) * stride_sc
    if LOG8:
        scale, low = _log8(tl.load(head + at, mask=ok, other=0), BITS)
    else:
        scale = tl.load(head + at, mask=ok, other=0.0).to(tl.float32)
        low = tl.load(L + b * stride_sb + g * stride_sg + at, mask=ok, other=0.0).to(tl.float32)
    z = tl.where(ok, code * scale + low, 0.0)
    if HAS_RING:
        exact = ok & (tl.load(NEWEST + e // W, mask=inside, other=-1) >= tl.load(FIRST + e * 0))
        held = tl.load(RING + b * stride_rb + g * stride_rg + (t % WINDOW) * stride_rn + c * stride_rr,
                       mask=exact, other=0.0)
        z = tl.where(exact, held.to(tl.float32), z)
    if OUT.dtype.element_ty == tl.bfloat16:
        z = _to_bf16(z)
    tl.store(OUT + bg.to(tl.int64) * N * W + e, z.to(OUT.dtype.element_ty), mask=inside)


def dequantize_latents(z: QuantizedLatents, dtype: torch.dtype, width: int | None = None) -> torch.Tensor:
    """``z`` as ``[B, G, N, width]`` floats in ``dtype`` (contiguous; ``width`` ≥ the rank, the rank by
    default, channels past the rank 0: the padded width the prefill tiles read, written in the same pass):
    the Triton pass on CUDA or under the interpreter, :meth:`QuantizedLatents.dequantize` (the reference)
    elsewhere. Equal to the reference but where the device fuses the multiply and add (one float32
    rounding fewer)."""
    B, G, N, R = z.shape
    width = R if width is None else width
    if width < R:
        raise ValueError(f"width {width} is narrower than the latents' rank {R}")
    if z.codes.device.type != "cuda" and not interpreting():
        out = z.dequantize(dtype)
        return out if width == R else F.pad(out, (0, width - R))
    out = torch.empty(B, G, N, width, dtype=dtype, device=z.codes.device)
    if out.numel() == 0:
        return out
    scale, low = z.scale, (z.scale if z.low is None else z.low)  # log8: the scale codes give the low
    if low.stride() != scale.stride():  # the kernel reads both with the scales' strides
        scale, low = scale.contiguous(), low.contiguous()
    _dequantize_fwd[(triton.cdiv(N * width, BLOCK), B * G)](
        z.codes, scale, low, out, N, G, *z.codes.stride(), *scale.stride(),
        R=R, W=width, BITS=z.bits, CH=z.layout == "channel", LOG8=z.log8, BLOCK_E=BLOCK)
    return out


def dequantize_at(z: QuantizedLatents, slots: torch.Tensor, dtype: torch.dtype, *,
                  ring: torch.Tensor | None = None, newest: torch.Tensor | None = None,
                  first_exact: torch.Tensor | None = None) -> torch.Tensor:
    """The latents the codes of ``slots`` ``[W]`` (int, on the device) stand for, ``[B, G, W, rank]`` in
    ``dtype`` (computed in float32): :class:`QuantizedLatents` ``.tokens`` at those slots dequantized, in one
    launch. With ``ring`` ``[B, G, window, rank]`` (a windowed store's exact tokens), the rows whose
    ``newest`` ``[W]`` is at or past ``first_exact`` ``[1]`` (the tokens the store holds exact) are its ring
    entries ``slots mod window`` instead: a split decode's ring side of one latent (``static_cache``), bit
    for bit the PyTorch gathers, dequantization and ``where`` (~35 operators), multiply and add rounded
    apart as PyTorch's. Triton only: CUDA tensors, or the CPU under the interpreter."""
    B, G, _, R = z.shape
    n = slots.numel()
    if (ring is None) != (newest is None) or (ring is None) != (first_exact is None):
        raise ValueError("a ring overlay takes ring, newest and first_exact together")
    if ring is not None and (ring.shape[:2] != (B, G) or ring.shape[3] != R or newest.numel() != n):
        raise ValueError(f"a ring {tuple(ring.shape)} with {newest.numel()} newest slots does not overlay "
                         f"{n} slots of {R}-channel latents of {B} rows and {G} KV heads")
    out = torch.empty(B, G, n, R, dtype=dtype, device=z.codes.device)
    if out.numel() == 0:
        return out
    scale, low = z.scale, (z.scale if z.low is None else z.low)
    if low.stride() != scale.stride():
        scale, low = scale.contiguous(), low.contiguous()
    extra = {}
    if ring is not None:
        extra = dict(NEWEST=newest, FIRST=first_exact, RING=ring, stride_rb=ring.stride(0),
                     stride_rg=ring.stride(1), stride_rn=ring.stride(2), stride_rr=ring.stride(3),
                     HAS_RING=True, WINDOW=ring.shape[2])
    _dequantize_fwd[(triton.cdiv(n * R, BLOCK), B * G)](
        z.codes, scale, low, out, n, G, *z.codes.stride(), *scale.stride(),
        R=R, W=R, BITS=z.bits, CH=z.layout == "channel", LOG8=z.log8, BLOCK_E=BLOCK,
        SLOTS=slots, HAS_SLOTS=True, enable_fp_fusion=False, **extra)
    return out
