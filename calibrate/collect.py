"""Activation collection: every decoder layer's input, output and attention context.

Two ways. :class:`LayerInputs` walks the model layer by layer: the hidden states of all calibration
sequences at the current layer's input are held once (``[S, N, D]``), reused by every consumer of that
layer, and advanced through the layer — no LM head, no second pass over the model, memory bounded by a
few ``[S, N, D]`` tensors. :func:`stiefkv.layers.layer_hooks` instead watches whole-model forwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from stiefkv.layers import LayerBatch, layer_hooks  # noqa: F401  (shared with evaluation)
from stiefkv.models import decoder_layers, text_config


def causal_mask(n: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive causal mask ``[1, 1, n, n]``: valid for eager and SDPA attention alike."""
    hidden = torch.ones(n, n, dtype=torch.bool, device=device).triu(1)
    mask = torch.zeros(n, n, dtype=dtype, device=device).masked_fill(hidden, torch.finfo(dtype).min)
    return mask[None, None]


class LayerInputs:
    """The calibration set's hidden states at one decoder layer's input, moved through the model layer by
    layer.

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

    def batches(self, targets: torch.Tensor | None = None,
                hidden: torch.Tensor | None = None) -> Iterator[LayerBatch]:
        """The current layer's inputs in batches, each with its slice of ``targets`` ``[S, N, D]`` as
        ``output``."""
        hidden = self.hidden if hidden is None else hidden
        for i in range(0, hidden.shape[0], self.batch_size):
            x = hidden[i:i + self.batch_size]
            y = targets[i:i + self.batch_size] if targets is not None else x
            yield LayerBatch(self.layer_idx, x, y, self.position_embeddings, self.attention_mask,
                             self.position_ids)

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
