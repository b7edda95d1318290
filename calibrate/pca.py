"""PCA bases per KV head (the EigenAttention-style baseline, and the Stiefel starting point).

Keys (in the chosen key mode) and values are accumulated as uncentred second moments ``Σ x xᵀ`` per KV
head: the bases reconstruct ``x ≈ P Pᵀ x`` with no mean term, so the top eigenvectors of the second
moment, not of the covariance, minimise the squared reconstruction error.
"""

from __future__ import annotations

import torch

from stiefkv.layers import LayerBatch, project_qkv, rotate_with
from stiefkv.models import decoder_layers


class SecondMoments:
    """Streaming ``Σ k kᵀ`` and ``Σ v vᵀ`` ``[G, d, d]`` (float64) for every layer; ``shared``: over the
    heads' channels side by side, ``[1, G·d, G·d]``."""

    def __init__(self, model, key_mode: str, shared: bool = False):
        self.layers = decoder_layers(model)
        self.key_mode = key_mode
        self.shared = shared
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def __call__(self, batch: LayerBatch) -> None:
        layer = self.layers[batch.layer_idx]
        _, k, v = project_qkv(layer.self_attn, layer.input_layernorm(batch.hidden))
        if self.key_mode == "post_rope":
            k = rotate_with(k, *batch.position_embeddings)
        for store, x in ((self.keys, k), (self.values, v)):
            x = x.double()
            if self.shared:
                B, G, N, d = x.shape
                x = x.transpose(1, 2).reshape(B, 1, N, G * d)
            m = torch.einsum("bgnd,bgne->gde", x, x)
            store[batch.layer_idx] = store[batch.layer_idx] + m if batch.layer_idx in store else m


def top_eigenvectors(moment: torch.Tensor, rank: int) -> torch.Tensor:
    """The ``rank`` leading eigenvectors ``[G, d, rank]`` (float32, orthonormal) of ``moment``
    ``[G, d, d]``."""
    _, vecs = torch.linalg.eigh(moment.double())  # ascending eigenvalues
    basis = vecs.flip(-1)[..., :rank]
    q, r = torch.linalg.qr(basis)  # re-orthonormalise after the float64 → float32 cast's rounding
    q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[..., None, :]
    # An eigenvector's sign is arbitrary, and eigh picks it differently on a GPU and a CPU: each column's
    # largest entry is made positive, so that a layer gets the same basis on any device (the rotation of
    # per-token storage mixes columns, so the signs matter once quantized).
    top = torch.gather(q, -2, q.abs().argmax(-2, keepdim=True))
    q = q * torch.where(top < 0, -1.0, 1.0).to(q.dtype)
    # Row-major like a basis read back from a checkpoint: CPU matmuls round differently per memory layout,
    # and a resumed calibration must reproduce an uninterrupted one bit for bit.
    return q.float().contiguous()
