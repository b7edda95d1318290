"""The static latent cache: every layer's latents preallocated to a maximum length, counters on the device.

A :class:`StaticLatentCache` is what graph-captured decode needs: the buffers never move, a forward writes
its tokens at the slots the device counter ``filled`` names and advances it in place, and the kernels read
the number of filled slots from device memory (``n_valid``), so that a captured step replays correctly at
any length without the host knowing it. Left padding is kept as each row's first real slot (``starts``),
again on the device. The host keeps its own count (``get_seq_length``) for transformers' bookkeeping; a
caller that replays a captured step advances it with :meth:`StaticLatentCache.advance`.

It serves ``model.generate(..., cache_implementation="static")`` on a model prepared by
:func:`stiefkv.load` (transformers' ``StaticCache`` is swapped for it) and :func:`stiefkv.generate`.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch import nn

from stiefkv import kernels
from stiefkv.cache import LatentCache, appended_bias, left_pads, lengths_from_mask, query_count
from stiefkv.kernels import CodesAndBand, QuantizedLatents
from stiefkv.kernels._common import KERNEL_BITS, dequantized, interpreting
from stiefkv.models import arch_of, decoder_layers
from stiefkv.quant import (
    GROUP,
    LOG8_LARGEST,
    WINDOW8,
    Quantized,
    QuantSpec,
    held_exact,
    packed_bytes,
    quantize,
    quantized_length,
    unpack,
)


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being recorded (its Python runs once: host counters must not move)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# the quantize-on-write kernel: None where it compiles (CUDA with Triton); True also on the CPU under Triton's
# interpreter (tests); False never (the A/B of benchmarks/experiments/profile_serve_step.py)
FUSED_WRITES: bool | None = None
SLOT_ALIGN = 16  # a static cache's slots per row are a multiple of this (see StaticLatentCache)


def _fused_write(spec: QuantSpec, device: torch.device, backend: str = "auto") -> bool:
    """Whether codes are written by the quantize-on-write kernels (``kernels.quantize``: one launch per
    latent, bit for bit ``quantize`` and ``index_copy_``, which take a few dozen operators; for the channel
    layout, the group a decoded token makes due): on CUDA with Triton unless the model was loaded with
    ``backend="reference"``, for min–max or log8 groups (``mse`` ranges stay with PyTorch)."""
    return not spec.mse and spec.bits in KERNEL_BITS and _writes_by_kernel(device, backend)


def _writes_by_kernel(device: torch.device, backend: str) -> bool:
    """Whether a store's writes go through the Triton write kernels at all: on CUDA with Triton unless the
    model was loaded with ``backend="reference"`` (``FUSED_WRITES`` overrides, for tests)."""
    if backend == "reference":
        return False
    if FUSED_WRITES is not None:
        return FUSED_WRITES
    return device.type == "cuda" and kernels.triton_available()


def _quantize_into(store, z: torch.Tensor, slots: torch.Tensor | None, ring: tuple[int, int] | None = None,
                   first: int = 0) -> None:
    """``z``'s tokens quantized into the store at ``slots``; ``ring``: decode's one slot, whose token (or,
    for ``channel``, group) is read from the ring. A prefill chunk's channel groups are whole groups at
    slots ``first …`` (the host's count, a group's first slot: ``write_many``)."""
    from stiefkv.kernels.quantize import quantize_group_into, quantize_groups_into, quantize_into

    if store.spec.layout == "channel":
        if ring is None:
            quantize_groups_into(z, first, store.codes, store.scale, store.low, bits=store.spec.bits)
        else:
            quantize_group_into(z, slots, store.codes, store.scale, store.low, bits=store.spec.bits,
                                recent=store.spec.recent)
        return
    quantize_into(z, slots, store.codes, store.scale, store.low, bits=store.spec.bits, log8=store.spec.log8,
                  largest=LOG8_LARGEST[store.spec.bits], ring=ring)


def _fused_ring(spec: QuantSpec, device: torch.device, backend: str = "auto") -> bool:
    """Whether a ``window8`` store's tokens (a decoded one, or a prefill chunk) are held exact by the
    round-trip kernel (``kernels.quantize.round_trip_into``: one launch, bit for bit ``held_exact``'s ~90
    operators; any layout, since the exact window is per token)."""
    return spec.window8 and _writes_by_kernel(device, backend)


def _round_trip_into(store, z: torch.Tensor, slots: torch.Tensor, out: torch.Tensor | None = None) -> None:
    """``z``'s tokens held exact (``held_exact``) into the store's ring at ``slots`` (mod its window), or into
    ``out`` at ``slots`` themselves."""
    from stiefkv.kernels.quantize import round_trip_into  # imports Triton: only where it runs

    round_trip_into(z, slots, store.ring if out is None else out, bits=WINDOW8.bits,
                    largest=LOG8_LARGEST[WINDOW8.bits], wrap=out is None)


def _scale_buffers(spec: QuantSpec, shape: tuple, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A store's scales and lows: float16 both, or for log8 scales one uint8 code a group and no low (the
    kernels decode the code in registers, as the dynamic cache holds it)."""
    if spec.log8:
        return torch.zeros(shape, dtype=torch.uint8, device=device), None
    return torch.zeros(shape, dtype=torch.float16, device=device), torch.zeros(shape, dtype=torch.float16,
                                                                               device=device)


def _quantized(store, codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor | None,
               layout: str = "token") -> QuantizedLatents:
    return QuantizedLatents(codes, scale, low, store.spec.bits, store.rank, layout, store.spec.log8)


def _rows_of(t: torch.Tensor | None, rows) -> torch.Tensor | None:
    """``t[:, :, rows]`` (None stays None: the low of log8 scales)."""
    return None if t is None else t[:, :, rows]


class CodeBuffer:
    """One latent of one layer stored quantized in the static cache: codes ``[B, G, L, bytes]`` and fp16
    scale and low ``[B, G, L, groups]`` (``spec``'s token layout; log8 scales: one uint8 code a group),
    written token by token as they arrive and read by the kernels as
    :class:`~stiefkv.kernels.QuantizedLatents`."""

    def __init__(self, spec: QuantSpec, B: int, G: int, L: int, rank: int, device, backend: str = "auto"):
        self.spec, self.rank, self.backend = spec, rank, backend
        groups = -(-rank // GROUP)
        self.codes = torch.zeros(B, G, L, packed_bytes(rank, spec.bits), dtype=torch.uint8, device=device)
        self.scale, self.low = _scale_buffers(spec, (B, G, L, groups), device)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.low) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors())

    def write(self, slots: torch.Tensor, z: torch.Tensor) -> None:
        if _fused_write(self.spec, z.device, self.backend):
            _quantize_into(self, z, slots)
            return
        q = quantize(z, self.spec)
        self.codes.index_copy_(2, slots, q.codes)
        self.scale.index_copy_(2, slots, q.scale)
        if self.low is not None:
            self.low.index_copy_(2, slots, q.low)

    def latents(self) -> QuantizedLatents:
        return _quantized(self, self.codes, self.scale, self.low)

    def rows(self, index: torch.Tensor) -> None:
        for t in self._tensors():
            t.copy_(t.index_select(0, index.to(t.device)))


def kernel_readable(spec: QuantSpec) -> bool:
    """Codes the kernels read in place: 8 to 2 bits per token, every token quantized as it is written."""
    return spec.layout == "token" and not spec.recent and spec.bits in KERNEL_BITS


class WindowedCodes:
    """One latent of one layer stored as any :class:`~stiefkv.quant.QuantSpec` says: codes for the tokens a
    dynamic :class:`~stiefkv.cache.LatentStore` would hold quantized (all but the ``recent`` newest, and for
    ``channel`` but a group still filling: :func:`~stiefkv.quant.quantized_length`), and the exact latents of
    the newest ``recent + GROUP`` tokens in a ring (for ``window8``, their int8 codes dequantized: the ring is
    a constant ``recent + 64`` tokens, so it stays in the latents' dtype, holding what the dynamic cache's
    int8 window reads). Attention reads it dequantized, the exact tokens laid
    over their codes (correct, not fast), where its partner is float; beside codes it decodes through
    :class:`RingSplit` (codes read in place beside the ring).

    A forward of one token (decode) uses device counters only, so that it can be captured: it quantizes the
    token (``token``) or the group (``channel``) that this token makes due, from the ring, with a masked
    write where none is due. A forward of several tokens (prefill) uses the host's count."""

    def __init__(self, spec: QuantSpec, B: int, G: int, L: int, rank: int, dtype: torch.dtype, device,
                 backend: str = "auto"):
        self.spec, self.rank, self.length, self.backend = spec, rank, L, backend
        self.window = spec.recent + GROUP  # ≥ the exact tokens ever held (recent + a filling group) + 1
        self.padded = -(-L // GROUP) * GROUP  # the channel layout dequantizes whole groups
        width = packed_bytes(rank, spec.bits)
        groups = (B, G, self.padded, -(-rank // GROUP)) if spec.layout == "token" else (
            B, G, self.padded // GROUP, rank)
        self.codes = torch.zeros(B, G, self.padded, width, dtype=torch.uint8, device=device)
        self.scale, self.low = _scale_buffers(spec, groups, device)
        self.ring = torch.zeros(B, G, self.window, rank, dtype=dtype, device=device)
        self.tail: tuple[torch.Tensor, int] | None = None  # a prefill's exact latents and their first index

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.codes, self.scale, self.low, self.ring) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._tensors())

    def _store(self, slots: torch.Tensor, q: Quantized) -> None:
        """Codes of the tokens at ``slots`` (whole groups of them for ``channel``)."""
        self.codes.index_copy_(2, slots, q.codes)
        groups = slots if self.spec.layout == "token" else slots[::GROUP] // GROUP
        self.scale.index_copy_(2, groups, q.scale)
        if self.low is not None:
            self.low.index_copy_(2, groups, q.low)

    def write_many(self, start: int, z: torch.Tensor) -> None:
        """Tokens ``z`` ``[B, G, n, r]`` at slots ``start …`` (host count): quantize what they make due. Where
        the write kernels run, a prefill chunk's int8 window (``window8``) and its codes (either layout) take
        one launch each, the same bytes as PyTorch's ~90 and ~40-100 operators a latent (the prefill over
        codes was host-bound: ~540 operators a layer at SmolLM2's shapes, serving.md)."""
        n, device = z.shape[2], z.device
        held, due = quantized_length(start, self.spec), quantized_length(start + n, self.spec)
        before = self.ring.index_select(2, torch.arange(held, start, device=device) % self.window)
        if _fused_ring(self.spec, device, self.backend):
            chunk = z.new_empty(z.shape, dtype=self.ring.dtype)
            _round_trip_into(self, z, torch.arange(n, device=device), chunk)
        else:
            chunk = held_exact(z, self.spec).to(self.ring.dtype)
        exact = torch.cat([before, chunk], 2)  # tokens held … start + n − 1
        self.tail = (exact, held)
        if due > held:
            fused = _fused_write(self.spec, device, self.backend)
            # the channel kernel takes the host's first slot; the token kernel and PyTorch a slot a token
            channel = fused and self.spec.layout == "channel"
            slots = None if channel else torch.arange(held, due, device=device)
            if fused:
                _quantize_into(self, exact[:, :, : due - held], slots, first=held)
            else:
                self._store(slots, quantize(exact[:, :, : due - held], self.spec))
        keep = torch.arange(max(held, start + n - self.window), start + n, device=device)
        self.ring.index_copy_(2, keep % self.window, exact[:, :, keep - held])

    def write_one(self, slot: torch.Tensor, z: torch.Tensor) -> None:
        """Token ``z`` ``[B, G, 1, r]`` at ``slot`` (``[1]`` long on the device), with no host count."""
        self.tail = None
        if _fused_ring(self.spec, slot.device, self.backend):
            _round_trip_into(self, z, slot)
        else:
            self.ring.index_copy_(2, slot % self.window, held_exact(z, self.spec).to(self.ring.dtype))
        if _fused_write(self.spec, slot.device, self.backend):  # the same, in one launch
            _quantize_into(self, self.ring, slot, ring=(self.spec.recent, self.window))
            return
        if self.spec.layout == "token":
            token = slot - self.spec.recent  # the token this one pushes out of the window
            q = quantize(self.ring.index_select(2, token % self.window), self.spec)
            # before it is due (token < 0) slot 0 gets codes no one reads: it is exact until it is due
            self._store(token.clamp(min=0), q)
            return
        end = slot + 1 - self.spec.recent  # a group is due when this many tokens are quantizable
        first = (end - GROUP).clamp(min=0)
        slots = first + torch.arange(GROUP, device=slot.device)
        q = quantize(self.ring.index_select(2, slots % self.window), self.spec)
        due = (end > 0) & (end % GROUP == 0)
        group = first // GROUP
        self.codes.index_copy_(2, slots, torch.where(due, q.codes, self.codes.index_select(2, slots)))
        self.scale.index_copy_(2, group, torch.where(due, q.scale, self.scale.index_select(2, group)))
        self.low.index_copy_(2, group, torch.where(due, q.low, self.low.index_select(2, group)))

    def ring_slots(self, filled: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The slot each ring entry holds ``[window]`` (the newest ≡ its index mod the window, below
        ``filled``) and whether that slot is a token held exact."""
        index = torch.arange(self.window, device=filled.device)
        newest = filled - 1 - (filled - 1 - index) % self.window
        return newest, (newest >= 0) & (newest >= quantized_length(filled, self.spec))

    def read(self, filled: torch.Tensor, dtype: torch.dtype, upto: int | None = None) -> torch.Tensor:
        """Every slot's latent ``[B, G, L, r]`` in ``dtype``: codes dequantized, and the exact tokens (of the
        ``filled`` ``[1]`` on the device) laid over them. Slots past ``filled`` hold no token. ``upto`` (a
        forward of several tokens, whose count the host knows: ``filled`` itself): the first ``upto`` slots
        only, so that a prefill chunk dequantizes the tokens held, not the whole buffer."""
        B, G = self.codes.shape[:2]
        n = self.padded if upto is None else min(self.padded, -(-upto // GROUP) * GROUP)
        rows = n if self.spec.layout == "token" else n // GROUP
        codes = _quantized(self, self.codes[:, :, :n], self.scale[:, :, :rows],
                           _rows_of(self.low, slice(rows)), self.spec.layout)
        if upto is not None:
            return self._read_upto(codes, filled, dtype, upto)
        # a last slot where the ring entries that hold no exact token land
        z = torch.cat([codes.dequantize(dtype), self.ring.new_zeros(B, G, 1, self.rank, dtype=dtype)], 2)
        newest, exact = self.ring_slots(filled)
        z.index_copy_(2, torch.where(exact, newest, n), self.ring.to(dtype))
        return z[:, :, : min(self.length, n)]

    def _read_upto(self, codes: QuantizedLatents, filled: torch.Tensor, dtype: torch.dtype,
                   upto: int) -> torch.Tensor:
        """:meth:`read` of a forward of several tokens, ``upto`` (= ``filled``) known to the host: the codes
        dequantized in one pass (Triton on CUDA), then only the last ``window`` slots, where every exact
        token lies, taken from the ring where they are exact. Only where the layer's other store is float:
        beside codes a prefill forward reads :func:`_codes_and_band` (codes below its band, no whole copy).
        Before, three whole bf16 copies of the latent and int64 unpacking intermediates a forward (a copy
        with a spare slot for the ring's other entries) ran KIVI-2 out of memory at 27 rows × 32k."""
        z = dequantized(codes, dtype)[:, :, : min(self.length, upto)]
        self._lay_exact(z, 0, filled, upto)
        return z

    def _lay_exact(self, z: torch.Tensor, first: int, filled: torch.Tensor, upto: int) -> None:
        """Lay the exact tokens (of the ``filled`` = ``upto`` written) over ``z``, the latents of slots
        ``first … upto − 1``, in place: every exact token lies in the last ``window`` slots."""
        lo = max(first, upto - self.window)
        slots = torch.arange(lo, upto, device=filled.device)
        exact = (slots >= quantized_length(filled, self.spec))[None, None, :, None]
        ring = self.ring.index_select(2, slots % self.window).to(z.dtype)
        tail = z[:, :, lo - first: upto - first]
        tail.copy_(torch.where(exact, ring, tail))

    def latents(self) -> QuantizedLatents:
        """The codes of every slot as the kernels read them."""
        n = self.length
        if self.spec.layout == "channel":  # a row of scales per group of slots: all rows
            return _quantized(self, self.codes[:, :, :n], self.scale, self.low, "channel")
        return _quantized(self, self.codes[:, :, :n], self.scale[:, :, :n], _rows_of(self.low, slice(n)))

    def rows(self, index: torch.Tensor) -> None:
        for t in self._tensors():
            t.copy_(t.index_select(0, index.to(t.device)))


class RingSplit(NamedTuple):
    """A decode step's view of a layer whose keys and values are codes (at least one behind an exact
    window): the codes of the slots both hold quantized (the first ``n_codes``, read in place by the
    kernels), and a ring view of the slots from there to the newest, each latent exact where it holds the
    token exact and its codes dequantized where not, each entry at its position, with a bias that hides the
    entries outside those slots (and left padding). Attention over the two merges by log-sum-exp."""

    codes_k: QuantizedLatents
    codes_v: QuantizedLatents
    n_codes: torch.Tensor  # [1] int32: slots held as codes
    codes_lengths: torch.Tensor | None  # [B] real slots among them (left padding), None without padding
    ring_k: torch.Tensor  # [B, G, window, r_k]
    ring_v: torch.Tensor  # [B, G, window, r_v]
    ring_positions: torch.Tensor  # [B, window] int32, or [B, G, window] behind a compacted prompt
    ring_bias: torch.Tensor  # [B, G, window]: 0 for a slot in [n_codes, filled), −inf otherwise (+ β)
    # behind a compacted prompt (hold_compacted): the codes' positions and β per KV head [B, G, slots]
    codes_positions: torch.Tensor | None = None
    codes_bias: torch.Tensor | None = None


def splittable(k, v) -> bool:
    """Keys and values the kernels read as codes (any layout and width), at least one behind an exact
    window: decode splits the tokens at the first one either holds exact."""
    stores = (k, v)
    return all(isinstance(s, (WindowedCodes, CodeBuffer)) for s in stores) \
        and any(isinstance(s, WindowedCodes) for s in stores)


def _exact_past_split(store, other) -> bool:
    """``store`` holds exact every token past the split beside ``other``, at any length: it never holds
    more tokens as codes than ``other`` (:func:`_held_as_codes`), so its ring side needs no codes (and its
    window, ``recent`` + 64, is the wider). A sufficient test: a token store beside a channel one with 63
    more exact tokens would pass too, and takes the general path."""
    if not isinstance(store, WindowedCodes):
        return False
    if isinstance(other, CodeBuffer):
        return True
    # f − a (token) or ⌊(f − a) / 64⌋·64 (channel) ≤ the other's count, for every f, when:
    return store.spec.recent >= other.spec.recent and (store.spec.layout == "channel"
                                                       or other.spec.layout == "token")


def _held_as_codes(store, filled: torch.Tensor) -> torch.Tensor:
    """Slots ``store`` holds as codes once ``filled`` are written (a CodeBuffer: all)."""
    return quantized_length(filled, store.spec) if isinstance(store, WindowedCodes) else filled


def _ring_side(store, step: _SplitStep, first_exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One latent's side of a split decode's ring view ``[B, G, window, r]``: each ring slot's codes
    dequantized, or the store's exact token where it holds that slot exact (``newest ≥ first_exact``). One
    launch where the writes go through the kernels (``kernels.dequantize.dequantize_at``), else ~35
    PyTorch operators."""
    windowed = isinstance(store, WindowedCodes)
    if _writes_by_kernel(step.slot.device, store.backend):
        from stiefkv.kernels.dequantize import dequantize_at  # imports Triton: only where it runs

        codes = store.latents()
        if windowed:
            return dequantize_at(codes, step.slot, dtype, ring=store.ring, newest=step.newest,
                                 first_exact=first_exact)
        return dequantize_at(codes, step.slot, dtype)
    coded = _codes_at(store, step.slot, dtype)
    if windowed:
        exact = store.ring.index_select(2, step.slot % store.window).to(dtype)
        coded = torch.where((step.newest >= first_exact)[None, None, :, None], exact, coded)
    return coded


def _codes_at(store, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The latents the codes of ``slots`` ``[W]`` stand for ``[B, G, W, r]`` (computed in float32), whatever
    the slots hold exact: what attention reads of a token held quantized."""
    codes = store.codes.index_select(2, slots)
    if store.spec.layout == "token":
        return _quantized(store, codes, store.scale.index_select(2, slots),
                          _rows_of(store.low, slots)).dequantize(dtype)
    # channel: each slot takes its group's row of scales and lows, channel by channel
    scale = store.scale.index_select(2, slots // GROUP).float()
    low = store.low.index_select(2, slots // GROUP).float()
    return (unpack(codes, store.spec.bits, store.rank).float() * scale + low).to(dtype)


def _cut(z, n: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``n`` slots as float latents (codes dequantized to ``dtype``: the exact band such a forward
    reads goes to the reference, which takes floats)."""
    if isinstance(z, QuantizedLatents):
        return dequantized(z._replace(codes=z.codes[:, :, :n], scale=z.scale[:, :, :n],
                                      low=_rows_of(z.low, slice(n))), dtype)
    return z[:, :, :n]


def _codes_and_band(store, filled: torch.Tensor, dtype: torch.dtype, split: int, upto: int) -> CodesAndBand:
    """A prefill forward's read of a code store (``upto`` = ``filled`` slots written, known to the host):
    the codes below ``split`` (where the forward's exact band starts: no store holds a token exact below it)
    as they are, and the slots from there dequantized, with a windowed store's exact tokens laid over
    them."""
    codes = store.latents()
    first = split if store.spec.layout == "token" else split // GROUP * GROUP  # whole channel groups
    if isinstance(store, WindowedCodes) and (codes.codes.device.type == "cuda" or interpreting()):
        # one launch for the dequantization and the ring's exact tokens laid over it: ~25 PyTorch operators
        # a store and forward otherwise (count_prefill_ops.py)
        from stiefkv.kernels.dequantize import dequantize_at

        slots = torch.arange(first, upto, device=codes.codes.device)
        band = dequantize_at(codes, slots, dtype, ring=store.ring, newest=slots,
                             first_exact=quantized_length(filled, store.spec).reshape(1))
        return CodesAndBand(codes.tokens(0, split), band[:, :, split - first:])
    band = dequantized(codes.tokens(first, upto), dtype)
    if isinstance(store, WindowedCodes):
        store._lay_exact(band, first, filled, upto)
    return CodesAndBand(codes.tokens(0, split), band[:, :, split - first:])


def _as_float(buf, dtype: torch.dtype) -> torch.Tensor:
    return buf.latents().dequantize(dtype) if isinstance(buf, CodeBuffer) else buf.to(dtype)


class _SplitStep(NamedTuple):
    """What a split decode step hands attention besides each layer's codes and ring views (device tensors)."""

    held: list  # [slots each store holds as codes] ([1] each)
    n_codes: torch.Tensor  # [1] int32
    codes_lengths: torch.Tensor | None
    newest: torch.Tensor  # [window] the slot each ring entry holds
    slot: torch.Tensor  # newest, clamped to a slot
    positions: torch.Tensor  # [B, window] int32
    bias: torch.Tensor  # [B, G, window]


def free_bytes(device: torch.device) -> int | None:
    """Bytes an allocation on ``device`` can still take: the device's free memory and what PyTorch's caching
    allocator holds unused (CUDA), or the memory the kernel reports available (CPU, Linux); None where it
    cannot be told."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        allocated = torch.cuda.memory_allocated(device)
        room = free + torch.cuda.memory_reserved(device) - allocated
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # a cap set on this process
        if fraction is not None:
            room = min(room, int(fraction(device) * total) - allocated)
        return int(room)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def check_fits(needed: dict, rows: int, max_length: int) -> None:
    """Refuse a cache whose buffers (``needed``: bytes by device, a lower bound) exceed the memory a device
    has free, before any is allocated: where the kernel overcommits memory, a huge allocation succeeds and
    the process is killed when the zeros are written, with no message at all."""
    for device, n in needed.items():
        free = free_bytes(device)
        if free is not None and n > free:
            raise MemoryError(f"out of memory for a cache of {rows} rows × {max_length} tokens: its buffers "
                              f"need {n / 2**30:.3g} GiB on {device}, which has {free / 2**30:.3g} GiB free; "
                              "lower max_length (by default the prompt plus max_new_tokens) or the batch")


def full_cache_bytes(model: nn.Module, rows: int, slots: int) -> dict:
    """Bytes by device that transformers' ``StaticCache`` of ``rows`` × ``slots`` allocates for an
    uncompressed ``model``: keys and values as ``k_proj`` and ``v_proj`` give them, in the weights' dtype."""
    needed: dict = {}
    for layer in decoder_layers(model):
        attn = layer.self_attn
        w = attn.k_proj.weight
        width = attn.k_proj.out_features + attn.v_proj.out_features
        needed[w.device] = needed.get(w.device, 0) + rows * slots * width * w.dtype.itemsize
    return needed


def latent_cache_bytes(model: nn.Module, rows: int, slots: int) -> dict:
    """Bytes by device a :class:`StaticLatentCache` of ``rows`` × ``slots`` allocates for ``model``'s layers,
    at least (codes counted as :meth:`QuantSpec.cache_bytes` counts them, positions beside them)."""
    needed: dict = {}
    for layer in decoder_layers(model):
        attn = layer.self_attn
        device, dtype = attn.q_proj.weight.device, attn.q_proj.weight.dtype
        for spec, P in ((attn.quant[0], attn.P_k), (attn.quant[1], attn.P_v)):
            per_head = (spec.cache_bytes(P.shape[2], slots) if spec.quantized
                        else dtype.itemsize * P.shape[2] * slots)
            needed[device] = needed.get(device, 0) + rows * P.shape[0] * per_head
    first = decoder_layers(model)[0].self_attn.q_proj.weight.device
    needed[first] = needed.get(first, 0) + rows * slots * 4  # positions
    return needed


class CacheOverflowError(ValueError):
    """A static cache asked to hold more tokens than it was allocated for."""


def transformers_static_length(made) -> int:
    """Slots per row of transformers' ``StaticCache`` (its accessors differ between versions)."""
    reads = (lambda: made.get_max_length(), lambda: made.max_cache_len, lambda: made.layers[0].max_cache_len)
    for get in reads:
        try:
            length = get()
        except (AttributeError, IndexError, TypeError):
            continue
        if length:
            return int(length)
    raise ValueError("could not read the length transformers sized its StaticCache for; pass "
                     "cache=stiefkv.StaticLatentCache(model, batch_size, max_length) to generate instead")


class StaticLatentCache(LatentCache):
    """Latents ``[B, G, slots, r]`` per layer (``slots``: ``max_length`` rounded up to 16), preallocated on
    each layer's device: float; int8-int2 codes per token with no exact window (:class:`CodeBuffer`; the
    kernels dequantize them in registers); or any other storage of the checkpoint (:class:`WindowedCodes`:
    exact recent tokens, channel layout, 2-3 bits; read dequantized).

    Parameters
    ----------
    model : a model prepared by :func:`stiefkv.load` (its layers' ranks, dtype and devices size the buffers).
    batch_size : rows.
    max_length : tokens per row (prompt, padding included, plus every token to be generated); the buffers
        hold it rounded up to a multiple of 16 slots.

    Attributes
    ----------
    filled : ``[1]`` int32 on the device: slots written so far (the kernels' ``n_valid``).
    starts : ``[B]`` int32 on the device, each row's first real slot (left padding), or None.
    positions : ``[B, slots]`` int32, the position of the token in each slot.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_length: int):
        super().__init__()
        whole = [isinstance(v, numbers.Integral) and not isinstance(v, bool)
                 for v in (batch_size, max_length)]
        if not all(whole) or batch_size < 1 or max_length < 1:  # 2.7 rows were 2, "2" a TypeError
            raise ValueError(f"a static cache needs whole numbers batch_size ≥ 1 and max_length ≥ 1, got "
                             f"{batch_size!r} and {max_length!r}")
        self.rows, self.max_length = int(batch_size), int(max_length)
        # Slots allocated: max_length rounded up to 16, so that every (row, head) of a buffer starts on a
        # 16-byte boundary the kernels' compiler can see (a stride divisible by 16); at 32834 slots of 28-byte
        # int4 rows the heads were 8-byte aligned and the decode kernel read its codes byte by byte.
        slots = -(-self.max_length // SLOT_ALIGN) * SLOT_ALIGN
        arch_of(model.config)  # an unsupported model is named as such, not by its missing .model.layers
        layers = decoder_layers(model)
        if not all(hasattr(layer.self_attn, "P_k") for layer in layers):
            raise ValueError("StaticLatentCache holds a served model's latents; prepare the model with "
                             "stiefkv.load(model, ckpt) first")
        check_fits(latent_cache_bytes(model, self.rows, slots), self.rows, self.max_length)
        self.keys_buf: list[torch.Tensor] = []
        self.values_buf: list[torch.Tensor] = []
        for layer in layers:
            attn = layer.self_attn
            device, dtype = attn.q_proj.weight.device, attn.q_proj.weight.dtype
            for spec, P, bufs in ((attn.quant[0], attn.P_k, self.keys_buf),
                                  (attn.quant[1], attn.P_v, self.values_buf)):
                G = P.shape[0]  # each latent its own: a basis shared by the KV heads holds one a token
                if spec.quantized and kernel_readable(spec):
                    bufs.append(CodeBuffer(spec, self.rows, G, slots, P.shape[2], device, attn.backend))
                elif spec.quantized:
                    bufs.append(WindowedCodes(spec, self.rows, G, slots, P.shape[2], dtype, device,
                                              attn.backend))
                else:
                    bufs.append(torch.zeros(self.rows, G, slots, P.shape[2], device=device, dtype=dtype))
        first = decoder_layers(model)[0].self_attn.q_proj.weight.device
        self.positions = torch.zeros(self.rows, slots, dtype=torch.int32, device=first)
        self.filled = torch.zeros(1, dtype=torch.int32, device=first)
        self.starts: torch.Tensor | None = None
        self.seen = 0  # host count of filled slots, for transformers; never read by a captured step
        self._slots: torch.Tensor | None = None
        # Stores with an exact window (recent tokens, a channel group still filling): a forward
        # of several tokens then reads every layer cut to the tokens held, with the exact band a dynamic
        # cache gives it (no n_valid), and decode reads them whole with the exact tokens laid over.
        self.windowed = any(isinstance(b, WindowedCodes) for b in (*self.keys_buf, *self.values_buf))
        # layers whose decode reads codes in place beside the exact ring (RingSplit)
        self.split_layers = {i for i, (k, v) in enumerate(zip(self.keys_buf, self.values_buf))
                             if splittable(k, v)}
        self._cut = False  # this forward reads the layers cut to `seen`
        self._split_steps: dict = {}  # this forward's split-decode bookkeeping by pair of stores
        self._tails: dict[int, tuple] = {}
        # a compacted prompt held (hold_compacted): each layer's positions and logit bias [B, G, slots], its
        # entries' own, then every later token's position and β 0 (or PAD_BETA: padding); [] otherwise
        self.head_positions: list[torch.Tensor] = []
        self.beta: list[torch.Tensor] = []
        self.held_slots = 0  # the slots the compacted prompt takes

    # ------------------------------------------------------------------ what attention reads
    def valid_count(self, device: torch.device) -> torch.Tensor | None:
        """``filled`` on ``device``: a model placed across devices reads it on each layer's (a copy per
        layer there; the same tensor on one device). None in a forward that reads the layers cut to the
        tokens held."""
        if self._cut:
            return None
        return self.filled if self.filled.device == device else self.filled.to(device)

    @property
    def is_compileable(self) -> bool:
        return False  # transformers must not torch.compile our Python; stiefkv.generate captures graphs

    @property
    def nbytes(self) -> int:
        """Bytes allocated: every layer's buffers (at their full length), positions and counters."""
        held = [*self.keys_buf, *self.values_buf, self.positions, self.filled, self.starts, self.lengths,
                *self.head_positions, *self.beta]
        return int(sum(t.nbytes for t in held if t is not None))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return self.max_length

    @property
    def max_cache_len(self) -> int:
        return self.max_length

    def get_mask_sizes(self, query_length, layer_idx: int = 0, *args) -> tuple[int, int]:
        # transformers builds the mask before the forward writes: it covers what is held plus the queries
        return self.seen + query_count(query_length), 0

    def exact_tails(self, layer_idx: int):
        """In a forward of several tokens over windowed stores, each latent's exact latents from the first
        token it holds exact, as ``(z, index)`` (the dynamic cache's); None otherwise (read as stored)."""
        return self._tails.pop(layer_idx, None) if self._cut else None

    def read_layer(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.seen
        return tuple(self._read(buf, dtype)[:, :, :n] for buf in (self.keys_buf[layer_idx],
                                                                   self.values_buf[layer_idx]))

    def _read(self, buf, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(buf, WindowedCodes):
            return buf.read(self.filled.to(buf.ring.device), dtype)
        return _as_float(buf, dtype)

    def bias(self, layer_idx: int) -> torch.Tensor | None:
        """The logit bias ``[B, G, slots]`` of layer ``layer_idx`` where a compacted prompt is held (its β,
        then 0 for every token written since, ``PAD_BETA`` for padding); None otherwise."""
        if not self.beta:
            return None
        return self.beta[layer_idx][..., : self.seen] if self._cut else self.beta[layer_idx]

    # ------------------------------------------------------------------ a compacted prompt
    def hold_compacted(self, cache: LatentCache, held_mask: torch.Tensor | None,
                       new_mask: torch.Tensor | None = None) -> int:
        """Write what a compacted :class:`~stiefkv.cache.LatentCache` holds (each layer's compacted prompt
        and the tokens appended since) into the first slots, each layer's positions and β per KV head
        beside them; returns the slots taken, ``S``, where the next token goes. A layer holding fewer entries
        than ``S`` takes the last of them, behind zero latents at β = ``PAD_BETA`` (never attended), so that
        its newest entries are the newest slots, as an exact window holds them.

        ``held_mask``: ``[B, appended]`` the turn's mask over the tokens appended since the prompt (True for a
        token; it decides which are padding, as it does for ``generate``); None keeps the cache's β.
        ``new_mask``: ``[B, n]`` the mask of the next ``n`` tokens to be written; None: all tokens. Their β is
        :func:`~stiefkv.cache.appended_bias`'s, as the dynamic cache gives them.

        Float latents and per-token codes are written as held; behind an exact window too (the store's codes
        as they are, its exact window into the ring, the store's own write setting the rest up), and such a
        layer decodes as ever, codes in place beside the ring (:class:`RingSplit`, with the held positions
        and β per KV head). Channel-layout codes are refused."""
        if self.seen:
            raise ValueError("hold_compacted fills an empty static cache; this one holds tokens already")
        layers = _compacted_layers(cache)
        if len(layers) != len(self.keys_buf):
            raise ValueError(f"the compacted cache holds {len(layers)} layers and the model has "
                             f"{len(self.keys_buf)}: it belongs to another model")
        S = compacted_slots(cache)
        extra = 0 if new_mask is None else new_mask.shape[1]
        self.check_room(S + extra)
        for i, (k_buf, v_buf) in enumerate(zip(self.keys_buf, self.values_buf)):
            first = S - cache.head_positions[i].shape[2]  # the layer's entries fill slots first … S − 1
            for buf, store, name in zip((k_buf, v_buf), _stores_of(cache, i), ("keys", "values")):
                _hold_latents(buf, store, i, name, first)
            device, slots = getattr(k_buf, "codes", k_buf).device, self.positions.shape[1]
            self.head_positions.append(_held_positions(cache.head_positions[i], first, slots, device))
            dtype = _dtype_of(k_buf, v_buf)
            self.beta.append(_held_beta(cache, i, held_mask, self.head_positions[i], first, dtype))
        if new_mask is not None:
            for beta in self.beta:
                beta[:, :, S:S + extra] = appended_bias(new_mask, extra, beta)[:, None]
        self.seen = self.held_slots = S
        self.filled.fill_(S)
        return S

    # ------------------------------------------------------------------ writing
    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Record each row's left padding from a ``[B, N]`` 0/1 mask of the first tokens written (a mask with
        holes or right padding is refused); None or an all-ones mask means no padding."""
        if attention_mask is None:
            self.starts = None
            return
        pads = left_pads(attention_mask)
        self.starts = None if not bool(pads.any()) else pads.to(self.filled.device, torch.int32)

    def check_room(self, n: int) -> None:
        """A clear error before ``n`` more tokens would overflow the buffers."""
        if self.seen + n > self.max_length:
            raise CacheOverflowError(
                f"the static cache holds {self.max_length} tokens per row and already has {self.seen}; "
                f"{n} more {'does' if n == 1 else 'do'} not fit. Allocate it with a larger max_length "
                "(StiefKV's StaticLatentCache(model, batch, max_length); stiefkv.generate: max_length=; "
                "generate: max_cache_len=) or ask for fewer new tokens (max_new_tokens)")

    def advance(self, n: int) -> None:
        """Count ``n`` slots written on the host (after a captured step's replays wrote them)."""
        self.seen += n

    def update_layer(self, z_k: torch.Tensor, z_v: torch.Tensor, layer_idx: int, positions: torch.Tensor,
                     attention_mask: torch.Tensor | None, quant=None):
        """Write one layer's new latents ``[B, G, n, r]`` at the next ``n`` slots; layer 0 also writes the
        positions ``[B, n]`` and advances ``filled`` in place. Returns the whole buffers, the positions, and
        the valid lengths ``[B]`` (None without padding); attention reads ``n_valid`` of the slots."""
        n = z_k.shape[2]
        if z_k.shape[0] != self.rows:
            raise ValueError(f"the static cache was allocated for batch {self.rows}, got {z_k.shape[0]}: "
                             f"allocate one for batch {z_k.shape[0]} (or pass {self.rows} rows)")
        if layer_idx == 0:
            capturing = _capturing(z_k.device)
            if not capturing:
                self.check_room(n)
            # the mask is read before anything moves: a forward it refuses leaves the cache as it was (the
            # slots it would have taken were read as tokens by the next forward)
            lengths = self._lengths(attention_mask, self.seen + (0 if capturing else n), n)
            self._start = self.seen  # the host's count before this forward (not read under capture)
            if not capturing:
                self.seen += n
            self._cut = self.windowed and n > 1
            self._split_steps = {}
            self._slots = self.filled.long() + torch.arange(n, device=self.filled.device)
            self.positions.index_copy_(1, self._slots, positions.to(torch.int32))
            self.filled.add_(n)
            self.lengths = lengths
        slots = self._slots.to(z_k.device)
        held = self._held_positions(layer_idx, slots, positions)
        if n == 1 and layer_idx in self.split_layers:
            positions = self.positions.to(z_k.device) if held is None else held
            return self._ring_split(layer_idx, slots, z_k, z_v), None, positions, None
        stores = (self.keys_buf[layer_idx], self.values_buf[layer_idx])
        # a prefill forward over two code stores reads the codes below its exact band as they are
        banded = self._cut and all(isinstance(s, (CodeBuffer, WindowedCodes)) for s in stores)
        read, tails = [], []
        for buf, z in zip(stores, (z_k, z_v)):
            if isinstance(buf, WindowedCodes):
                if n > 1:
                    buf.write_many(self._start, z)
                else:
                    buf.write_one(slots, z)
                tails.append(buf.tail or (z, self._start))
                if not banded:
                    read.append(buf.read(self.filled.to(z.device), z.dtype, self.seen if self._cut else None))
            elif isinstance(buf, CodeBuffer):
                buf.write(slots, z)
                tails.append((z, self._start))
                read.append(buf.latents())
            else:
                buf.index_copy_(2, slots, z.to(buf.dtype))
                tails.append((z, self._start))
                read.append(buf)
        lengths = self.lengths
        if lengths is not None and lengths.device != z_k.device:
            lengths = lengths.to(z_k.device)
        positions = self.positions.to(z_k.device) if held is None else held
        if self._cut:  # every layer cut to the tokens held, as a dynamic cache hands them over
            self._tails[layer_idx] = tuple(tails)
            if banded:  # where exact_band will start the band: the first exact token of either store
                split = min(start for _, start in tails)
                read = [_codes_and_band(s, self.filled.to(z_k.device), z_k.dtype, split, self.seen)
                        for s in stores]
            else:
                read = [_cut(z, self.seen, z_k.dtype) for z in read]
            positions = positions[..., : self.seen]
        return read[0], read[1], positions, lengths

    def _held_positions(self, layer_idx: int, slots: torch.Tensor,
                        positions: torch.Tensor) -> torch.Tensor | None:
        """Behind a compacted prompt, layer ``layer_idx``'s positions per KV head ``[B, G, slots]`` with this
        forward's tokens (at ``positions`` ``[B, n]``, every head's) written at ``slots``; None otherwise."""
        if not self.head_positions:
            return None
        held = self.head_positions[layer_idx]
        new = positions.to(held.device, torch.int32)[:, None].expand(-1, held.shape[1], -1)
        held.index_copy_(2, slots, new.contiguous())
        return held

    def _ring_split(self, layer_idx: int, slots: torch.Tensor, z_k: torch.Tensor,
                    z_v: torch.Tensor) -> RingSplit:
        """Write one token to a split layer and return its :class:`RingSplit` (device counters only). The
        split falls at the first slot either latent holds exact; the ring side gives each latent as the
        dynamic cache reads it there: exact from its own ring where it holds the token exact, else its
        codes dequantized (values per token are exact from ``f − recent``, keys per channel only from the
        last whole group)."""
        stores = (self.keys_buf[layer_idx], self.values_buf[layer_idx])
        for store, z in zip(stores, (z_k, z_v)):
            if isinstance(store, WindowedCodes):
                store.write_one(slots, z)
            else:
                store.write(slots, z)
        step = self._split_step(stores, z_k.shape[1], z_k.device)
        dtype = max((s for s in stores if isinstance(s, WindowedCodes)), key=lambda s: s.window).ring.dtype
        views = []
        for store, other, first_exact in zip(stores, stores[::-1], step.held):
            if _exact_past_split(store, other):  # then the widest ring: entry i holds slot newest[i]
                views.append(store.ring.to(dtype))
                continue
            views.append(_ring_side(store, step, first_exact, dtype))
        split = RingSplit(stores[0].latents(), stores[1].latents(), step.n_codes, step.codes_lengths,
                          views[0], views[1], step.positions, step.bias)
        if self.head_positions:  # a compacted prompt: positions and β per KV head, the ring's from its slots
            positions, beta = self.head_positions[layer_idx], self.beta[layer_idx]
            slot = step.slot.to(positions.device)
            split = split._replace(ring_positions=positions.index_select(2, slot),
                                   ring_bias=step.bias + beta.index_select(2, slot).to(step.bias.dtype),
                                   codes_positions=positions, codes_bias=beta)
        return split

    def _split_step(self, stores, G: int, device: torch.device) -> _SplitStep:
        """The counts, ring slots, positions and bias of this forward's split decode for a pair of stores,
        computed once and shared by every layer whose stores hold the same tokens as codes (the same kinds
        and specs: ``--bits auto`` picks per layer, most layers alike): ~20 small kernels a layer fewer."""
        key = (device, G, *((type(s), s.spec) for s in stores))
        if key in self._split_steps:
            return self._split_steps[key]
        filled = self.filled.to(device)
        held = [_held_as_codes(s, filled) for s in stores]
        n_codes = torch.minimum(*held)
        widest = max((s for s in stores if isinstance(s, WindowedCodes)), key=lambda s: s.window)
        newest, _ = widest.ring_slots(filled)
        slot = newest.clamp(min=0)
        visible = ((newest >= 0) & (newest >= n_codes))[None, :].expand(self.rows, -1)
        codes_lengths = None
        if self.starts is not None:
            starts = self.starts.to(device)
            visible = visible & (newest[None, :] >= starts[:, None])
            codes_lengths = (n_codes - starts).clamp(min=0).to(torch.int32)
        positions = self.positions.to(device).index_select(1, slot)
        zero = torch.zeros((), dtype=widest.ring.dtype, device=device)
        bias = torch.where(visible, zero, float("-inf"))[:, None, :].expand(-1, G, -1).contiguous()
        step = _SplitStep(held, n_codes.to(torch.int32), codes_lengths, newest, slot, positions, bias)
        self._split_steps[key] = step
        return step

    def _lengths(self, attention_mask: torch.Tensor | None, seen: int, n: int) -> torch.Tensor | None:
        """Valid lengths ``[B]`` once this forward's ``n`` tokens are in (``seen`` slots held then), read
        before ``filled`` advances."""
        if attention_mask is not None:  # transformers' 4-D mask over the filled slots (eager only)
            lengths = lengths_from_mask(attention_mask, self.rows, seen)
            if lengths is not None:
                self.starts = (seen - lengths).to(self.filled.device, torch.int32)
            return lengths
        return None if self.starts is None else self.filled + n - self.starts

    # ------------------------------------------------------------------ edits transformers makes
    def reorder_cache(self, beam_idx: torch.LongTensor):
        for buf in (*self.keys_buf, *self.values_buf):
            if isinstance(buf, (CodeBuffer, WindowedCodes)):
                buf.rows(beam_idx)
            else:
                buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))
        self.positions.copy_(self.positions.index_select(0, beam_idx.to(self.positions.device)))
        for t in (*self.head_positions, *self.beta):
            t.copy_(t.index_select(0, beam_idx.to(t.device)))
        if self.starts is not None:
            self.starts = self.starts.index_select(0, beam_idx.to(self.starts.device))

    def crop(self, max_length: int):
        if self.windowed:
            raise ValueError("a static cache with an exact window or channel-layout codes cannot be cropped "
                             "(the tokens cut would have to come back exact); use the dynamic LatentCache")
        keep = max(0, self.seen + max_length) if max_length <= 0 else min(max_length, self.seen)
        if self.beta and keep < self.held_slots:
            raise ValueError(f"this static cache holds a compacted prompt in its first {self.held_slots} "
                             "slots (its layers' entries padded to the longest): it cannot be cropped to "
                             f"{keep}")
        for beta in self.beta:  # a token written again in a cut slot is a token, whatever the cut one was
            beta[..., keep:] = 0
        self.seen = keep
        self.filled.fill_(keep)

    def batch_repeat_interleave(self, repeats: int):
        raise ValueError("a static cache keeps its batch size; allocate it for the expanded batch")

    def batch_select_indices(self, indices: torch.Tensor):
        raise ValueError("a static cache keeps its batch size; allocate it for the batch you need")

    def reset(self):
        self.filled.zero_()
        self.basis_tags = {}
        self.seen = 0
        self.starts = self.lengths = None
        self.head_positions, self.beta, self.held_slots = [], [], 0


def compacted_slots(cache: LatentCache) -> int:
    """The slots a compacted cache's entries take in a static cache: the most any layer holds."""
    return max(p.shape[2] for p in cache.head_positions)


def _compacted_layers(cache: LatentCache) -> list:
    """A compacted cache's layers, refused clearly where it is not one."""
    if not isinstance(cache, LatentCache) or not cache.compacted:
        raise ValueError("hold_compacted takes the LatentCache stiefkv.compact returned for a served model")
    return list(cache.layers)


def _stores_of(cache: LatentCache, i: int) -> tuple:
    """Layer ``i``'s key and value latents as held: a :class:`~stiefkv.cache.LatentStore` each where the
    layer is quantized, else the float tensors."""
    from stiefkv.cache import QuantizedLatentLayer

    layer = cache.layers[i]
    if isinstance(layer, QuantizedLatentLayer):
        return layer.stores
    return layer.keys, layer.values


def _hold_latents(buf, store, i: int, name: str, first: int) -> None:
    """A layer's held latents (float, or a store's per-token codes) written into slots ``first …`` of ``buf``:
    codes as they are (no second rounding), float latents in the buffer's dtype; behind an exact window,
    through the store's own write from the latents as held (the slots before ``first`` zero), then its codes
    and exact window laid over what that write made of them."""
    from stiefkv.cache import LatentStore

    if isinstance(store, LatentStore) and not store.spec.quantized:  # a float latent beside codes
        store = store.read(store.dtype)
    spec = store.spec if isinstance(store, LatentStore) else None
    want = getattr(buf, "spec", None)
    if spec != want:
        raise ValueError(f"layer {i}'s {name} in the compacted cache are stored as {spec or 'float latents'} "
                         f"and this model stores them as {want or 'float latents'}: it was compacted by "
                         "another model or checkpoint")
    if spec is not None and spec.layout != "token":
        raise ValueError(f"layer {i}'s {name} are codes in the channel layout ({spec}); stiefkv.generate "
                         "continues a compacted cache of float latents or per-token codes: continue this one "
                         "with model.generate(ids, past_key_values=cache)")
    if isinstance(buf, WindowedCodes):
        z = store.read(store.dtype)
        zeros = z.new_zeros(*z.shape[:2], first, z.shape[3])
        buf.write_many(0, torch.cat([zeros, z], 2))
        buf.tail = None
        # the codes and exact window as held: quantizing their dequantized latents again is not the identity
        # (log8 scales, and window8's int8 round trip before the codes, round them to other codes)
        if store.codes is not None:
            q, held = store.codes, store.held
            buf.codes[:, :, first:first + held].copy_(q.codes)
            buf.scale[:, :, first:first + held].copy_(q.scale)
            if buf.low is not None:
                buf.low[:, :, first:first + held].copy_(q.low)
        window = store._window_latents()
        if window is not None:
            slots = torch.arange(first + store.held, first + store.length, device=buf.ring.device)
            buf.ring.index_copy_(2, slots % buf.window, window.to(buf.ring.device, buf.ring.dtype))
        return
    if isinstance(buf, CodeBuffer):  # its spec keeps no exact window: every entry is held as codes
        q, n = store.codes, store.held
        buf.codes[:, :, first:first + n].copy_(q.codes)
        buf.scale[:, :, first:first + n].copy_(q.scale)
        if buf.low is not None:
            buf.low[:, :, first:first + n].copy_(q.low)
        return
    z = store
    if z.shape[0] != buf.shape[0] or z.shape[1] != buf.shape[1] or z.shape[3] != buf.shape[3]:
        raise ValueError(f"layer {i}'s {name} in the compacted cache are {list(z.shape)}; this model's "
                         f"static cache holds [{buf.shape[0]}, {buf.shape[1]}, N, {buf.shape[3]}]: another "
                         "batch, model or checkpoint")
    buf[:, :, first:first + z.shape[2]].copy_(z.to(buf.dtype))


def _dtype_of(k_buf, v_buf) -> torch.dtype:
    """The dtype of a layer's β: its float latents', else float32 (codes dequantize to the queries')."""
    for buf in (k_buf, v_buf):
        if isinstance(buf, torch.Tensor):
            return buf.dtype
    return torch.float32


def _held_positions(held: torch.Tensor, first: int, slots: int, device: torch.device) -> torch.Tensor:
    """``[B, G, slots]`` int32 on ``device``: a layer's held entries' positions per KV head at slots
    ``first …``, 0 elsewhere."""
    B, G, n = held.shape
    out = torch.zeros(B, G, slots, dtype=torch.int32, device=device)
    out[:, :, first:first + n] = held.to(out.device, torch.int32)
    return out


def _held_beta(cache: LatentCache, i: int, held_mask: torch.Tensor | None, positions: torch.Tensor,
               first: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, G, slots]`` (``positions``' shape and device): ``PAD_BETA`` before slot ``first``, then layer
    ``i``'s β of its compacted entries and of the tokens appended since (from ``held_mask`` where given), 0
    beyond."""
    from stiefkv.compaction import PAD_BETA

    beta = cache.beta[i]
    n, t = beta.shape[2], cache.prefix[i]
    out = torch.zeros(positions.shape, dtype=dtype, device=positions.device)
    out[:, :, :first] = PAD_BETA
    out[:, :, first:first + n] = beta.to(out.device, dtype)
    if held_mask is not None and n > t:
        out[:, :, first + t:first + n] = appended_bias(held_mask, n - t, out)[:, None]
    return out
