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

import torch
from torch import nn

from stiefkv.cache import LatentCache, lengths_from_mask
from stiefkv.kernels import QuantizedLatents
from stiefkv.models import decoder_layers
from stiefkv.quant import GROUP, QuantSpec, packed_bytes, quantize


def _capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being recorded (its Python runs once: host counters must not move)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class CodeBuffer:
    """One latent of one layer stored quantized in the static cache: codes ``[B, G, L, bytes]`` and fp16
    scale and low ``[B, G, L, groups]`` (``spec``'s token layout), written token by token as they arrive and
    read by the kernels as :class:`~stiefkv.kernels.QuantizedLatents`."""

    def __init__(self, spec: QuantSpec, B: int, G: int, L: int, rank: int, device):
        self.spec, self.rank = spec, rank
        groups = -(-rank // GROUP)
        self.codes = torch.zeros(B, G, L, packed_bytes(rank, spec.bits), dtype=torch.uint8, device=device)
        self.scale = torch.zeros(B, G, L, groups, dtype=torch.float16, device=device)
        self.low = torch.zeros(B, G, L, groups, dtype=torch.float16, device=device)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.low.nbytes

    def write(self, slots: torch.Tensor, z: torch.Tensor) -> None:
        q = quantize(z, self.spec)
        self.codes.index_copy_(2, slots, q.codes)
        self.scale.index_copy_(2, slots, q.scale)
        self.low.index_copy_(2, slots, q.low)

    def latents(self) -> QuantizedLatents:
        return QuantizedLatents(self.codes, self.scale, self.low, self.spec.bits, self.rank)

    def rows(self, index: torch.Tensor) -> None:
        for t in (self.codes, self.scale, self.low):
            t.copy_(t.index_select(0, index.to(t.device)))


def _check_spec(spec: QuantSpec, layer: int, which: str) -> None:
    """The static cache stores what the kernels read: codes per token (``token`` layout), every token
    quantized as it is written."""
    if spec.layout != "token" or spec.recent:
        raise ValueError(
            f"layer {layer} stores its {which} as {spec}; the static cache holds the token layout with no "
            "exact recent window (int8/int4-token, read by the kernels in place). Use the dynamic "
            "LatentCache for this checkpoint, or one calibrated with token-layout bits")


def _as_float(buf, dtype: torch.dtype) -> torch.Tensor:
    return buf.latents().dequantize(dtype) if isinstance(buf, CodeBuffer) else buf.to(dtype)


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
    """Latents ``[B, G, max_length, r]`` per layer, preallocated on each layer's device: float, or codes of
    the checkpoint's bits in the token layout (:class:`CodeBuffer`; the kernels dequantize them in
    registers).

    Parameters
    ----------
    model : a model prepared by :func:`stiefkv.load` (its layers' ranks, dtype and devices size the buffers).
    batch_size : rows.
    max_length : slots per row (prompt, padding included, plus every token to be generated).

    Attributes
    ----------
    filled : ``[1]`` int32 on the device: slots written so far (the kernels' ``n_valid``).
    starts : ``[B]`` int32 on the device, each row's first real slot (left padding), or None.
    positions : ``[B, max_length]`` int32, the position of the token in each slot.
    """

    def __init__(self, model: nn.Module, batch_size: int, max_length: int):
        super().__init__()
        if batch_size < 1 or max_length < 1:
            raise ValueError(f"a static cache needs batch_size ≥ 1 and max_length ≥ 1, got {batch_size} and "
                             f"{max_length}")
        self.rows, self.max_length = int(batch_size), int(max_length)
        self.keys_buf: list[torch.Tensor] = []
        self.values_buf: list[torch.Tensor] = []
        for i, layer in enumerate(decoder_layers(model)):
            attn = layer.self_attn
            if not hasattr(attn, "P_k"):
                raise ValueError("StaticLatentCache holds a served model's latents; prepare the model with "
                                 "stiefkv.load(model, ckpt) first")
            device, dtype = attn.q_proj.weight.device, attn.q_proj.weight.dtype
            G = attn.P_k.shape[0]
            for which, spec, P, bufs in (("keys", attn.quant[0], attn.P_k, self.keys_buf),
                                         ("values", attn.quant[1], attn.P_v, self.values_buf)):
                if spec.quantized:
                    _check_spec(spec, i, which)
                    bufs.append(CodeBuffer(spec, self.rows, G, self.max_length, P.shape[2], device))
                else:
                    bufs.append(torch.zeros(self.rows, G, self.max_length, P.shape[2], device=device,
                                            dtype=dtype))
        first = decoder_layers(model)[0].self_attn.q_proj.weight.device
        self.positions = torch.zeros(self.rows, self.max_length, dtype=torch.int32, device=first)
        self.filled = torch.zeros(1, dtype=torch.int32, device=first)
        self.starts: torch.Tensor | None = None
        self.seen = 0  # host count of filled slots, for transformers; never read by a captured step
        self._slots: torch.Tensor | None = None

    # ------------------------------------------------------------------ what attention reads
    def valid_count(self, device: torch.device) -> torch.Tensor:
        """``filled`` on ``device``: a model placed across devices reads it on each layer's (a copy per
        layer there; the same tensor on one device)."""
        return self.filled if self.filled.device == device else self.filled.to(device)

    @property
    def is_compileable(self) -> bool:
        return False  # transformers must not torch.compile our Python; stiefkv.generate captures graphs

    @property
    def nbytes(self) -> int:
        """Bytes allocated: every layer's buffers (at their full length), positions and counters."""
        held = [*self.keys_buf, *self.values_buf, self.positions, self.filled, self.starts, self.lengths]
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
        n = query_length.numel() if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.seen + n, 0

    def exact_tails(self, layer_idx: int):
        return None  # float latents only: read as they are

    def read_layer(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.seen
        return tuple(_as_float(buf, dtype)[:, :, :n] for buf in (self.keys_buf[layer_idx],
                                                                  self.values_buf[layer_idx]))

    # ------------------------------------------------------------------ writing
    def set_padding(self, attention_mask: torch.Tensor | None) -> None:
        """Record each row's left padding from a ``[B, N]`` 0/1 mask of the first tokens written (a mask with
        holes or right padding is refused); None or an all-ones mask means no padding."""
        if attention_mask is None or bool(attention_mask.bool().all()):
            self.starts = None
            return
        mask = attention_mask.bool()
        pads = (~mask).sum(1)
        left = torch.arange(mask.shape[1], device=mask.device)[None, :] >= pads[:, None]
        if not torch.equal(left, mask):
            raise ValueError("StiefKV's latent attention supports left-padded batches only; got a mask with "
                             "padding on the right or holes. Set tokenizer.padding_side = 'left'.")
        self.starts = pads.to(self.filled.device, torch.int32)

    def check_room(self, n: int) -> None:
        """A clear error before ``n`` more tokens would overflow the buffers."""
        if self.seen + n > self.max_length:
            raise CacheOverflowError(
                f"the static cache holds {self.max_length} tokens per row and already has {self.seen}; "
                f"{n} more do not fit. Allocate it with a larger max_length (stiefkv.generate: "
                f"max_length=, generate: max_cache_len= or a smaller max_new_tokens)")

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
            raise ValueError(f"the static cache was allocated for batch {self.rows}, got {z_k.shape[0]}")
        if layer_idx == 0:
            if not _capturing(z_k.device):
                self.check_room(n)
                self.seen += n
            self._slots = self.filled.long() + torch.arange(n, device=self.filled.device)
            self.positions.index_copy_(1, self._slots, positions.to(torch.int32))
            self.filled.add_(n)
            self.lengths = self._lengths(attention_mask)
        slots = self._slots.to(z_k.device)
        read = []
        for buf, z in ((self.keys_buf[layer_idx], z_k), (self.values_buf[layer_idx], z_v)):
            if isinstance(buf, CodeBuffer):
                buf.write(slots, z)
                read.append(buf.latents())
            else:
                buf.index_copy_(2, slots, z.to(buf.dtype))
                read.append(buf)
        lengths = self.lengths
        if lengths is not None and lengths.device != z_k.device:
            lengths = lengths.to(z_k.device)
        return read[0], read[1], self.positions.to(z_k.device), lengths

    def _lengths(self, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        if attention_mask is not None:  # transformers' 4-D mask over the filled slots (eager only)
            lengths = lengths_from_mask(attention_mask, self.rows, self.seen)
            if lengths is not None:
                self.starts = (self.seen - lengths).to(self.filled.device, torch.int32)
            return lengths
        return None if self.starts is None else self.filled - self.starts

    # ------------------------------------------------------------------ edits transformers makes
    def reorder_cache(self, beam_idx: torch.LongTensor):
        for buf in (*self.keys_buf, *self.values_buf):
            if isinstance(buf, CodeBuffer):
                buf.rows(beam_idx)
            else:
                buf.copy_(buf.index_select(0, beam_idx.to(buf.device)))
        self.positions.copy_(self.positions.index_select(0, beam_idx.to(self.positions.device)))
        if self.starts is not None:
            self.starts = self.starts.index_select(0, beam_idx.to(self.starts.device))

    def crop(self, max_length: int):
        keep = self.seen + max_length if max_length <= 0 else min(max_length, self.seen)
        self.seen = keep
        self.filled.fill_(keep)

    def batch_repeat_interleave(self, repeats: int):
        raise ValueError("a static cache keeps its batch size; allocate it for the expanded batch")

    def batch_select_indices(self, indices: torch.Tensor):
        raise ValueError("a static cache keeps its batch size; allocate it for the batch you need")

    def reset(self):
        self.filled.zero_()
        self.seen = 0
        self.starts = self.lengths = None
