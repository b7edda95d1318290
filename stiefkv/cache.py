"""The latent cache: what a model served by :func:`stiefkv.load` keeps per token, and nothing else.

:class:`LatentCache` is a transformers ``Cache`` whose layers hold ``z_k`` ``[B, G, N, r_k]`` and ``z_v``
``[B, G, N, r_v]``. Besides the latents it owns, as its own fields, what attention over them needs: the
token positions ``[B, N]`` (``pre_rope`` rotates rebuilt keys at them) and the valid key lengths of a
left-padded batch. A layer whose latents are stored quantized (:mod:`stiefkv.quant`) keeps them in a
:class:`QuantizedLatentLayer` — codes, scales and the window of exact recent tokens — and returns them
dequantized: correct on every device, not fast (the static cache's kernels read codes in place). Any other
cache reaching a compressed model is refused with a message that says what to pass instead: it would hold
latents it cannot account for, and report sizes that are not ours.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch import nn

from stiefkv.compaction import PAD_BETA
from stiefkv.kernels import reference
from stiefkv.quant import (
    FLOAT,
    GROUP,
    WINDOW8,
    Quantized,
    QuantSpec,
    dequantize,
    quantize,
    quantized_length,
)


def _dynamic_cache_class():
    from transformers import DynamicCache

    return DynamicCache


class LatentCache(_dynamic_cache_class()):
    """A transformers ``Cache`` of low-rank latents, with positions and valid lengths as fields.

    Pass it as ``cache=`` (transformers ≥ 5.24) or ``past_key_values=``; on a model prepared by
    :func:`stiefkv.load`, ``generate``, a pipeline or a plain ``model(ids, use_cache=True)`` create one by
    themselves.

    Attributes
    ----------
    positions : ``[B, N]`` int32 position of every cached token (shared by all layers), or None when empty.
    lengths : ``[B]`` int32 real (unpadded) keys per row, as of the last forward, or None when nothing is
        padded. Computed once per forward, at layer 0, from the model's attention mask.
    length : after :func:`stiefkv.compact`, the prompt tokens its compacted prefix stands for (None before).
        The prefix differs per layer and KV head, so a compacted cache keeps, per layer, ``head_positions``
        ``[B, G, N]`` and ``beta`` ``[B, G, N]`` (the logit bias: the fitted β on the prefix, 0 behind it)
        instead of ``positions``, and reports ``length`` plus the tokens appended since as its length.
    """

    def valid_count(self, device: torch.device) -> torch.Tensor | None:
        """The number of filled key slots as a device tensor on ``device`` (a static cache's; None here:
        every cached key is valid)."""
        return None

    def __init__(self):
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None
        self.length: int | None = None
        self.prefix: list[int] = []
        self.head_positions: list[torch.Tensor] = []
        self.beta: list[torch.Tensor] = []
        self.appended_ids: torch.Tensor | None = None  # behind a compacted prefix: see record_appended
        self.prompt_ids: torch.Tensor | None = None  # the compacted prompt's: see refuse_another_prompt
        self.row_lengths: torch.Tensor | None = None  # [B] of prompts of different lengths: stiefkv.padded
        self.appended_mask: torch.Tensor | None = None  # behind a compacted prefix: see appended_bias
        # the mask columns of the forward under way's new tokens (set by stiefkv.compacted's check)
        self.incoming: torch.Tensor | None = None
        self.basis_tags: dict[int, str] = {}  # which bases wrote each layer: see check_bases

    @property
    def compacted(self) -> bool:
        return self.length is not None

    _writing = False  # set around the served attention's own writes (update_layer)

    def update(self, key_states, value_states, *args, **kwargs):
        """Only the served attention writes here (:meth:`update_layer`): an unserved model's attention
        wrote its keys and values into the latents' layers, silently wrong at full rank (a size error from
        inside transformers below it)."""
        if not self._writing:
            raise ValueError("this cache holds a served model's latents (a stiefkv LatentCache): only the "
                             "model served with its bases can continue it, and this one is not (unloaded, or "
                             "another model); give it a new cache, or stiefkv.load it again")
        return super().update(key_states, value_states, *args, **kwargs)

    def _write(self, z_k: torch.Tensor, z_v: torch.Tensor, layer_idx: int):
        self._writing = True
        try:
            return self.update(z_k, z_v, layer_idx)
        finally:
            self._writing = False

    def add_compacted_layer(self, z_k: torch.Tensor, z_v: torch.Tensor, positions: torch.Tensor,
                            beta: torch.Tensor, quant: tuple[QuantSpec, QuantSpec] | None = None) -> None:
        """Append the next layer of a compacted prefix: latents ``[B, G, t, r]`` at ``positions``
        ``[B, G, t]`` with logit biases ``beta`` ``[B, G, t]``, stored as ``quant`` (as the model stores its
        latents). Set :attr:`length` first."""
        if self.length is None:
            raise ValueError("set the cache's length (the tokens the prefix stands for) before its layers")
        i = len(self.prefix)
        if quant is not None and any(q.quantized for q in quant):
            while len(self.layers) <= i:
                self.layers.append(_dynamic_layer_class()())
            self.layers[i] = QuantizedLatentLayer(*quant)
            self.layers[i].update(z_k, z_v, held=True)  # latents as read: not through the int8 window again
        else:
            self._write(z_k, z_v, i)
        self.exact_tails(i)  # the prefix is read as stored, like any cached token
        self.prefix.append(z_k.shape[2])
        self.head_positions.append(positions.to(torch.int32))
        self.beta.append(beta.to(z_k.dtype))

    def read_layer(self, layer_idx: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer_idx``'s cached ``z_k, z_v`` ``[B, G, N, r]`` as attention reads them."""
        layer = self.layers[layer_idx]
        if isinstance(layer, QuantizedLatentLayer):
            return tuple(s.read(dtype) for s in layer.stores)
        return layer.keys.to(dtype), layer.values.to(dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens cached; for a compacted cache, the prompt's original length plus those appended since
        (where the next position starts)."""
        held = super().get_seq_length(layer_idx)
        if self.length is None or layer_idx >= len(self.prefix):
            return held
        return self.length + held - self.prefix[layer_idx]

    def bias(self, layer_idx: int) -> torch.Tensor | None:
        """The logit bias ``[B, G, N]`` of layer ``layer_idx``'s cached tokens (None: no compaction)."""
        return self.beta[layer_idx] if self.length is not None else None

    @property
    def nbytes(self) -> int:
        """Bytes held: every layer's latents (codes, scales, lows and exact windows of quantized ones), the
        positions and the lengths."""
        total = sum(t.nbytes for t in (self.positions, self.lengths, *self.head_positions, *self.beta)
                    if t is not None)
        for layer in self.layers:
            if isinstance(layer, QuantizedLatentLayer):
                total += layer.nbytes
                continue
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.nbytes
        return int(total)

    def update_layer(self, z_k: torch.Tensor, z_v: torch.Tensor, layer_idx: int, positions: torch.Tensor,
                     attention_mask: torch.Tensor | None, quant: tuple[QuantSpec, QuantSpec] | None = None):
        """Append one layer's new latents ``[B, G, n, r]`` at ``positions`` ``[B, n]``, stored as ``quant``
        (the key and value :class:`~stiefkv.quant.QuantSpec`; None or bf16 for both keeps them as they are).

        Returns every cached ``z_k, z_v`` of the layer (dequantized), all positions ``[B, N]`` and the valid
        lengths ``[B]`` (or None). Layer 0 appends the positions and reads the mask; later layers reuse both.
        """
        if quant is not None and any(q.quantized for q in quant):
            while len(self.layers) <= layer_idx:
                self.layers.append(_dynamic_layer_class()())
            if not isinstance(self.layers[layer_idx], QuantizedLatentLayer):
                if self.layers[layer_idx].get_seq_length():
                    raise ValueError(f"layer {layer_idx} of this cache already holds float latents; a "
                                     "quantized layer cannot continue them (use a new cache)")
                self.layers[layer_idx] = QuantizedLatentLayer(*quant)
        if (layer_idx == 0 and self.positions is not None and z_k.shape[0] != self.positions.shape[0]
                and self.get_seq_length(0)):
            held = self.positions.shape[0]
            raise ValueError(f"this LatentCache holds {held} rows and the forward brings {z_k.shape[0]}: a "
                             "cache continues the batch it was filled with (a new cache, or cache.reset(), "
                             "for another)")
        # the mask is read before anything is written: a forward it refuses leaves the cache as it was
        # behind a compacted prefix the model's 4-D mask is sized by the entries held, not the tokens its 2-D
        # mask spans, so it is not read: stiefkv.compacted checks the 2-D mask, and padding among the tokens
        # appended reaches the kernels as their β (appended_bias)
        if self.length is None and layer_idx == 0:
            held = 0 if self.positions is None else self.positions.shape[1]
            lengths = lengths_from_mask(attention_mask, z_k.shape[0], held + z_k.shape[2])
        z_k, z_v = self._write(z_k, z_v, layer_idx)
        if self.length is not None:
            return z_k, z_v, self._extend_compacted(layer_idx, positions, z_k.shape[2]), None
        if layer_idx == 0:
            positions = positions.to(torch.int32)
            old = self.positions
            self.positions = positions if old is None else torch.cat([old, positions], 1)
            self.lengths = lengths
        _check_held(layer_idx, z_k.shape[2], z_v.shape[2], self.positions.shape[1])
        return z_k, z_v, self.positions, self.lengths

    def _extend_compacted(self, i: int, positions: torch.Tensor, held: int) -> torch.Tensor:
        """Layer ``i``'s per-head positions after tokens at ``positions`` ``[B, n]`` were appended (β 0)."""
        B, G = self.head_positions[i].shape[:2]
        n = held - self.head_positions[i].shape[2]
        new = positions[:, -n:].to(torch.int32)[:, None].expand(B, G, n)
        self.head_positions[i] = torch.cat([self.head_positions[i], new], 2)
        beta = appended_bias(self.incoming, n, self.beta[i])
        self.beta[i] = torch.cat([self.beta[i], beta[:, None].expand(B, G, n)], 2)
        return self.head_positions[i]

    def exact_tails(self, layer_idx: int):
        """The key and value latents the last update of a quantized layer saw exact, each as ``(z, index of
        its first token)``, handed over once (the store lets go of them); None for a float layer (its
        latents are exact as read)."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, QuantizedLatentLayer):
            return None
        tails = tuple((s.tail, s.tail_start) for s in layer.stores)
        for s in layer.stores:
            s.tail = None
        return tails

    # The positions and lengths must follow every batch or length edit transformers makes to the layers.
    def _compacted_rows(self, fn) -> None:
        self.head_positions = [fn(t) for t in self.head_positions]
        self.beta = [fn(t) for t in self.beta]
        for name in ("appended_ids", "prompt_ids", "appended_mask"):
            if isinstance(getattr(self, name), torch.Tensor):
                setattr(self, name, fn(getattr(self, name)))
        if self.row_lengths is not None:  # on the rows' device from then on: beams reorder every step
            self.row_lengths = fn(self.row_lengths.to(self.head_positions[0].device))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self.positions = _rows(self.positions, beam_idx)
        self.lengths = _rows(self.lengths, beam_idx)
        self._compacted_rows(lambda t: _rows(t, beam_idx))

    def crop(self, max_length: int):
        if self.length is not None:
            return self._crop_compacted(max_length)
        # one reading of the argument for every layer, float and quantized alike: transformers ≥ 5.24 passes
        # -(tokens to remove) and refuses a positive one in its own layers, earlier versions the length to
        # keep; a checkpoint mixing the two kinds had some layers cropped, then failed, the cache half cut
        held = self.get_seq_length()
        keep = max(0, min(held, held + max_length if max_length <= 0 else max_length))
        for layer in self.layers:
            if isinstance(layer, QuantizedLatentLayer):
                layer._keep(keep)
            elif isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4:
                layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
        if self.positions is not None:
            self.positions = self.positions[:, :keep]
        # lengths are recomputed from the mask by the next forward, which sees the cropped length

    def _crop_compacted(self, size: int) -> None:
        """:meth:`crop` behind a compacted prefix (as :class:`~stiefkv.compacted.CompactedCache`'s): only the
        tokens appended since can go, from every layer alike, whatever its prefix holds; ``size`` as
        transformers passes it (≤ 0: the tokens to remove; > 0: the length to keep, in the reported one)."""
        reported = self.get_seq_length()
        remove = tokens_to_crop(reported, self.length, size)
        if remove == 0:
            return
        after = reported - self.length  # tokens appended behind the prompt: one entry each in every layer
        for i, layer in enumerate(self.layers):
            keep = self.prefix[i] + after - remove
            if isinstance(layer, QuantizedLatentLayer):
                layer._keep(keep)
            else:
                layer.keys, layer.values = layer.keys[..., :keep, :], layer.values[..., :keep, :]
            self.head_positions[i] = self.head_positions[i][..., :keep]
            self.beta[i] = self.beta[i][..., :keep]
        for name in ("appended_ids", "appended_mask"):
            if isinstance(getattr(self, name), torch.Tensor):
                setattr(self, name, getattr(self, name)[:, : after - remove])

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        for name in ("positions", "lengths"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.repeat_interleave(repeats, dim=0))
        self._compacted_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self.positions = _rows(self.positions, indices)
        self.lengths = _rows(self.lengths, indices)
        self._compacted_rows(lambda t: _rows(t, indices))

    def reset(self):
        # dropped, not reset: transformers 5.0's DynamicLayer.reset zeroes its tensors and keeps their length
        # and batch, which the next forward would continue
        self.layers.clear()
        self.basis_tags = {}
        self.positions = self.lengths = self.length = self.appended_ids = self.prompt_ids = None
        self.row_lengths = self.appended_mask = self.incoming = None
        self.prefix, self.head_positions, self.beta = [], [], []


def _dynamic_layer_class():
    from transformers.cache_utils import DynamicLayer

    return DynamicLayer


class LatentStore:
    """One latent of one layer in the cache, as its :class:`~stiefkv.quant.QuantSpec` says: float latents
    as they are, or codes with their scales plus the window of the tokens not quantized yet (the ``recent``
    newest, and a ``channel`` group still filling: :func:`~stiefkv.quant.quantized_length`), held as floats
    or, for ``window8``, as int8 codes per token (:data:`~stiefkv.quant.WINDOW8`)."""

    def __init__(self, spec: QuantSpec):
        self.spec = spec
        self.codes: Quantized | None = None
        self.window: torch.Tensor | Quantized | None = None  # the tokens not (yet) quantized
        self.dtype: torch.dtype | None = None  # of the latents: a crop may bring codes back to the window
        # the exact latents the last append saw from the first token it found unquantized on, and that index
        self.tail: torch.Tensor | None = None
        self.tail_start = 0

    @property
    def held(self) -> int:
        """Tokens held as codes."""
        return 0 if self.codes is None else self.codes.length

    @property
    def length(self) -> int:
        return self.held + (0 if self.window is None else _tokens(self.window))

    @property
    def rank(self) -> int | None:
        """The latent's rank (None while the store is empty)."""
        for part in (self.codes, self.window):
            if isinstance(part, Quantized):
                return part.rank
            if isinstance(part, torch.Tensor):
                return part.shape[-1]
        return None

    @property
    def nbytes(self) -> int:
        codes = 0 if self.codes is None else self.codes.nbytes
        return codes + (0 if self.window is None else self.window.nbytes)

    def _hold(self, z: torch.Tensor) -> torch.Tensor | Quantized:
        """Exact tokens as the window holds them."""
        return quantize(z, WINDOW8) if self.spec.window8 else z

    def _window_latents(self) -> torch.Tensor | None:
        """The window's tokens as exact latents read them (in the latents' dtype)."""
        if self.window is None or isinstance(self.window, torch.Tensor):
            return self.window
        return dequantize(self.window, self.dtype)

    def append(self, z: torch.Tensor, *, held: bool = False) -> None:
        """Add ``z`` ``[B, G, n, r]``; quantize what the spec no longer keeps exact. The exact latents of the
        window before the append plus ``z`` stay readable as :attr:`tail` until the next append.

        ``held``: ``z`` are latents as a store of this spec already reads them (a compacted prefix), so the
        tokens due are quantized from them as they are, not from their int8 window codes again; the tokens
        the window keeps are held as int8 codes of them (a caller with their own codes carries them over)."""
        self.dtype = z.dtype
        if self.spec.window8 and self.spec.quantized:
            # every token enters the window as int8 codes and leaves it quantized from them, however the
            # tokens arrive: a prefill quantizes what decoding one by one would (quant.fake_quant)
            new = self._hold(z)
            held_window = new if self.window is None else _cat_codes(self.window, new)
            window = dequantize(held_window, z.dtype)
            if held:
                window = torch.cat([window[..., : window.shape[-2] - z.shape[-2], :], z], -2)
        else:
            held_window = window = z if self.window is None else torch.cat([self.window, z], -2)
        # a band is needed only by a forward of several tokens; one token (decode) reads the cache as it is
        self.tail, self.tail_start = (window, self.held) if z.shape[-2] > 1 else (None, self.held)
        due = quantized_length(self.held + window.shape[-2], self.spec) - self.held
        if not self.spec.quantized or due <= 0:
            self.window = held_window
            return
        new = quantize(window[..., :due, :], self.spec)
        self.codes = new if self.codes is None else _cat_codes(self.codes, new)
        # a copy, not a view: a view would keep the whole exact prefill alive
        self.window = _drop_tokens(held_window, due) if due < window.shape[-2] else None

    def read(self, dtype: torch.dtype) -> torch.Tensor:
        """Every cached token's latent ``[B, G, N, r]`` in ``dtype`` (codes dequantized)."""
        parts = [] if self.codes is None else [dequantize(self.codes, dtype)]
        if self.window is not None:
            parts.append(self._window_latents().to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts, -2)

    def map_rows(self, fn) -> None:
        """Apply ``fn`` (a selection or repetition along the batch dimension) to everything held."""
        if self.codes is not None:
            self.codes = self.codes.apply(fn)
        if self.window is not None:
            self.window = self.window.apply(fn) if isinstance(self.window, Quantized) else fn(self.window)
        self.tail = None

    def keep(self, n: int) -> None:
        """Keep the first ``n`` tokens. A cut through the codes brings the kept tokens a cache of ``n`` would
        hold exact (the newest, a group cut through) back to the window, dequantized: a crop cannot restore
        the precision they lost. A cut through the window keeps every code, so the cache may then hold more
        tokens as codes, and fewer bytes, than a fresh cache of ``n``."""
        self.tail = None
        if n >= self.length:
            return
        held = self.held
        if n >= held:
            self.window = _first_tokens(self.window, n - held) if n > held else None
            return
        kept_codes = quantized_length(n, self.spec)
        tail = dequantize(self.codes, self.dtype)[..., kept_codes:n, :] if n > kept_codes else None
        self.codes = _slice_codes(self.codes, kept_codes) if kept_codes else None
        # codes brought back to an int8 window are held as int8 codes again (one more rounding)
        self.window = None if tail is None else self._hold(tail)


def _tokens(window: torch.Tensor | Quantized) -> int:
    return window.length if isinstance(window, Quantized) else window.shape[-2]


def _first_tokens(window: torch.Tensor | Quantized, n: int) -> torch.Tensor | Quantized:
    if isinstance(window, Quantized):
        return _slice_codes(window, n)
    return window[..., :n, :]


def _drop_tokens(window: torch.Tensor | Quantized, n: int) -> torch.Tensor | Quantized:
    """The window without its first ``n`` tokens, copied (a view would keep the whole window alive)."""
    if isinstance(window, Quantized):  # per-token codes: one scale row a token
        return window.apply(lambda t: t[..., n:, :].clone())
    return window[..., n:, :].clone()


def _cat_codes(a: Quantized, b: Quantized) -> Quantized:
    low = None if a.low is None else torch.cat([a.low, b.low], -2)
    return Quantized(torch.cat([a.codes, b.codes], -2), torch.cat([a.scale, b.scale], -2), low, a.bits,
                     a.layout, a.rank)


def _slice_codes(q: Quantized, n: int) -> Quantized:
    groups = n if q.layout == "token" else n // GROUP
    low = None if q.low is None else q.low[..., :groups, :]
    return Quantized(q.codes[..., :n, :], q.scale[..., :groups, :], low, q.bits, q.layout, q.rank)


class QuantizedLatentLayer(_dynamic_layer_class()):
    """A cache layer whose key and value latents are each a :class:`LatentStore` (either may be bf16).

    transformers sees an ordinary dynamic layer: ``update`` returns every cached latent (dequantized),
    ``get_seq_length`` counts tokens, and the batch and length edits of ``generate`` (beam reorder, crop,
    repeat, select) reach the stores. ``keys``/``values`` hold nothing: the stores do.
    """

    def __init__(self, key_spec: QuantSpec = FLOAT, value_spec: QuantSpec = FLOAT):
        super().__init__()
        self.is_initialized = False  # transformers 4.56's DynamicLayer has no lazy initialisation to set it
        self.stores = (LatentStore(key_spec), LatentStore(value_spec))

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.stores)

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        for store, z in zip(self.stores, (key_states, value_states)):
            store.append(z, held=kwargs.get("held", False))
        return tuple(s.read(z.dtype) for s, z in zip(self.stores, (key_states, value_states)))

    def get_seq_length(self) -> int:
        return self.stores[0].length

    def get_mask_sizes(self, query_length):
        return self.get_seq_length() + query_count(query_length), 0

    def reset(self) -> None:
        self.stores = tuple(LatentStore(s.spec) for s in self.stores)
        self.is_initialized = False

    def offload(self):  # the stores stay where they are
        pass

    def prefetch(self):
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def crop(self, max_length: int) -> None:
        # transformers ≥ 5.24 passes -(tokens to remove), 0 removing none; earlier versions the length to keep
        self._keep(self.get_seq_length() + max_length if max_length <= 0 else max_length)

    def _keep(self, n: int) -> None:
        for s in self.stores:
            s.keep(n)

    def batch_repeat_interleave(self, repeats: int) -> None:
        for s in self.stores:
            s.map_rows(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for s in self.stores:
            s.map_rows(lambda t: t.index_select(0, indices.to(t.device)))


def _rows(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, index.to(t.device))


def cache_keyword(model: nn.Module) -> str:
    """The keyword this transformers version's ``forward`` takes a cache by (renamed in 5.24)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def check_bases(cache, layer_idx: int, tag: str) -> None:
    """Record which bases (``tag``, :func:`basis_tag`) write layer ``layer_idx`` of ``cache``, and refuse a
    forward under other ones: latents of another checkpoint of the same ranks would be read as this one's,
    silently (``stiefkv.load`` called again with another checkpoint since the cache was filled)."""
    held = cache.basis_tags.setdefault(layer_idx, tag)
    if held != tag:
        raise ValueError(f"layer {layer_idx} of this cache holds latents of other bases than the model is "
                         "served with now (stiefkv.load was given another checkpoint since the cache was "
                         "filled): make a new cache, or cache.reset(), for this model")


def basis_tag(P_k: torch.Tensor, P_v: torch.Tensor, key_mode: str, quant) -> str:
    """What a layer's latents mean: its bases' bytes, its key mode and its storage (a short sha1)."""
    import hashlib

    h = hashlib.sha1(f"{key_mode} {[str(q) for q in quant]}".encode())
    for P in (P_k, P_v):
        h.update(str(tuple(P.shape)).encode())
        h.update(P.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def query_count(query) -> int:
    """The queries of a ``get_mask_sizes`` call: recent transformers pass their count, 5.0
    their ``cache_position`` tensor."""
    return query.numel() if isinstance(query, torch.Tensor) else int(query)


def refuse_no_tokens(hidden_states: torch.Tensor, cache) -> None:
    """A clear error for a forward that brings no new tokens over a cache: ``generate`` passes only the ids
    past the cache's length, so ids the cache already holds (a second question over the same compacted
    cache, which the first ``generate`` extended) arrive as nothing."""
    if hidden_states.shape[1] == 0:
        held = cache.get_seq_length() if cache is not None else 0
        if not held:
            raise ValueError("the forward brings no tokens: pass at least one token id a row")
        raise ValueError(
            f"the forward brings no new tokens over a cache of {held}: generate and the model take only the "
            "ids past the cache's length, and these ids are all in it. Pass the tokens that follow the "
            "cache's; to ask one compacted prompt several questions, give each its own copy "
            "(copy.deepcopy(cache)): generate extends the cache it is given.")


UNKNOWN = "unknown"  # appended_ids of a cache extended by embeddings, not ids: nothing to check against


def record_appended(cache, ids: torch.Tensor | None) -> None:
    """Remember the token ids a forward appends behind a compacted prefix (``cache.length`` set), so that
    :func:`refuse_another_question` can tell a continuation from a second question over the same cache."""
    if getattr(cache, "length", None) is None or isinstance(getattr(cache, "appended_ids", None), str):
        return
    if ids is None:
        cache.appended_ids = UNKNOWN
    else:
        old = cache.appended_ids
        cache.appended_ids = ids.detach() if old is None else torch.cat([old, ids.to(old.device)], 1)


def refuse_another_question(cache, input_ids: torch.Tensor) -> None:
    """A clear error where ``generate`` is given ids that do not continue what a compacted cache holds: a
    second question over the cache an earlier ``generate`` extended would otherwise be answered after the
    first question and its answer, silently (generate passes only the ids past the cache's length)."""
    seen = getattr(cache, "appended_ids", None)
    if getattr(cache, "length", None) is None or not isinstance(seen, torch.Tensor) or seen.shape[1] == 0:
        return
    start, n = cache.length, seen.shape[1]
    given = input_ids[:, start:start + n]
    if given.shape == seen.shape and torch.equal(given.to(seen.device), seen):
        return
    where = _first_difference(given, seen, start)
    raise ValueError(
        f"this compacted cache already holds {n} tokens after its prompt of {start} (from an earlier "
        f"generate or forward), and the ids given do not continue them ({where}): generate would answer "
        "after those. Give each question its own copy of the cache stiefkv.compact returned "
        "(copy.deepcopy(cache)), or pass the prompt, the tokens since and then the new ones. A chat "
        "turn tokenized again from its text can split the last answer otherwise than generate made it: build "
        "the next turn's ids as torch.cat([the ids generate returned, the new turn's ids], 1).")


def refuse_another_prompt(cache, input_ids: torch.Tensor) -> None:
    """A clear error where ``generate`` is given ids whose prompt part is not the prompt a compacted cache
    was compacted from (``cache.prompt_ids``, recorded by :func:`stiefkv.compact`; of padded prompts only
    their real tokens, ``cache.row_lengths``): generate passes only the ids past the cache's length, so
    another prompt of the same length was answered from the first one's entries, silently."""
    held = getattr(cache, "prompt_ids", None)
    if getattr(cache, "length", None) is None or not isinstance(held, torch.Tensor):
        return
    given = input_ids[:, :held.shape[1]].to(held.device)
    if given.shape != held.shape:
        return  # too few ids: refused by refuse_no_tokens; other rows: by repeats_of
    same = given == held
    lengths = getattr(cache, "row_lengths", None)
    if lengths is not None:  # the padding's ids are not the prompt's
        C = held.shape[1]
        same |= torch.arange(C, device=held.device)[None] < (C - lengths.to(held.device))[:, None]
    if bool(same.all()):
        return
    row, col = (int(i) for i in (~same).nonzero()[0])
    where = f"row {row}, " if held.shape[0] > 1 else ""
    raise ValueError(
        f"the ids given do not begin with the prompt this cache was compacted from ({where}position {col}: "
        f"id {int(given[row, col])} given, {int(held[row, col])} held): a compacted cache stands for its own "
        "prompt only. Pass that prompt's ids, then the new ones; for another prompt, prefill and compact it")


def tokens_to_crop(reported: int, length: int, size: int) -> int:
    """The tokens ``crop(size)`` removes from a compacted cache reporting ``reported`` (its prompt's
    ``length`` and the tokens appended since): ``size`` ≤ 0 removes ``-size`` (transformers ≥ 5.24), > 0 keeps
    that length (earlier versions). Only the appended tokens can go: the compacted entries stand for the
    whole prompt."""
    remove = -size if size <= 0 else reported - size
    if remove > reported - length:
        raise ValueError(f"crop would remove {remove} tokens from a compacted cache that holds "
                         f"{reported - length} tokens after its compacted prompt of {length}: only those can "
                         "be removed (prefill and compact the prompt again for less)")
    return max(0, remove)


def _first_difference(given: torch.Tensor, seen: torch.Tensor, start: int) -> str:
    """Where the ids ``given`` after a compacted prompt of ``start`` tokens leave the ``seen`` ones, in words:
    the first differing id of the first row that differs, or where the ids stop."""
    rows, width = given.shape
    if rows != seen.shape[0]:
        return f"{rows} row{'s' * (rows != 1)} against the cache's {seen.shape[0]}"
    same = given.to(seen.device)[:, :width] == seen[:, :width]
    if bool(same.all()):
        return f"they end at position {start + width}, inside the held tokens"
    row, col = (int(i) for i in (~same).nonzero()[0])
    where = f"row {row}, " if rows > 1 else ""
    return (f"{where}position {start + col}: id {int(given[row, col])} given, {int(seen[row, col])} held")


def _check_held(layer_idx: int, keys: int, values: int, positions: int) -> None:
    """A clear error when a layer's latents and the cache's positions disagree in length: something shortened
    the layer outside StiefKV (a kvpress press's forward hook prunes ``cache.layers[i].keys`` but not the
    positions the rotation and the kernels read)."""
    if keys != positions or values != positions:
        raise ValueError(
            f"layer {layer_idx} of this LatentCache holds {keys} key and {values} value latents but "
            f"{positions} positions: something shortened it outside StiefKV (a kvpress press, or "
            "cache.layers edited by hand). A served model's cache is shortened by stiefkv.compact(model, "
            "cache, keep=...); kvpress's presses work on an uncompressed model's cache only.")


def as_latent_cache(cache) -> LatentCache | None:
    """``cache`` itself when it is a :class:`LatentCache` (or None); any other cache is refused."""
    if cache is None or isinstance(cache, LatentCache):
        return cache
    if getattr(cache, "rows", None) is not None:  # stiefkv.padded.PaddedPromptCache of a served model
        raise ValueError("this cache of padded prompts (stiefkv.prefill with an attention_mask, on a served "
                         "model) holds each row's latents apart, for stiefkv.compact only: compact it first, "
                         "or read the padded batch from a new cache with its attention_mask")
    raise ValueError(
        "a model served by stiefkv.load keeps its keys and values as latents in a stiefkv.LatentCache; "
        f"got a {type(cache).__name__}. Pass cache=stiefkv.LatentCache() (or past_key_values=), or no "
        "cache at all: generate and use_cache=True create one (cache_implementation='static' makes a "
        "stiefkv StaticLatentCache; 'quantized' is not supported)."
    )


def _visible(row: torch.Tensor) -> torch.Tensor:
    """Where a boolean or additive mask row lets a key through."""
    return row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2


LEFT_PADDING_ONLY = ("StiefKV's latent attention supports left-padded batches only; got a mask with padding "
                     "on the right or holes. Set tokenizer.padding_side = 'left'. (A right-padded batch is "
                     "read in one forward from an empty cache, as scoring does, but a cache it filled holds "
                     "its padding and cannot be continued.)")


def left_pads(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's left padding ``[B]`` from a user's ``[B, N]`` attention mask; a clear error for a mask the
    latent attention cannot represent: values other than 0 and 1, padding on the right or holes, a row with
    no token."""
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (a token) only, as a tokenizer gives it")
    mask = attention_mask.bool()
    pads = (~mask).sum(1)
    left = torch.arange(mask.shape[1], device=mask.device)[None, :] >= pads[:, None]
    if not torch.equal(left, mask):
        raise ValueError(LEFT_PADDING_ONLY)
    if bool((pads == mask.shape[1]).any()):
        empty = (pads == mask.shape[1]).nonzero()[0, 0].item()
        raise ValueError(f"attention_mask row {empty} has no token (all padding): each row needs one or more")
    return pads


def appended_bias(incoming: torch.Tensor | None, n: int, like: torch.Tensor) -> torch.Tensor:
    """The logit bias ``[B, n]`` (``like``'s dtype and device) of the ``n`` tokens a forward appends behind
    a compacted prefix: 0 for a token, :data:`~stiefkv.compaction.PAD_BETA` for padding, so that padding is
    never attended, then or later. ``incoming``: the forward's columns ``[B, n]`` of its 2-D attention mask
    (True for a token), which :mod:`stiefkv.compacted`'s check of the forward sets on the cache; None when
    it had no mask."""
    B = like.shape[0]
    if incoming is None or n == 0:
        return like.new_zeros(B, n)
    real = incoming[:, -n:].to(like.device)
    return torch.where(real, 0.0, PAD_BETA).to(like.dtype).expand(B, n)


def record_appended_mask(cache, n: int) -> None:
    """Remember which of the ``n`` tokens a forward appended behind a compacted prefix were padding
    (``cache.incoming``, None for none): the rows' own positions count their tokens only
    (:func:`real_appended`), and a ``CompactedCache`` reads them again at every forward. On the device of
    the cache's β, where the layers read them; None while no token appended was padding (the common case:
    nothing to build or grow at each decode step)."""
    if getattr(cache, "length", None) is None or not n or not cache.beta:
        return
    beta, old = cache.beta[0], getattr(cache, "appended_mask", None)
    incoming, cache.incoming = getattr(cache, "incoming", None), None
    if incoming is None and old is None:
        return
    ones = torch.ones(beta.shape[0], n, dtype=torch.bool, device=beta.device)
    incoming = ones if incoming is None else incoming[:, -n:].to(beta.device)
    if old is None:  # the tokens appended before this forward were all tokens
        before = cache.get_seq_length() - cache.length - n
        old = torch.ones(beta.shape[0], before, dtype=torch.bool, device=beta.device)
    cache.appended_mask = torch.cat([old, incoming], 1)


def mask_appended(cache, held: torch.Tensor) -> None:
    """Which of the tokens a compacted cache holds behind its prefix are padding, from a later forward's
    mask ``held`` ``[B, appended]`` (True for a token): padding ``generate`` fed a row that ended early is
    held as tokens, and the next turn's mask hides it. A ``LatentCache`` writes their β again in every
    layer; a ``CompactedCache`` makes its mask from ``appended_mask`` at every forward."""
    beta = cache.beta[0] if cache.beta else None
    if beta is None or held.shape[0] != beta.shape[0]:
        return
    held = held.to(beta.device)
    cache.appended_mask = held
    if isinstance(cache, LatentCache):
        for i, t in enumerate(cache.prefix):
            n = cache.beta[i].shape[2] - t
            if n == held.shape[1]:
                cache.beta[i][..., t:] = appended_bias(held, n, cache.beta[i])[:, None]


def first_token_positions(positions: torch.Tensor, incoming: torch.Tensor | None) -> torch.Tensor:
    """Each row's position ``[B]`` (``[1]`` for positions shared by the rows and no mask; on the host) of the
    first of a forward's new tokens that is not padding (``incoming``: their mask columns, True for a token;
    None for none padded); -1 for a row whose new tokens are all padding. Padding takes any position (the
    mask's count, or 0), so the rows' positions are read at their tokens."""
    pos = positions.detach().reshape(-1, positions.shape[-1]).cpu()
    if incoming is None:
        return pos[:, 0]
    real = incoming.cpu()
    pos = pos.expand(real.shape[0], -1) if pos.shape[0] == 1 else pos
    first = pos.gather(1, real.to(torch.uint8).argmax(1, keepdim=True))[:, 0]
    return torch.where(real.any(1), first, -1)


def real_appended(cache) -> torch.Tensor | int:
    """The tokens, not padding, appended behind a compacted prefix: ``[B]``, or the count for every row where
    none was recorded as padding."""
    mask = getattr(cache, "appended_mask", None)
    return mask.sum(1) if mask is not None else cache.get_seq_length() - cache.length


def lengths_from_mask(mask: torch.Tensor | None, batch: int, n_keys: int) -> torch.Tensor | None:
    """Real keys per row ``[B]`` from the model's 4-D attention mask, or None when nothing is padded.

    Only left padding is representable in the kernels' interface; any other mask is refused.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"LowRankAttention needs a 4-D tensor attention mask, got {type(mask).__name__}")
    visible = _visible(mask[:, 0, -1, -n_keys:]).expand(batch, n_keys)
    lengths = visible.sum(dim=-1)
    ends = torch.full_like(lengths, n_keys)  # a row's real keys are [n_keys − lengths, ends)
    left = (visible == reference.key_padding_mask(lengths, batch, n_keys, visible.device)).all(-1)
    if not bool(left.all()):
        ends = _right_padded_ends(mask, visible, lengths, left, n_keys)
        lengths = torch.where(left, lengths, n_keys)
    if mask.shape[2] > 1:
        _check_causal_rows(mask, lengths, ends, batch, n_keys)
    return None if bool((lengths == n_keys).all()) else lengths.to(torch.int32)


def _right_padded_ends(mask: torch.Tensor, visible: torch.Tensor, lengths: torch.Tensor, left: torch.Tensor,
                       n_keys: int) -> torch.Tensor:
    """Where each row's real keys end ``[B]``, for a batch whose rows that are not left-padded are padded on
    the right. That is representable only in a forward whose queries are all the keys (from an empty cache,
    as scoring runs): causal attention then gives every real query the keys an unpadded row would, and the
    padding queries' outputs are not defined (they are discarded). Anything else is refused."""
    right = (visible == (torch.arange(n_keys, device=visible.device)[None, :] < lengths[:, None])).all(-1)
    if mask.shape[2] != n_keys or not bool((left | right).all()):
        raise ValueError(LEFT_PADDING_ONLY)
    return torch.where(left, n_keys, lengths)


NOT_CAUSAL = ("StiefKV's latent attention is causal over left-padded rows; this 4-D attention_mask hides "
              "other keys from some queries (packed documents, a custom pattern), which the latent attention "
              "cannot represent: run each document as its own row, or the model unserved (stiefkv.unload)")
_CHECKED: list = [None]  # (a weak reference to, and the key of) the last mask found causal: a forward's
# layers share one. Its object, not its address: a new mask at a freed one's address is checked again.


def forget_checked_mask() -> None:
    """Check the next mask again (each forward of a served model starts so): an inference tensor has no
    version, so a mask edited in place between forwards would otherwise pass as the one checked before."""
    _CHECKED[0] = None


def _check_causal_rows(mask: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor, batch: int,
                       n_keys: int) -> None:
    """Refuse a mask whose rows of real queries are not causal with left padding (or right padding, which
    ends a row's real keys at ``ends``): only the last row was read, so the rows before it of a packed or
    custom mask were silently attended as causal."""
    key = (mask.data_ptr(), tuple(mask.shape), mask._version if not mask.is_inference() else 0, n_keys)
    memo = _CHECKED[0]
    if memo is not None and memo[0]() is mask and memo[1] == key:
        return
    N = mask.shape[2]
    visible = _visible(mask[:, 0, :, -n_keys:]).expand(batch, N, n_keys)
    i = torch.arange(N, device=mask.device)
    j = torch.arange(n_keys, device=mask.device)
    pads = (n_keys - lengths.to(mask.device))[:, None]
    causal = j[None, :] <= (n_keys - N + i)[:, None]
    expected = causal[None] & (j[None, None, :] >= pads[..., None])
    at = (n_keys - N + i)[None, :]
    real = (at >= pads) & (at < ends.to(mask.device)[:, None])
    # a left padding query's row sees nothing, or (transformers' fix for rows SDPA would turn to NaN)
    # everything; a right padding query's output is not defined (scoring discards it)
    whole = visible.all(-1) | ~visible.any(-1) | (at >= pads)
    if bool(((visible != expected) & real[..., None]).any()) or not bool((whole | real).all()):
        raise ValueError(NOT_CAUSAL)
    _CHECKED[0] = (weakref.ref(mask), key)
