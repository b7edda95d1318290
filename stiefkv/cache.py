"""The latent cache: what a model served by :func:`stiefkv.load` keeps per token, and nothing else.

:class:`LatentCache` is a transformers ``Cache`` whose layers hold ``z_k`` ``[B, G, N, r_k]`` and ``z_v``
``[B, G, N, r_v]``. Besides the latents it owns, as its own fields, what attention over them needs: the
token positions ``[B, N]`` (``pre_rope`` rotates rebuilt keys at them) and the valid key lengths of a
left-padded batch. Any other cache reaching a compressed model is refused with a message that says what
to pass instead: it would hold latents it cannot account for, and report sizes that are not ours.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from stiefkv.kernels import reference


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
    """

    def __init__(self):
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.lengths: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held: every layer's latents, the positions and the lengths."""
        total = sum(t.nbytes for t in (self.positions, self.lengths) if t is not None)
        for layer in self.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.nbytes
        return int(total)

    def update_layer(self, z_k: torch.Tensor, z_v: torch.Tensor, layer_idx: int, positions: torch.Tensor,
                     attention_mask: torch.Tensor | None):
        """Append one layer's new latents ``[B, G, n, r]`` at ``positions`` ``[B, n]``.

        Returns every cached ``z_k, z_v`` of the layer, all positions ``[B, N]`` and the valid lengths
        ``[B]`` (or None). Layer 0 appends the positions and reads the mask; later layers reuse both.
        """
        z_k, z_v = self.update(z_k, z_v, layer_idx)
        if layer_idx == 0:
            positions = positions.to(torch.int32)
            old = self.positions
            self.positions = positions if old is None else torch.cat([old, positions], 1)
            self.lengths = lengths_from_mask(attention_mask, z_k.shape[0], z_k.shape[2])
        return z_k, z_v, self.positions, self.lengths

    # The positions and lengths must follow every batch or length edit transformers makes to the layers.
    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self.positions = _rows(self.positions, beam_idx)
        self.lengths = _rows(self.lengths, beam_idx)

    def crop(self, max_length: int):
        super().crop(max_length)
        if self.positions is not None:
            self.positions = self.positions[:, : self.get_seq_length()]
        # lengths are recomputed from the mask by the next forward, which sees the cropped length

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        for name in ("positions", "lengths"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self.positions = _rows(self.positions, indices)
        self.lengths = _rows(self.lengths, indices)

    def reset(self):
        super().reset()
        self.positions = self.lengths = None


def _rows(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if t is None else t.index_select(0, index.to(t.device))


def cache_keyword(model: nn.Module) -> str:
    """The keyword this transformers version's ``forward`` takes a cache by (renamed in 5.24)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def as_latent_cache(cache) -> LatentCache | None:
    """``cache`` itself when it is a :class:`LatentCache` (or None); any other cache is refused."""
    if cache is None or isinstance(cache, LatentCache):
        return cache
    raise ValueError(
        "a model served by stiefkv.load keeps its keys and values as latents in a stiefkv.LatentCache; "
        f"got a {type(cache).__name__}. Pass cache=stiefkv.LatentCache() (or past_key_values=), or no "
        "cache at all: generate and use_cache=True create one. (cache_implementation='static' and "
        "'quantized' are not supported.)"
    )


def lengths_from_mask(mask: torch.Tensor | None, batch: int, n_keys: int) -> torch.Tensor | None:
    """Real keys per row ``[B]`` from the model's 4-D attention mask, or None when nothing is padded.

    Only left padding is representable in the kernels' interface; any other mask is refused.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"LowRankAttention needs a 4-D tensor attention mask, got {type(mask).__name__}")
    row = mask[:, 0, -1, -n_keys:]
    visible = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    visible = visible.expand(batch, n_keys)
    lengths = visible.sum(dim=-1)
    if not torch.equal(visible, reference.key_padding_mask(lengths, batch, n_keys, visible.device)):
        raise ValueError(
            "StiefKV's latent attention supports left-padded batches only; got a mask with padding on the "
            "right or holes. Set tokenizer.padding_side = 'left'."
        )
    return None if bool((lengths == n_keys).all()) else lengths.to(torch.int32)
