"""Activation collection: every decoder layer's input, output and attention context, batch by batch.

The model runs once per batch of calibration sequences with forward hooks on its decoder layers; each
layer's :class:`LayerBatch` goes to a consumer while the batch is in memory and is then dropped, so
memory stays bounded by one batch whatever the number of sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

from stiefkv.models import decoder_layers


@dataclass
class LayerBatch:
    """What one decoder layer saw and produced for one batch.

    ``hidden`` ``[B, N, D]`` input, ``output`` ``[B, N, D]`` the uncompressed layer's output,
    ``position_embeddings`` the rotary ``(cos, sin)`` ``[B, N, d]``, ``attention_mask`` the 4-D mask (or
    None) and ``position_ids`` ``[1 or B, N]``.
    """

    layer_idx: int
    hidden: torch.Tensor
    output: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return self.position_ids.expand(self.hidden.shape[0], self.hidden.shape[1])


@contextmanager
def layer_hooks(model: nn.Module, consumer: Callable[[LayerBatch], None]) -> Iterator[None]:
    """Call ``consumer`` with every decoder layer's :class:`LayerBatch` during forwards; hooks removed after."""

    def hook(layer_idx):
        def fn(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            out = output[0] if isinstance(output, tuple) else output
            pos_ids = kwargs.get("position_ids")
            if pos_ids is None:
                pos_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
            consumer(LayerBatch(layer_idx, hidden, out, kwargs["position_embeddings"],
                                kwargs.get("attention_mask"), pos_ids))
        return fn

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(decoder_layers(model))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def stream_layers(model: nn.Module, sequences: torch.Tensor, consumer: Callable[[LayerBatch], None], *,
                  batch_size: int = 8, desc: str = "collecting") -> None:
    """Run ``sequences`` ``[S, N]`` through ``model`` in batches, feeding every layer's batch to ``consumer``."""
    device = next(model.parameters()).device
    with layer_hooks(model, consumer):
        for start in tqdm(range(0, len(sequences), batch_size), desc=desc, unit="batch", leave=False):
            model(sequences[start:start + batch_size].to(device), use_cache=False)
