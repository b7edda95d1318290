"""Quantized latents: the bit widths and group layouts a latent can be stored in, and their exact bytes.

A latent ``z`` ``[..., N, r]`` (tokens by latent channels) is stored as unsigned codes of ``bits`` bits,
packed densely (eight codes in ``bits`` bytes), with an asymmetric min–max quantizer per group:
``z ≈ code · scale + low``, ``scale`` and ``low`` in float16. Two group layouts:

- ``token``: per token over the latent channels, groups of :data:`GROUP` channels.
- ``channel`` (KIVI-style): per channel over groups of :data:`GROUP` consecutive tokens. Tokens after the
  last full group (fewer than :data:`GROUP`) stay in the latent's float dtype until their group fills.

A spec with ``recent = W`` also keeps the ``W`` most recent tokens exact (KIVI's residual): a token is
quantized once ``W`` newer tokens have arrived (for ``channel``, once its whole group has). Query ``i``
therefore reads key ``j`` exact when ``j ≥`` :func:`quantized_length` ``(i + 1)`` and quantized otherwise —
decode sees exactly that, and a forward over many tokens computes it with a band of exact keys
(:func:`exact_from`), so that one forward scores what decoding the same tokens one by one would.

A spec with ``log8`` (token layout only) quantizes each group symmetrically about zero on one 8-bit
scale per group, a power of two in eighths of an octave (:func:`log8_scale`), and no low: one byte per
group instead of four. At low ranks the float16 scale and low cost as much as the codes (rank 8 at 2 bits:
2 bytes of codes, 4 of scales per head and token); latents in rotated bases (the spreading rotation) are
near symmetric per token, so the centre the low would hold is worth less than the bytes.

A spec with ``mse`` encodes each group on the range, shrunk about its midpoint by one of
:data:`CLIP_RATIOS`, that gives the least squared error instead of the min–max range: at 2 bits this
halves the error of Gaussian-like groups, at 3 bits it cuts a fifth. Only the encoder differs; codes, scales
and dequantization are the same.

A spec with ``window8`` holds its exact tokens (the recent window, a filling group) as int8 codes per token
on log8 scales (:data:`WINDOW8`) instead of floats: a byte a channel (the codes padded to 8 channels) and a
log8 byte per 64 channels, instead of 2 bytes a channel (:func:`exact_token_bytes`). A token leaving
the window is quantized from those int8 values, so every cache and :func:`fake_quant` agree. At 6.25 % the
64 exact tokens a channel layout holds at 2048 cost a quarter of its int2 codes in bf16.

``bits=16`` is the float latent itself (bf16/fp16), stored as it is. Everything here is plain PyTorch and
runs on any device; the fused kernels over codes belong to serving (the quantized path dequantizes into
the float kernels).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

# pack's inverse and the log8 scales, shared with the kernels
from stiefkv.kernels._common import (  # noqa: F401
    LOG8_EIGHTHS,
    LOG8_NAN,
    LOG8_OFFSET,
    log8_low,
    log8_scale,
    unpack,
)

BITS = (16, 8, 4, 3, 2)
QUANT_BITS = tuple(b for b in BITS if b < 16)
LAYOUTS = ("token", "channel")
GROUP = 64  # channels per scale (token layout) and tokens per scale (channel layout)
SCALE_DTYPE = torch.float16
SCALE_BYTES = 2  # one float16 scale and one float16 low per group
FLOAT_BYTES = 2  # bf16 latents: what the budget is measured against
POSITION_BYTES = 4  # the cache's int32 position of every token, shared by all layers
REFERENCE_CONTEXT = 2048  # bytes per token are those of a cache holding this many tokens (the eval window)
DEFAULT_RECENT = 16  # exact recent tokens of calibrated caches and of the baselines (BENCHMARKS.md §1b)
CLIP_RATIOS = tuple(1.0 - 0.05 * i for i in range(11))  # ranges an mse encoder tries, as min–max fractions


@dataclass(frozen=True)
class QuantSpec:
    """How one latent is stored: ``bits`` in :data:`BITS`, ``layout`` in :data:`LAYOUTS` (unused at 16), and
    whether groups are encoded on their least-squared-error range (``mse``) or their min–max range."""

    bits: int = 16
    layout: str = "token"
    mse: bool = False
    recent: int = 0
    log8: bool = False
    window8: bool = False

    def __post_init__(self):
        if self.bits not in BITS:
            raise ValueError(f"bits must be one of {', '.join(map(str, BITS))}; got {self.bits!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}; got {self.layout!r}")
        if not isinstance(self.recent, int) or self.recent < 0:
            raise ValueError(f"recent (the exact recent tokens) must be an integer ≥ 0; got {self.recent!r}")
        if self.bits == 16:  # one name for the float latent
            object.__setattr__(self, "layout", "token")
            object.__setattr__(self, "mse", False)
            object.__setattr__(self, "recent", 0)
            object.__setattr__(self, "log8", False)
            object.__setattr__(self, "window8", False)
        if self.layout == "token" and not self.recent:  # nothing is ever held exact: one name
            object.__setattr__(self, "window8", False)
        if self.log8 and (self.layout != "token" or self.mse):
            raise ValueError("log8 scales quantize per token, symmetrically on the min–max range: not "
                             f"with the {self.layout} layout{' or mse' if self.mse else ''}")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def __str__(self) -> str:
        if not self.quantized:
            return "bf16"
        return (f"int{self.bits}-{self.layout}" + ("-mse" if self.mse else "")
                + ("-log8" if self.log8 else "") + (f"-r{self.recent}" if self.recent else "")
                + ("-w8" if self.window8 else ""))

    @classmethod
    def parse(cls, text: str) -> QuantSpec:
        """``bf16``/``16`` or ``int{bits}-{layout}[-mse][-log8][-r{recent}][-w8]`` (``int4-channel``,
        ``int2-token-mse``, ``int2-token-log8-r16``, ``int2-channel-r16-w8``), as :meth:`__str__` writes
        it."""
        if text in ("bf16", "fp16", "16"):
            return cls()
        m = re.fullmatch(r"int(\d+)(?:-([a-z]+))?(-mse)?(-log8)?(?:-r(\d+))?(-w8)?", text)
        if m is None:
            raise ValueError(f"not a latent storage spec: {text!r} "
                             "(expected bf16 or int{bits}-{layout}[-mse][-log8][-r{recent}][-w8])")
        return cls(int(m[1]), m[2] or "token", m[3] is not None, int(m[5] or 0), m[4] is not None,
                   m[6] is not None)

    def cache_bytes(self, rank: int, context: int = REFERENCE_CONTEXT) -> int:
        """Bytes one head's latent of ``rank`` channels holds in a cache of ``context`` tokens: codes (packed,
        padded to whole bytes), scales and lows, and the tokens still exact (recent, or a filling group)."""
        if not self.quantized:
            return FLOAT_BYTES * rank * context
        held = quantized_length(context, self)
        exact = (context - held) * exact_token_bytes(rank, self.window8)
        codes = held * packed_bytes(rank, self.bits)
        if self.layout == "token":
            per_group = 1 if self.log8 else 2 * SCALE_BYTES
            return codes + held * per_group * math.ceil(rank / GROUP) + exact
        return codes + (held // GROUP) * 2 * SCALE_BYTES * rank + exact

    def bytes_per_token(self, rank: int, context: int = REFERENCE_CONTEXT) -> float:
        """:meth:`cache_bytes` per token."""
        return self.cache_bytes(rank, context) / context


FLOAT = QuantSpec()
WINDOW8 = QuantSpec(8, "token", log8=True)  # how a ``window8`` spec holds its exact tokens


def exact_token_bytes(rank: int, window8: bool) -> int:
    """Bytes of one exact token of a ``rank``-channel latent: bf16, or int8 codes and a log8 byte a group."""
    return packed_bytes(rank, 8) + math.ceil(rank / GROUP) if window8 else FLOAT_BYTES * rank


def packed_bytes(n: int, bits: int) -> int:
    """Bytes of ``n`` codes of ``bits`` bits packed eight to ``bits`` bytes (the last eight padded)."""
    return math.ceil(n / 8) * bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``[..., n]`` codes below ``2**bits`` → ``[..., packed_bytes(n, bits)]`` uint8.

    Eight codes make one word of ``8 · bits`` bits (code ``i`` at bit ``bits · i``), written as ``bits``
    little-endian bytes; one scheme for 2, 3, 4 and 8 bits, exact in bytes for 3 bits too.
    """
    if bits == 8 or bits == 4:  # byte-wise, no 64-bit words: one to three operators (decode writes a token)
        c = codes.to(torch.uint8, memory_format=torch.contiguous_format, copy=True)  # never the caller's
        if c.shape[-1] % 8:
            c = torch.nn.functional.pad(c, (0, -c.shape[-1] % 8))
        return c if bits == 8 else c[..., 0::2] | (c[..., 1::2] << 4)
    return _pack_words(codes, bits)


def _pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack` for any width, by 64-bit words of eight codes."""
    n = codes.shape[-1]
    pad = -n % 8
    c = torch.nn.functional.pad(codes.to(torch.int64), (0, pad)).unflatten(-1, (-1, 8))
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1, keepdim=True)
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((word >> byte_shifts) & 0xFF).to(torch.uint8).flatten(-2)


@dataclass
class Quantized:
    """Codes and per-group ``scale``/``low`` of a ``[..., N, r]`` latent (no window: full groups only).

    ``token``: ``scale``/``low`` ``[..., N, ceil(r / GROUP)]``; ``channel``: ``[..., N / GROUP, r]``. Log8
    scales (:func:`log8_scale`): ``scale`` holds the uint8 codes and ``low`` is None (symmetric groups).
    """

    codes: torch.Tensor  # [..., N, packed_bytes(r, bits)] uint8
    scale: torch.Tensor
    low: torch.Tensor | None
    bits: int
    layout: str
    rank: int

    @property
    def length(self) -> int:
        return self.codes.shape[-2]

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + (0 if self.low is None else self.low.nbytes)

    def apply(self, fn) -> Quantized:
        """The same codes with ``fn`` applied to each tensor (row selection, slicing along dim 0)."""
        low = None if self.low is None else fn(self.low)
        return Quantized(fn(self.codes), fn(self.scale), low, self.bits, self.layout, self.rank)

    def float_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's ``scale`` and ``low`` as float32 (for log8 scales, the power of two and the
        symmetric grid's low ``-scale · levels / 2``)."""
        if self.low is not None:
            return self.scale.float(), self.low.float()
        scale = log8_scale(self.scale)
        return scale, log8_low(scale, self.bits)


# per width, the largest log8 code whose grid's low is a finite float16 (groups needing a larger step clip,
# as a float16 scale and low cannot hold them either)
LOG8_LARGEST = {b: int(torch.nonzero(log8_scale(torch.arange(LOG8_NAN)) * ((1 << b) - 1) / 2 <= 65504).max())
                for b in (2, 3, 4, 8)}


def log8_code(step: torch.Tensor, bits: int) -> torch.Tensor:
    """The uint8 log8 code of the smallest representable scale ≥ ``step`` (float32) at ``bits`` bits: clamped
    to :data:`LOG8_LARGEST` (a larger step clips), :data:`LOG8_NAN` where ``step`` is not finite. Exact
    comparisons, no logarithm."""
    m, e = torch.frexp(step.float().clamp(min=2.0 ** -14))  # step = (2m) · 2^(e − 1), 2m in [1, 2)
    j = sum((2 * m > c).long() for c in LOG8_EIGHTHS)  # the first mantissa ≥ 2m (8: the next octave's first)
    k = (8 * (e.long() - 1) + j + LOG8_OFFSET).clamp_(0, LOG8_LARGEST[bits])
    return torch.where(torch.isfinite(step), k, LOG8_NAN).to(torch.uint8)


def _group_range(x: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` viewed with groups on a dedicated axis, and its per-group min and max (float32).

    ``token``: ``[..., N, g, GROUP]`` (a short last group padded with copies of its last channel, so its
    range is its own); ``channel``: ``[..., N / GROUP, GROUP, r]``.
    """
    x = x.float()
    if layout == "channel":
        g = x.unflatten(-2, (-1, GROUP))
        return g, g.amin(-2, keepdim=True), g.amax(-2, keepdim=True)
    r = x.shape[-1]
    pad = -r % GROUP
    if pad:  # repeat the last channel: the padded group's min and max are those of its real channels
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], -1)
    g = x.unflatten(-1, (-1, GROUP))
    return g, g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)


def _grid(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float16 ``low`` and ``scale`` of the range ``[lo, hi]``, and the float32 step codes divide by."""
    low = lo.to(SCALE_DTYPE)
    # by a tensor, not a Python number: CUDA divides by a number as a product with its reciprocal, a bit off
    # the CPU's (and the quantize-on-write kernel's) quotient on float16 ties
    scale = ((hi - low.float()) / torch.full_like(hi, levels)).to(SCALE_DTYPE)
    # a constant group (scale 0) quantizes to code 0 and comes back exactly as its low
    step = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    return low, scale, step


def _mse_range(g: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, levels: int, dim: int,
               real: torch.Tensor | None = None):
    """Each group's range among the min–max range shrunk about its midpoint by :data:`CLIP_RATIOS` that
    quantizes ``g`` with the least squared error (over ``dim``, the group's axis; ``real`` masks out the
    padding of a short last group)."""
    mid, half = (lo + hi) / 2, (hi - lo) / 2
    best_err = best_lo = best_hi = None
    for ratio in CLIP_RATIOS:
        c_lo, c_hi = mid - ratio * half, mid + ratio * half
        low, _, step = _grid(c_lo, c_hi, levels)
        deq = torch.round((g - low.float()) / step).clamp_(0, levels) * step + low.float()
        err = (deq - g).pow_(2)
        err = (err if real is None else err * real).sum(dim, keepdim=True)
        if best_err is None:
            best_err, best_lo, best_hi = err, c_lo, c_hi
            continue
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_lo, best_hi = torch.where(better, c_lo, best_lo), torch.where(better, c_hi, best_hi)
    return best_lo, best_hi


def _encode(x: torch.Tensor, spec: QuantSpec):
    """``x``'s groups (:func:`_group_range`) as float codes, with each group's stored scale and low (None for
    log8) and the float32 scale and low that dequantizing multiplies and adds."""
    if not spec.quantized:
        raise ValueError("a bf16 latent is not quantized")
    if not x.is_floating_point():
        raise TypeError(f"quantize takes a float latent, got {x.dtype}")
    r = x.shape[-1]
    if spec.layout == "channel" and x.shape[-2] % GROUP:
        raise ValueError(f"the channel layout quantizes whole groups of {GROUP} tokens; got {x.shape[-2]}")
    g, lo, hi = _group_range(x, spec.layout)
    levels = (1 << spec.bits) - 1
    if spec.mse and spec.layout == "channel":
        lo, hi = _mse_range(g, lo, hi, levels, -2)
    elif spec.mse:
        real = (torch.arange(g.shape[-2] * GROUP, device=g.device) < r).view(g.shape[-2], GROUP)
        lo, hi = _mse_range(g, lo, hi, levels, -1, real if r % GROUP else None)
    if spec.log8:
        scale = log8_code(torch.maximum(lo.abs(), hi.abs()) * (2 / levels), spec.bits)
        step = log8_scale(scale)
        low = log8_low(step, spec.bits)
        read = step, low
    else:
        low, scale, step = _grid(lo, hi, levels)
        read = scale.float(), low.float()
    # + 0: a code rounded from a tiny negative is −0, which unpacked codes never are (round_trip's zeros
    # would carry its sign)
    codes = torch.round((g - read[1]) / step).clamp_(0, levels).add_(0.0)
    return codes, scale, None if spec.log8 else low, read


def quantize(x: torch.Tensor, spec: QuantSpec) -> Quantized:
    """``x`` ``[..., N, r]`` (``N`` a multiple of :data:`GROUP` for ``channel``) → :class:`Quantized`.

    The float16 scale and low are rounded first and the codes computed with the rounded values, so that
    dequantizing gives the nearest representable value of each group's grid.
    """
    codes, scale, low, _ = _encode(x, spec)
    r = x.shape[-1]
    if spec.layout == "channel":
        codes = codes.flatten(-3, -2)
        scale, low = scale.squeeze(-2), None if low is None else low.squeeze(-2)
    else:
        codes = codes.flatten(-2)[..., :r]
        scale, low = scale.squeeze(-1), None if low is None else low.squeeze(-1)
    return Quantized(pack(codes, spec.bits), scale, low, spec.bits, spec.layout, r)


def round_trip(x: torch.Tensor, spec: QuantSpec, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``dequantize(quantize(x, spec), dtype)`` (``x``'s dtype by default), the same bits, without packing
    the codes or rebuilding the scales: what calibration and one-forward evaluation read many times a step,
    and on a GPU every launch saved counts."""
    codes, _, _, (scale, low) = _encode(x, spec)
    out = codes * scale + low
    out = out.flatten(-3, -2) if spec.layout == "channel" else out.flatten(-2)[..., :x.shape[-1]]
    return out.to(x.dtype if dtype is None else dtype)


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[..., N, r]`` in ``dtype``: ``code · scale + low`` of each group, computed in float32."""
    codes = unpack(q.codes, q.bits, q.rank).float()
    scale, low = q.float_scales()
    if q.layout == "channel":
        out = codes.unflatten(-2, (-1, GROUP)) * scale.unsqueeze(-2) + low.unsqueeze(-2)
        return out.flatten(-3, -2).to(dtype)
    scale = scale.repeat_interleave(GROUP, -1)[..., : q.rank]
    low = low.repeat_interleave(GROUP, -1)[..., : q.rank]
    return (codes * scale + low).to(dtype)


def quantized_length(n, spec: QuantSpec):
    """How many of ``n`` tokens a cache of ``spec`` holds as codes: all but the ``recent`` newest (and, for
    ``channel``, but a group still filling); the rest stays exact. ``n`` is an int or an int tensor."""
    n = n - spec.recent if spec.quantized else n * 0
    n = n.clamp(min=0) if isinstance(n, torch.Tensor) else max(0, n)
    return n if spec.layout == "token" else n // GROUP * GROUP


def exact_from(query_index: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """For queries at key indices ``query_index`` (int tensor), the first key index each reads exact:
    :func:`quantized_length` of the cache that held keys ``0 … i`` when query ``i`` was decoded."""
    return quantized_length(query_index + 1, spec)


def fake_quant(x: torch.Tensor, spec: QuantSpec, *, straight_through: bool = False,
               held: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[..., N, r]`` as a cache of ``spec`` returns it after holding all ``N`` tokens: quantized and
    dequantized, but for the tokens it still holds exact (:func:`quantized_length`), in ``x``'s dtype.

    ``straight_through`` makes the gradient pass as if the quantizer were the identity (the
    straight-through estimator), so bases can be trained for the bits they will be stored in. ``held`` is
    :func:`held_exact` of ``x`` where the caller has it already (it reads the exact band from it too).
    """
    if not spec.quantized:
        return x
    if spec.window8:
        x = held_exact(x, spec, straight_through=straight_through) if held is None else held
    n = quantized_length(x.shape[-2], spec)
    if n == 0:
        return x
    head = x[..., :n, :]
    deq = round_trip(head.detach(), spec)
    if straight_through:
        deq = head + (deq - head).detach()
    return deq if n == x.shape[-2] else torch.cat([deq, x[..., n:, :]], -2)


def held_exact(x: torch.Tensor, spec: QuantSpec, *, straight_through: bool = False) -> torch.Tensor:
    """``x`` ``[..., N, r]`` as a cache of ``spec`` holds the tokens it keeps exact, in ``x``'s dtype: ``x``
    itself, or for ``window8`` its int8 codes dequantized (per token, so a token's value never depends on its
    neighbours: chunked and whole appends agree)."""
    if not spec.window8 or x.shape[-2] == 0:
        return x
    held = round_trip(x.detach(), WINDOW8)
    return x + (held - x).detach() if straight_through else held
