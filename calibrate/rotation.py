"""A rotation inside a latent subspace, learned on the orthogonal group, for latents stored per token.

A latent stored per token shares one scale and low among the channels of a token's group, so its
quantization error grows with the spread between the group's largest and smallest channel. Any ``r × r``
orthogonal ``R`` turns a basis ``P`` into ``P R`` with the same subspace, the same reconstruction and the
same attention; only the spread of the latents changes. The pipeline starts from a Hadamard (or DCT)
rotation, which spreads a dominant channel over all; this module refines it on the data: Riemannian Adam
on the orthogonal group (``geoopt.Stiefel`` of square matrices) minimising the mean squared range of the
groups (a smooth maximum minus a smooth minimum, so every channel near the extremes gets a gradient). The
rotation is kept only where it lowers the real quantization error on sequences it was not fitted on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stiefkv.calibrate.stiefel import geoopt_module
from stiefkv.quant import GROUP, QuantSpec, fake_quant

SOFTNESS = 0.05  # the smooth range's temperature, in units of the latents' standard deviation


@dataclass
class RotationResult:
    R: torch.Tensor  # [G, r, r], identity where learning did not pay
    error_start: float  # held-out quantization error with the starting basis
    error_best: float  # ... with the basis kept


def smooth_group_range(z: torch.Tensor, softness: float) -> torch.Tensor:
    """Per token and group of :data:`GROUP` channels, ``softmax − softmin`` of ``z`` ``[..., N, r]``
    (a smooth stand-in for ``max − min``): ``[..., N, ceil(r / GROUP)]``."""
    groups = z.split(GROUP, dim=-1)
    return torch.stack([(torch.logsumexp(g / softness, -1) + torch.logsumexp(-g / softness, -1)) * softness
                        for g in groups], -1)


def quant_error(z: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``Σ ‖ẑ − z‖²`` per head of ``z`` ``[B, G, N, r]``: ``[G]`` (float64)."""
    return (fake_quant(z, spec) - z).double().pow(2).sum(dim=(0, 2, 3))


def learn_rotation(z: torch.Tensor, spec: QuantSpec, *, steps: int = 100, lr: float = 5e-3,
                   holdout: int = 1) -> RotationResult:
    """An ``r × r`` rotation per head for latents ``z`` ``[B, G, N, r]`` (``B`` sequences) stored as
    ``spec`` (per token): fitted on ``B − holdout`` sequences, judged on the last ``holdout``. A head keeps
    the identity where the learned rotation does not lower the held-out error of ``spec``."""
    if spec.layout != "token" or not spec.quantized:
        raise ValueError(f"a rotation helps latents stored per token; got {spec}")
    B, G, _, r = z.shape
    z = z.float()
    fit, held = (z[:-holdout], z[-holdout:]) if 0 < holdout < B else (z, z)
    scale = fit.std().clamp_min(1e-12)
    eye = torch.eye(r, device=z.device).expand(G, r, r)
    geoopt = geoopt_module()
    R = geoopt.ManifoldParameter(eye.clone(), manifold=geoopt.Stiefel())
    opt = geoopt.optim.RiemannianAdam([R], lr=lr)
    with torch.enable_grad():
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            spread = smooth_group_range(torch.matmul(fit / scale, R.unsqueeze(0)), SOFTNESS)
            spread.pow(2).mean().backward()
            opt.step()
    # orthogonal to float64 rounding again (QR, signs fixed so that Q stays next to what was learned)
    Q, upper = torch.linalg.qr(R.detach().as_subclass(torch.Tensor).double())
    learned = (Q * torch.sign(torch.diagonal(upper, dim1=-2, dim2=-1)).unsqueeze(-2)).float()
    start = quant_error(held, spec)
    after = quant_error(torch.matmul(held, learned.unsqueeze(0)), spec)
    keep = after < start
    R_out = torch.where(keep[:, None, None], learned, eye)
    return RotationResult(R_out, float(start.sum()), float(torch.where(keep, after, start).sum()))
