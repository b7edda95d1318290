"""The decoder-layer objective: a layer with low-rank keys and values against the uncompressed layer.

The compressed layer runs the model's own projections, the keys and values through their bases (in the
chosen key mode), softmax attention, value mixing, ``o_proj``, the residual and the MLP, on the inputs the
uncompressed layer saw. Errors are on the layer output ``y`` ``[B, N, D]``: relative error
``‖ŷ − y‖_F / ‖y‖_F`` and the mean per-token cosine similarity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from stiefkv.attention import attend
from stiefkv.calibrate.collect import LayerBatch
from stiefkv.kernels import RopeSpec


def compressed_layer_output(layer: nn.Module, batch: LayerBatch, P_k: torch.Tensor, P_v: torch.Tensor, *,
                            key_mode: str, rope: RopeSpec, backend: str = "reference") -> torch.Tensor:
    """The decoder layer's output ``[B, N, D]`` with keys and values through ``P_k``, ``P_v``."""
    x = batch.hidden
    a = attend(layer.self_attn, layer.input_layernorm(x), P_k, P_v, key_mode=key_mode, rope=rope,
               position_embeddings=batch.position_embeddings, attention_mask=batch.attention_mask,
               positions=batch.positions, backend=backend)
    h = x + a
    return h + layer.mlp(layer.post_attention_layernorm(h))


@dataclass
class ErrorStats:
    """Running sums for a layer's relative error and mean token cosine."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    cos_sum: float = 0.0
    tokens: int = 0

    def add(self, y_hat: torch.Tensor, y: torch.Tensor) -> None:
        y_hat, y = y_hat.double(), y.double()
        self.sq_err += float((y_hat - y).pow(2).sum())
        self.sq_ref += float(y.pow(2).sum())
        self.cos_sum += float(torch.nn.functional.cosine_similarity(y_hat, y, dim=-1).sum())
        self.tokens += y.shape[0] * y.shape[1]

    @property
    def rel_error(self) -> float:
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref else float("nan")

    @property
    def cosine(self) -> float:
        return self.cos_sum / self.tokens if self.tokens else float("nan")

    def as_dict(self) -> dict:
        return {"rel_error": round(self.rel_error, 6), "cosine": round(self.cosine, 6)}
