"""Error–rank profiles: each layer's error with only its keys, or only its values, at each rank.

Cheap by default: PCA bases at every candidate rank (multiples of ``rank_step``), forward passes only.
A profile keeps raw sums — ``‖ŷ − y‖²`` per candidate, ``‖y‖²`` and ``‖y − x‖²`` — so the allocation
can weight a layer's error relative to its output (``output``) or to its own update (``update``). The
``kl`` profile measures instead what the model's prediction loses: the next-token KL of the whole model
when only this layer's keys (or values) are compressed — the layer's error carried through every later
layer to the logits, which a layer's own output error does not see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stiefkv.kernels import RopeSpec
from stiefkv.layers import LayerBatch, compressed_layer_output

WEIGHTINGS = ("output", "update", "kl")
KL_SEQUENCES = 4  # the kl profile holds the uncompressed log-probabilities of this many sequences


@dataclass
class LayerProfile:
    """``k[r]``/``v[r]``: summed ``‖ŷ − y‖²`` with only keys/values at rank ``r`` (PCA); norms for
    weighting."""

    ranks: list[int]
    k: list[float] = field(default_factory=list)
    v: list[float] = field(default_factory=list)
    sq_output: float = 0.0
    sq_update: float = 0.0
    metric: str = "sq_error"  # or "kl": k and v are next-token KLs of the whole model

    def relative(self, which: str, weighting: str = "output") -> list[float]:
        """Squared error relative to ``‖y‖²`` (``output``) or ``‖y − x‖²`` (``update``), or the KL, per
        rank."""
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if (weighting == "kl") != (self.metric == "kl"):
            raise ValueError(f"a {self.metric} profile cannot be weighted by {weighting!r}")
        if weighting == "kl":
            return list(getattr(self, which))
        den = self.sq_output if weighting == "output" else self.sq_update
        return [e / den for e in getattr(self, which)]

    def as_dict(self) -> dict:
        return {"ranks": self.ranks, "k": self.k, "v": self.v, "sq_output": self.sq_output,
                "sq_update": self.sq_update, "metric": self.metric}


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


class OutputKL:
    """Next-token KL of the model, uncompressed vs one layer replaced, on a few held calibration sequences.

    Runs only the tail of the model — from the replaced layer's held input through the later layers, the
    final norm and the LM head — against log-probabilities of the uncompressed model computed once.
    """

    def __init__(self, model, hidden: torch.Tensor, context: LayerBatch):
        base = getattr(model, "model", model)
        self.layers, self.norm, self.head = base.layers, base.norm, model.lm_head
        self.context = context
        self.base = self.log_probs(0, hidden, None)

    @torch.no_grad()
    def log_probs(self, start: int, hidden: torch.Tensor, replace) -> torch.Tensor:
        c = self.context
        h = hidden
        for j in range(start, len(self.layers)):
            if j == start and replace is not None:
                h = replace(LayerBatch(j, h, h, c.position_embeddings, c.attention_mask, c.position_ids))
            else:
                out = self.layers[j](h, attention_mask=c.attention_mask, position_ids=c.position_ids,
                                     position_embeddings=c.position_embeddings)
                h = out[0] if isinstance(out, tuple) else out
        return torch.log_softmax(self.head(self.norm(h)).float(), dim=-1)

    def __call__(self, start: int, hidden: torch.Tensor, replace) -> float:
        logp = self.log_probs(start, hidden, replace)
        return float((self.base.exp() * (self.base - logp)).sum(-1).mean())


@torch.no_grad()
def profile_layer_kl(layer, output_kl: OutputKL, layer_idx: int, hidden: torch.Tensor, bases_k, bases_v, *,
                     key_mode: str, rope: RopeSpec, ranks: list[int]) -> LayerProfile:
    """The ``kl`` profile of one layer from its held input ``hidden`` (the sequences ``output_kl`` uses)."""
    G, d, _ = bases_k(ranks[0]).shape
    full = torch.eye(d, device=hidden.device).expand(G, d, d)
    prof = LayerProfile(ranks=list(ranks), k=[0.0] * len(ranks), v=[0.0] * len(ranks), metric="kl")
    for i, r in enumerate(ranks):
        if r == d:
            continue
        for which, P_k, P_v in (("k", bases_k(r), full), ("v", full, bases_v(r))):
            replace = lambda b, P_k=P_k, P_v=P_v: compressed_layer_output(  # noqa: E731
                layer, b, P_k, P_v, key_mode=key_mode, rope=rope)
            getattr(prof, which)[i] = max(0.0, output_kl(layer_idx, hidden, replace))
    return prof
