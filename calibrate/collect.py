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


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class Context:
    """The attention context of ``N``-token sequences (rotary embeddings, causal mask, positions), made once
    per device the model's layers sit on (:func:`stiefkv.place_layers` spreads them over several)."""

    def __init__(self, model: nn.Module, n: int, dtype: torch.dtype):
        self.rotary = getattr(model, "model", model).rotary_emb
        self.n, self.dtype, self.made = n, dtype, {}

    @torch.no_grad()
    def on(self, device: torch.device):
        """``(position_embeddings, attention_mask, position_ids)`` on ``device``."""
        if device not in self.made:
            src = module_device_or_none(self.rotary) or device  # computed where the rotary module is
            probe = torch.zeros(1, 1, device=src, dtype=self.dtype)  # gives the tables' dtype
            cos, sin = self.rotary(probe, torch.arange(self.n, device=src)[None])
            self.made[device] = ((cos.to(device), sin.to(device)), causal_mask(self.n, self.dtype, device),
                                 torch.arange(self.n, device=device)[None])
        return self.made[device]


def module_device_or_none(module: nn.Module) -> torch.device | None:
    """The device of ``module``'s first parameter or buffer (None for a module holding neither)."""
    for t in [*module.parameters(), *module.buffers()]:
        return t.device
    return None


class LayerInputs:
    """The calibration set's hidden states at one decoder layer's input, moved through the model layer by
    layer — and from device to device where the layers are spread over several.

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
        device = module_device(base.embed_tokens)
        S, N = sequences.shape
        with torch.no_grad():
            self.hidden = torch.cat([base.embed_tokens(sequences[i:i + batch_size].to(device))
                                     for i in range(0, S, batch_size)])
        self.context = Context(model, N, self.hidden.dtype)
        self.layer_idx = 0
        self.num_layers = text_config(model.config).num_hidden_layers
        self.hidden = self.hidden.to(self.device)

    @property
    def device(self) -> torch.device:
        """Where the current layer sits (its inputs are moved there)."""
        return module_device(self.layers[self.layer_idx])

    @property
    def position_embeddings(self):
        return self.context.on(self.device)[0]

    @property
    def attention_mask(self) -> torch.Tensor:
        return self.context.on(self.device)[1]

    @property
    def position_ids(self) -> torch.Tensor:
        return self.context.on(self.device)[2]

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
        """Move to the next layer, whose inputs are ``next_hidden`` (moved to its device)."""
        self.layer_idx += 1
        self.hidden = next_hidden.to(self.device) if self.layer_idx < self.num_layers else next_hidden
