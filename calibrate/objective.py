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

from stiefkv.attention import attend, project_qkv, rotate_with
from stiefkv.calibrate.collect import LayerBatch
from stiefkv.kernels import RopeSpec, reference


def compressed_layer_output(layer: nn.Module, batch: LayerBatch, P_k: torch.Tensor, P_v: torch.Tensor, *,
                            key_mode: str, rope: RopeSpec, backend: str = "reference") -> torch.Tensor:
    """The decoder layer's output ``[B, N, D]`` with keys and values through ``P_k``, ``P_v`` (unpadded ``batch``)."""
    x = batch.hidden
    # Calibration and evaluation batches are unpadded: attention is causal with no key mask, and passing none
    # spares the mask inspection (a device sync per call on the GPU).
    a = attend(layer.self_attn, layer.input_layernorm(x), P_k, P_v, key_mode=key_mode, rope=rope,
               position_embeddings=batch.position_embeddings, attention_mask=None,
               positions=batch.positions, backend=backend)
    h = x + a
    return h + layer.mlp(layer.post_attention_layernorm(h))


def attention_queries_keys(attn: nn.Module, normed: torch.Tensor, P_k: torch.Tensor | None, *, key_mode: str,
                           position_embeddings) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries ``[B, H, N, d]``, the original rotated keys and the keys rebuilt through ``P_k``
    (``[B, G, N, d]`` each): what the original and the compressed attention compare their logits on.

    ``pre_rope`` rebuilds ``P_k P_kᵀ k`` and then rotates it; ``post_rope`` projects the rotated key.
    """
    cos, sin = position_embeddings
    q, k, _ = project_qkv(attn, normed)
    q, k_rot = rotate_with(q, cos, sin), rotate_with(k, cos, sin)
    if P_k is None:
        return q, k_rot, k_rot
    project = lambda x: torch.einsum("bgnd,gdr,ger->bgne", x.float(), P_k, P_k).to(x.dtype)  # noqa: E731
    k_low = rotate_with(project(k), cos, sin) if key_mode == "pre_rope" else project(k_rot)
    return q, k_rot, k_low


def attention_kl(q_t, k_t, q_s, k_s, **kwargs) -> torch.Tensor:
    """StreamKL on CUDA tensors, the PyTorch reference elsewhere.

    Decided by device alone — not by ``TRITON_INTERPRET``, which is for the kernel tests — so calibration
    and evaluation on the CPU never reach Triton's interpreter.
    """
    if not q_t.is_cuda:
        return reference.attention_kl(q_t, k_t, q_s, k_s, **kwargs)
    from stiefkv.kernels.streamkl import attention_kl as streamed  # imports Triton: only where it runs

    return streamed(q_t, k_t, q_s, k_s, **kwargs)


def layer_attention_kl(layer: nn.Module, batch: LayerBatch, P_k: torch.Tensor, *, key_mode: str,
                       reduction: str = "mean") -> torch.Tensor:
    """``KL(P_orig ‖ P_compressed)`` of the layer's attention rows (StreamKL: no N×N on CUDA)."""
    attn = layer.self_attn
    q, k_t, k_s = attention_queries_keys(attn, layer.input_layernorm(batch.hidden), P_k, key_mode=key_mode,
                                         position_embeddings=batch.position_embeddings)
    return attention_kl(q, k_t, q, k_s, causal=True, scale_t=attn.scaling, scale_s=attn.scaling,
                        reduction=reduction)


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
