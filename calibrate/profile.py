"""Error–rank profiles: each layer's output error with only its keys, or only its values, at each rank.

Cheap by default: PCA bases at every candidate rank (multiples of ``rank_step``), forward passes only.
A profile keeps raw sums — ``‖ŷ − y‖²`` per candidate, ``‖y‖²`` and ``‖y − x‖²`` — so the allocation
can weight a layer's error relative to its output (``output``) or to its own update (``update``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stiefkv.calibrate.collect import LayerBatch
from stiefkv.calibrate.objective import compressed_layer_output
from stiefkv.kernels import RopeSpec

WEIGHTINGS = ("output", "update")


@dataclass
class LayerProfile:
    """``k[r]``/``v[r]``: summed ``‖ŷ − y‖²`` with only keys/values at rank ``r`` (PCA); norms for weighting."""

    ranks: list[int]
    k: list[float] = field(default_factory=list)
    v: list[float] = field(default_factory=list)
    sq_output: float = 0.0
    sq_update: float = 0.0

    def relative(self, which: str, weighting: str = "output") -> list[float]:
        """Squared error relative to ``‖y‖²`` (``output``) or ``‖y − x‖²`` (``update``) per candidate rank."""
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        den = self.sq_output if weighting == "output" else self.sq_update
        return [e / den for e in getattr(self, which)]

    def as_dict(self) -> dict:
        return {"ranks": self.ranks, "k": self.k, "v": self.v, "sq_output": self.sq_output,
                "sq_update": self.sq_update}


def candidate_ranks(head_dim: int, rank_step: int) -> list[int]:
    return list(range(rank_step, head_dim + 1, rank_step))


@torch.no_grad()
def profile_layer(layer, batches: list[LayerBatch], bases_k, bases_v, *, key_mode: str, rope: RopeSpec,
                  ranks: list[int]) -> LayerProfile:
    """Profile one layer. ``bases_k(r)``/``bases_v(r)`` give the ``[G, d, r]`` basis at rank ``r``."""
    G, d, _ = bases_k(ranks[0]).shape
    full = torch.eye(d, device=batches[0].hidden.device).expand(G, d, d)
    prof = LayerProfile(ranks=list(ranks), k=[0.0] * len(ranks), v=[0.0] * len(ranks))
    for b in batches:
        y = b.output.double()
        prof.sq_output += float(y.pow(2).sum())
        prof.sq_update += float((y - b.hidden.double()).pow(2).sum())
        for i, r in enumerate(ranks):
            if r == d:
                continue  # full rank reproduces the layer exactly
            for which, P_k, P_v in (("k", bases_k(r), full), ("v", full, bases_v(r))):
                y_hat = compressed_layer_output(layer, b, P_k, P_v, key_mode=key_mode, rope=rope).double()
                getattr(prof, which)[i] += float((y_hat - y).pow(2).sum())
    return prof
