"""The calibration objective beyond the layer output: the attention KL of one layer (StreamKL on CUDA).

The decoder-layer output with low-rank keys and values, its error statistics and the queries/keys the
attention KL compares live in the neutral :mod:`stiefkv.layers` (evaluation uses them too); they are
re-exported here for calibration code.
"""

from __future__ import annotations

import torch
from torch import nn

from stiefkv.layers import (  # noqa: F401
    ErrorStats,
    LayerBatch,
    attention_kl,
    attention_queries_keys,
    compressed_layer_output,
)


def layer_attention_kl(layer: nn.Module, batch: LayerBatch, P_k: torch.Tensor, *, key_mode: str,
                       reduction: str = "mean") -> torch.Tensor:
    """``KL(P_orig ‖ P_compressed)`` of the layer's attention rows (StreamKL: no N×N on CUDA)."""
    attn = layer.self_attn
    q, k_t, k_s = attention_queries_keys(attn, layer.input_layernorm(batch.hidden), P_k, key_mode=key_mode,
                                         position_embeddings=batch.position_embeddings)
    return attention_kl(q, k_t, q, k_s, causal=True, scale_t=attn.scaling, scale_s=attn.scaling,
                        reduction=reduction)
