"""What the kernels, their launchers and the references share: constants, the rope spec, small host helpers.

Imports only the standard library and torch, never Triton, so that ``reference.py`` and the package's
dispatch work where Triton is not installed.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch

KEY_MODES = ("pre_rope", "post_rope")
# The kernels exponentiate in base 2 (``exp2`` is one hardware instruction): logits are multiplied by
# log₂e on the way in and results in log2 units by ln 2 on the way out.
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
MIN_DOT = 16  # tl.dot's smallest tile side: padded head dims, ranks and row tiles are at least this


class RopeSpec(NamedTuple):
    """What a kernel needs to rotate a key at its own position.

    ``inv_freq`` ``[d/2]`` float32 are the model's inverse frequencies after any rope-type adjustment
    (default, linear, llama3, …); ``attention_scaling`` multiplies cos and sin, as transformers does.
    The rotation follows transformers' ``rotate_half`` convention: for ``x = [x1, x2]`` (halves),
    ``rot(x) = [x1·cos − x2·sin, x2·cos + x1·sin]``.
    """

    inv_freq: torch.Tensor
    attention_scaling: float = 1.0


class ExactTail(NamedTuple):
    """The exact latents behind a quantized cache's last keys, and where each query starts reading them.

    A cache that quantizes a token only once newer tokens have arrived shows each query its own recent keys
    exact. ``z_k`` ``[B, G, Ne, r_k]`` and ``z_v`` ``[B, G, Ne, r_v]`` are the exact latents of the last
    ``Ne`` keys; query ``i`` reads key ``j`` from them when ``j ≥ key_from[i]`` (``value_from[i]`` for the
    values; ``[Nq]`` key indices, at least ``Nk − Ne``) and from the quantized ``z_k``/``z_v`` below that.
    """

    z_k: torch.Tensor
    z_v: torch.Tensor
    key_from: torch.Tensor
    value_from: torch.Tensor


def check_prior(prior, q: torch.Tensor, width: int) -> None:
    """A ``prior=`` argument: an output ``[B, H, Nq, width]`` (``d`` with ``P_v``, else ``r_v``) and its
    log-sum-exp ``[B, H, Nq]`` on the queries' device; a clear error otherwise."""
    if not (isinstance(prior, (tuple, list)) and len(prior) == 2
            and all(isinstance(t, torch.Tensor) for t in prior)):
        raise ValueError("prior= must be a pair (o, lse) of tensors: an attention's output and its "
                         "log-sum-exp (lowrank_attention(..., return_lse=True))")
    o, lse = prior
    B, H, Nq, _ = q.shape
    if tuple(o.shape) != (B, H, Nq, width) or tuple(lse.shape) != (B, H, Nq):
        raise ValueError(f"prior= must be an output [B, H, Nq, {width}] = {(B, H, Nq, width)} and its "
                         f"log-sum-exp [B, H, Nq], got {tuple(o.shape)} and {tuple(lse.shape)}")
    if o.device != q.device or lse.device != q.device:
        raise ValueError(f"prior= must be on the queries' device {q.device}, got {o.device} and {lse.device}")


def merge_prior(prior, o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype, return_lse: bool):
    """An attention ``o``, ``lse`` over some keys merged with a ``prior`` ``(o, lse)`` over others (what
    ``prior=`` asks where no kernel continues the softmax): the output, and the joint log-sum-exp when
    ``return_lse``."""
    merged = merge_by_lse(prior[0], prior[1], o, lse, dtype)
    return (merged, torch.logaddexp(prior[1].float(), lse)) if return_lse else merged


def merge_by_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor,
                 dtype: torch.dtype) -> torch.Tensor:
    """Attention over two disjoint key sets from each one's output ``[..., n, r]`` and log-sum-exp
    ``[..., n]``: ``(e^{ℓ₁} o₁ + e^{ℓ₂} o₂) / (e^{ℓ₁} + e^{ℓ₂}) = o₂ + σ(ℓ₁ − ℓ₂)·(o₁ − o₂)``, in float32, in
    ``dtype``. A side with no visible key (ℓ = −inf) weighs nothing; a row with none on either side is 0
    (as each side's output is there)."""
    l1, l2 = l1.float(), l2.float()
    empty = (l1 == float("-inf")) & (l2 == float("-inf"))  # no key on either side: weight 0, not NaN
    w1 = torch.where(empty, 0.0, torch.sigmoid(l1 - l2))[..., None]  # a NaN stays NaN
    return torch.lerp(o2.float(), o1.float(), w1).to(dtype)


LOG8_OFFSET = 112  # a log8 code k is the scale 2^((k − 112) / 8), from 2^-14 (float16's smallest normal)
LOG8_NAN = 255  # the code of a group that is not finite: it dequantizes to NaN
# the mantissas of log8 scales over one octave, rounded to float16: every scale is then a float16 exactly,
# so the static stores and kernels read what the dynamic cache does. Python floats, not a tensor:
# quantizing inside a captured CUDA graph (the static cache's decode) may not copy to the device.
LOG8_EIGHTHS = torch.tensor([2.0 ** (j / 8) for j in range(8)]).half().float().tolist()


def log8_scale(k: torch.Tensor) -> torch.Tensor:
    """The float32 scale ``2^((k − LOG8_OFFSET) / 8)`` (its mantissa rounded to float16) of uint8 log8 codes
    ``k`` (NaN for :data:`LOG8_NAN`): a mantissa picked from eight constants times a power of two, so every
    device and shape gives the same bits (``exp2`` does not). The kernels compute the same (``_log8``)."""
    k = k.long()
    e = k - LOG8_OFFSET
    eighth = e % 8
    mantissa = torch.full(k.shape, LOG8_EIGHTHS[0], dtype=torch.float32, device=k.device)
    for j in range(1, 8):
        mantissa = torch.where(eighth == j, LOG8_EIGHTHS[j], mantissa)
    scale = torch.ldexp(mantissa, torch.div(e, 8, rounding_mode="floor").float())
    return torch.where(k == LOG8_NAN, float("nan"), scale)


def log8_low(scale: torch.Tensor, bits: int) -> torch.Tensor:
    """The symmetric grid's low, ``-scale · levels / 2``, rounded to float16 as the static stores hold it."""
    return (scale * (-((1 << bits) - 1) / 2)).to(torch.float16).float()


class QuantizedLatents(NamedTuple):
    """Latents ``[B, G, N, rank]`` stored as unsigned codes: ``z = code · scale + low``, per token over groups
    of :data:`QUANT_GROUP` channels (``layout="token"``) or per channel over groups of :data:`QUANT_GROUP`
    tokens (``"channel"``), as ``stiefkv.quant`` lays them out.

    ``codes`` ``[B, G, N, ceil(rank / 8) · bits]`` uint8, eight codes in ``bits`` bytes, code ``i`` at bit
    ``bits · i`` (``stiefkv.quant.pack``); ``scale`` and ``low`` float16, ``[B, G, N, ceil(rank /
    QUANT_GROUP)]`` (token) or ``[B, G, ≥ ceil(N / QUANT_GROUP), rank]`` (channel); ``bits`` in
    :data:`KERNEL_BITS`. With ``log8`` (token layout), ``scale`` holds each group's uint8 log8 code
    (:func:`log8_scale`; one byte a group) and ``low`` is None: the grid is symmetric, its low
    :func:`log8_low`.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None
    bits: int
    rank: int
    layout: str = "token"
    log8: bool = False

    def float_scales(self, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(scale, low)`` of the groups ``rows`` (an index along the third axis)."""
        if self.log8:
            scale = log8_scale(self.scale[:, :, rows])
            return scale, log8_low(scale, self.bits)
        return self.scale[:, :, rows].float(), self.low[:, :, rows].float()

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.codes.shape[:3], self.rank))

    def tokens(self, a: int, c: int) -> QuantizedLatents:
        """Tokens ``[a, c)`` (``a`` a multiple of :data:`QUANT_GROUP` for the channel layout, whose scales are
        per group of tokens)."""
        if self.layout == "channel":
            if a % QUANT_GROUP:
                raise ValueError(f"a channel-layout slice starts at a multiple of {QUANT_GROUP}; got {a}")
            rows = slice(a // QUANT_GROUP, -(-c // QUANT_GROUP))
        else:
            rows = slice(a, c)
        return self._replace(codes=self.codes[:, :, a:c], scale=self.scale[:, :, rows],
                             low=self.low[:, :, rows] if self.low is not None else None)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def dequantize(self, dtype: torch.dtype = torch.float32, tokens: int = 2048) -> torch.Tensor:
        """``[B, G, N, rank]`` in ``dtype`` (computed in float32), as the kernel dequantizes in registers;
        ``tokens`` at a time, so that the float32 and integer intermediates stay a slice's, not the cache's
        (unpacked whole, int4 codes of a 23-row 32k cache took 9 GiB beside an 11.5 GiB cache)."""
        B, G, N, _ = self.shape
        out = torch.empty(B, G, N, self.rank, dtype=dtype, device=self.codes.device)
        tokens = -(-tokens // QUANT_GROUP) * QUANT_GROUP  # whole token groups per slice
        for start in range(0, N, tokens):
            part = slice(start, start + tokens)
            codes = unpack(self.codes[:, :, part], self.bits, self.rank).float()
            if self.layout == "channel":
                n = codes.shape[2]
                scale, low = self.float_scales(slice(start // QUANT_GROUP, -(-(start + n) // QUANT_GROUP)))
                scale = scale.repeat_interleave(QUANT_GROUP, 2)[:, :, :n]
                low = low.repeat_interleave(QUANT_GROUP, 2)[:, :, :n]
            else:
                scale, low = self.float_scales(part)
                scale = scale.repeat_interleave(QUANT_GROUP, -1)[..., : self.rank]
                low = low.repeat_interleave(QUANT_GROUP, -1)[..., : self.rank]
            out[:, :, part] = codes * scale[..., : self.rank] + low[..., : self.rank]
        return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of ``stiefkv.quant.pack``: ``[..., packed_bytes(n, bits)]`` uint8 → ``[..., n]`` int64 codes.
    Here, beside the kernels' readers of the format, since the kernels import nothing from the rest."""
    if bits == 8:
        return packed[..., :n].to(torch.int64)
    if bits == 4:  # byte by byte: code 2j in the low nibble of byte j, 2j + 1 in the high one
        return torch.stack((packed & 15, packed >> 4), -1).flatten(-2)[..., :n].to(torch.int64)
    b = packed[..., :-(-n // 8) * bits].to(torch.int64).unflatten(-1, (-1, bits))  # whole words, none past
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (b << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    return ((word >> shifts) & ((1 << bits) - 1)).flatten(-2)[..., :n]


QUANT_GROUP = 64
KERNEL_BITS = (8, 4, 3, 2)  # code widths the Triton kernels dequantize in registers


def min_code_bytes(rank: int, bits: int) -> int:
    """The fewest bytes a token's ``rank`` codes of ``bits`` can be read from: whole bytes at 8 and 4 bits,
    whole words of eight codes (``bits`` bytes) at the other widths (``stiefkv.quant.pack`` writes whole
    words at every width)."""
    if bits == 8:
        return rank
    return -(-rank // 2) if bits == 4 else -(-rank // 8) * bits


def check_codes(z: QuantizedLatents, name: str) -> None:
    """Refuse :class:`QuantizedLatents` (named ``name``, e.g. ``z_k``) that do not hold the format they
    declare: the kernel and the reference read the same codes, scales and lows, so both run this check."""
    if z.bits not in KERNEL_BITS or isinstance(z.bits, bool):
        raise ValueError(f"{name}.bits: codes of {' or '.join(map(str, KERNEL_BITS))} bits (stiefkv.quant's "
                         f"widths), got {z.bits!r}")
    if z.layout not in ("token", "channel"):
        raise ValueError(f"{name}.layout must be 'token' or 'channel', got {z.layout!r}")
    if not isinstance(z.codes, torch.Tensor) or z.codes.dim() != 4:
        raise ValueError(f"{name}.codes must be a 4-D uint8 tensor [B, G, N, bytes], got "
                         f"{getattr(z.codes, 'shape', type(z.codes).__name__)}")
    B, G, N, r = z.shape
    need = min_code_bytes(r, z.bits)
    if z.codes.dtype != torch.uint8 or z.codes.shape[3] < need:
        raise ValueError(f"{name}.codes must be uint8 [B, G, N, ≥ {need}] for rank {r} at {z.bits} bits, got "
                         f"{z.codes.dtype} {tuple(z.codes.shape)}")
    if z.log8 and z.layout != "token":
        raise ValueError(f"{name}: log8 scale codes are per token (layout 'token'), got {z.layout!r}")
    shape = (B, G, N, -(-r // QUANT_GROUP)) if z.layout == "token" else (B, G, -(-N // QUANT_GROUP), r)
    parts = (("scale", torch.uint8),) if z.log8 else (("scale", torch.float16), ("low", torch.float16))
    for part, dtype in parts:
        t = getattr(z, part)
        if not isinstance(t, torch.Tensor) or t.dim() != 4 or tuple(t.shape[:2]) != shape[:2] \
                or t.shape[3] != shape[3] or t.shape[2] < shape[2] or t.dtype != dtype:
            kind = f"{z.layout} layout" + (", log8 codes" if z.log8 else "")
            raise ValueError(f"{name}.{part} must be {str(dtype).removeprefix('torch.')} {list(shape)} "
                             f"({kind}), got {getattr(t, 'dtype', None)} {tuple(getattr(t, 'shape', ()))}")
    if z.codes.device != z.scale.device or (z.low is not None and z.low.device != z.codes.device):
        raise ValueError(f"{name}: codes, scale and low must be on one device, got {z.codes.device}, "
                         f"{z.scale.device}" + ("" if z.low is None else f", {z.low.device}"))


class CodesAndBand:
    """Latents ``[B, G, N, r]`` of a prefill forward over a static cache's codes: the first ``split`` as
    :class:`QuantizedLatents` (``below``), the rest — the forward's exact band and the codes inside it — as
    floats (``band``). The kernels' below-and-band path reads the codes in slices (``lowrank.py``'s prefill
    over codes) and the band as floats; a whole dequantized copy of every held token a forward (what a
    windowed store's prefill read before: at 27 rows × 32k KIVI-2 ran out of memory on it) is never made.
    Sliced at the split or inside the band; any other read (the reference's) gets it whole
    (:meth:`materialize`)."""

    __slots__ = ("below", "band")

    def __init__(self, below: QuantizedLatents, band: torch.Tensor):
        self.below, self.band = below, band

    @property
    def split(self) -> int:
        return self.below.shape[2]

    @property
    def shape(self) -> torch.Size:
        B, G, n, r = self.band.shape
        return torch.Size((B, G, self.split + n, r))

    @property
    def dtype(self) -> torch.dtype:
        return self.band.dtype

    @property
    def device(self) -> torch.device:
        return self.band.device

    def materialize(self) -> torch.Tensor:
        return torch.cat([dequantized(self.below, self.band.dtype), self.band], 2)

    def __getitem__(self, index):
        whole = slice(None)
        token_slice = (isinstance(index, tuple) and len(index) == 3
                       and all(isinstance(i, slice) for i in index) and index[0] == whole
                       and index[1] == whole and index[2].step is None)
        if token_slice:
            a, c, _ = index[2].indices(self.shape[2])
            if a == 0 and c == self.split:
                return self.below
            if a >= self.split:
                return self.band[:, :, a - self.split: max(a, c) - self.split]
        return self.materialize()[index]


def dequantized(z: QuantizedLatents, dtype: torch.dtype) -> torch.Tensor:
    """``z`` as floats in ``dtype``: in one Triton pass where Triton runs (CUDA, or its interpreter), else
    the reference, so that a CPU without Triton (an optional extra) never imports it."""
    if z.codes.device.type == "cuda" or interpreting():
        from .dequantize import dequantize_latents

        return dequantize_latents(z, dtype)
    return z.dequantize(dtype)


def as_float_latents(z, dtype: torch.dtype) -> torch.Tensor:
    """``z`` itself, or :class:`QuantizedLatents` (or :class:`CodesAndBand`) dequantized to ``dtype``."""
    if isinstance(z, CodesAndBand):
        return z.materialize().to(dtype)
    return z.dequantize(dtype) if isinstance(z, QuantizedLatents) else z


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).

    Triton reads the variable when it decorates a kernel, at the import of the kernel module; a launcher
    reads it again to adapt to the interpreter (tiny autotuning space, no hardware sin/cos, bf16 dots).
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def padded_dim(n: int) -> int:
    """Tile width for a head dim or a rank ``n``: the next power of two, at least :data:`MIN_DOT`."""
    return max(MIN_DOT, 1 << max(n - 1, 0).bit_length())


def check_kl_inputs(q_t, k_t, q_s, k_s) -> None:
    """The shapes StreamKL's teacher and student must agree on, whichever backend computes it: one device,
    ``[B, heads, tokens, head_dim]`` each, queries alike in ``[B, H, Nq]``, keys alike in ``B`` and ``Nk``,
    each key's head dim its queries', query heads a multiple of each side's key heads (a mismatch
    broadcast silently in the materialised reference, down to a KL below zero)."""
    devices = {t.device for t in (q_t, k_t, q_s, k_s)}
    if len(devices) > 1:
        raise ValueError("attention_kl needs all four tensors on one device, got "
                         f"{sorted(map(str, devices))}")
    for name, x in (("q_t", q_t), ("k_t", k_t), ("q_s", q_s), ("k_s", k_s)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be [B, heads, tokens, head_dim], got shape {tuple(x.shape)}")
    B, H, n_q, d_t = q_t.shape
    if q_s.shape[:3] != (B, H, n_q):
        raise ValueError(f"q_t {tuple(q_t.shape)} and q_s {tuple(q_s.shape)} must agree on [B, H, n_q]")
    for name, k, d in (("k_t", k_t, d_t), ("k_s", k_s, q_s.shape[-1])):
        if k.shape[0] != B or k.shape[2] != k_t.shape[2] or k.shape[3] != d:
            raise ValueError(f"{name} has shape {tuple(k.shape)}; expected [{B}, H_kv, {k_t.shape[2]}, {d}]")
        if k.shape[1] < 1 or H % k.shape[1]:
            raise ValueError(f"query heads ({H}) must be a multiple of {name}'s heads ({k.shape[1]})")


def check_attention_inputs(q, z_k, z_v, P_k, P_v, key_mode: str, positions, rope, bias, lengths,
                           n_valid=None) -> None:
    """The shapes and kinds every backend of the low-rank attention needs (float latents; the kernel adds
    its own limits): a clear ``ValueError`` naming the argument, where the reference would broadcast a
    mismatch silently or fail inside torch."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or not q.is_floating_point():
        raise ValueError(f"q must be a floating-point [B, H, Nq, d] tensor, got "
                         f"{getattr(q, 'dtype', type(q).__name__)} {tuple(getattr(q, 'shape', ()))}")
    B, H, _, d = q.shape
    for name, z in (("z_k", z_k), ("z_v", z_v)):
        if z.dim() != 4:
            raise ValueError(f"{name} must be [B, G, Nk, r], got {tuple(z.shape)}")
    G, Nk, r_k, r_v = z_k.shape[1], z_k.shape[2], z_k.shape[3], z_v.shape[3]
    if tuple(z_k.shape[:2]) != (B, G) or tuple(z_v.shape[:3]) != (B, G, Nk):
        raise ValueError(f"z_k {tuple(z_k.shape)} and z_v {tuple(z_v.shape)} must be [B={B}, G, Nk, r] with "
                         "the same B, G and Nk")
    if G == 0 or H % G:
        raise ValueError(f"q's {H} query heads must be a multiple of the latents' {G} KV heads")
    if tuple(P_k.shape) != (G, d, r_k):
        raise ValueError(f"P_k must be [G={G}, d={d}, r_k={r_k}], got {tuple(P_k.shape)}")
    if P_v is not None and tuple(P_v.shape) != (G, d, r_v):
        raise ValueError(f"P_v must be [G={G}, d={d}, r_v={r_v}], got {tuple(P_v.shape)}")
    if key_mode == "pre_rope":
        if positions is None or rope is None:
            raise ValueError("key_mode='pre_rope' needs the key positions and the rope spec")
        if tuple(positions.shape) not in ((B, Nk), (B, G, Nk)) or positions.is_floating_point():
            raise ValueError(f"positions must be integers [B={B}, Nk={Nk}] or per KV head [B={B}, G={G}, "
                             f"Nk={Nk}], got {positions.dtype} {tuple(positions.shape)}")
        if d % 2 or rope.inv_freq.numel() != d // 2:
            raise ValueError(f"rope.inv_freq must have d/2={d // 2} entries (d even), got "
                             f"{rope.inv_freq.numel()} for d={d}")
    if bias is not None and tuple(bias.shape) != (B, G, Nk):
        raise ValueError(f"bias must be [B={B}, G={G}, Nk={Nk}], got {tuple(bias.shape)}")
    if lengths is not None:
        if (not isinstance(lengths, torch.Tensor) or tuple(lengths.shape) != (B,)
                or lengths.is_floating_point()):
            raise ValueError(f"lengths must be an integer tensor [B={B}], got {lengths!r:.60}")
        # no range: a static cache's rows padded past their filled slots count below 0, which (as in the
        # kernel) means no key, and above Nk means all
    if n_valid is not None:
        if (not isinstance(n_valid, torch.Tensor) or n_valid.numel() != 1 or n_valid.is_floating_point()):
            raise ValueError(f"n_valid must be a tensor of one integer (the key slots filled), got "
                             f"{n_valid!r:.60}")
