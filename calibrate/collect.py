"""Activation collection: every decoder layer's input, output and attention context.

Two ways. :class:`LayerInputs` walks the model layer by layer: the hidden states of all calibration
sequences at the current layer's input are held once (``[S, N, D]``), reused by every consumer of that
layer, and advanced through the layer — no LM head, no second pass over the model, memory bounded by a
few ``[S, N, D]`` tensors. :func:`layer_hooks` instead watches whole-model forwards (evaluation).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from stiefkv.models import decoder_layers, text_config


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


def causal_mask(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask ``[1, 1, n, n]``: valid for eager and SDPA attention alike."""
    hidden = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    return torch.zeros(n, n, dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)[None, None]


class LayerInputs:
    """The calibration set's hidden states at one decoder layer's input, moved through the model layer by layer.

    Parameters
    ----------
    model : the causal LM.
    sequences : ``[S, N]`` token ids (no padding).
    batch_size : sequences per layer call.
    """

    def __init__(self, model: nn.Module, sequences: torch.Tensor, *, batch_size: int = 8):
        self.model = model
        self.layers = decoder_layers(model)
        self.batch_size = batch_size
        base = getattr(model, "model", model)
        device = next(model.parameters()).device
        S, N = sequences.shape
        with torch.no_grad():
            self.hidden = torch.cat([base.embed_tokens(sequences[i:i + batch_size].to(device))
                                     for i in range(0, S, batch_size)])
            self.position_ids = torch.arange(N, device=device)[None]
            self.position_embeddings = base.rotary_emb(self.hidden[:1], self.position_ids)
        self.attention_mask = causal_mask(N, self.hidden.dtype, device)
        self.layer_idx = 0
        self.num_layers = text_config(model.config).num_hidden_layers

    def batches(self, targets: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> Iterator[LayerBatch]:
        """The current layer's inputs in batches, each with its slice of ``targets`` ``[S, N, D]`` as ``output``."""
        hidden = self.hidden if hidden is None else hidden
        for i in range(0, hidden.shape[0], self.batch_size):
            x = hidden[i:i + self.batch_size]
            y = targets[i:i + self.batch_size] if targets is not None else x
            yield LayerBatch(self.layer_idx, x, y, self.position_embeddings, self.attention_mask, self.position_ids)

    @torch.no_grad()
    def run(self, layer: nn.Module | None = None, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """The current layer's output ``[S, N, D]`` on ``hidden`` (default: the held inputs)."""
        layer = self.layers[self.layer_idx] if layer is None else layer
        outs = []
        for b in self.batches(hidden=hidden):
            out = layer(b.hidden, attention_mask=b.attention_mask, position_ids=b.position_ids,
                        position_embeddings=b.position_embeddings)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs)

    def advance(self, next_hidden: torch.Tensor) -> None:
        """Move to the next layer, whose inputs are ``next_hidden``."""
        self.hidden = next_hidden
        self.layer_idx += 1
