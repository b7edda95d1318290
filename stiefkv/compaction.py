"""Attention-matching compaction of a block of cached tokens (the token axis; DESIGN.md, Compaction).

A block of ``T`` keys and values of one KV head becomes ``t ≪ T`` entries ``(C_k, β, C_v)`` that, for a set
of reference queries ``q``, reproduce both the block's attention output and its attention mass:

- output: ``softmax(q C_kᵀ·s + β) C_v ≈ softmax(q Kᵀ·s) V``;
- mass: ``Σ_j exp(q·c_j·s + β_j) ≈ Σ_j exp(q·k_j·s)``.

Reproducing both makes attention over the compacted block concatenated with any other tokens reproduce
attention over the original block with them: the block enters the softmax only through its mass and its
mass-weighted output. Three steps, after Zweiger et al., "Fast KV Compaction via Attention Matching"
(arXiv 2602.16284):

1. keys ``C_k`` are chosen from the block: those with the highest attention of the reference queries
   (``attention``), or greedily by orthogonal matching pursuit on the masses (``omp``);
2. ``w = exp(β) ≥ 0`` by non-negative least squares on the masses, each query's mass relative to itself;
3. ``C_v`` by ridge-regularised least squares on the outputs, pulled towards the chosen keys' own values.

Everything here is per KV head on plain tensors (the PyTorch reference; float64 for the fits). The
queries of the ``H / G`` query heads that share a KV head are all reference queries of that head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import nnls

SELECTIONS = ("attention", "omp")
MIN_WEIGHT = 1e-12  # a key NNLS gives no weight gets β = log of this: present, but it never wins attention
DEFAULT_RIDGE = 1e-3  # × the mean diagonal of AᵀA: keeps C_v near the chosen values where A says little


@dataclass
class Compacted:
    """One KV head's compacted block: ``index`` ``[t]`` of the chosen keys in the block (so ``C_k`` are the
    block's keys there, and their positions are the block's), ``beta`` ``[t]``, ``values`` ``[t, d_v]``."""

    index: torch.Tensor
    beta: torch.Tensor
    values: torch.Tensor


def _logits(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(q·k·s − m_q)`` ``[m, T]`` and the row maxima ``m_q`` ``[m]`` (float64)."""
    s = (queries.double() @ keys.double().T) * scale
    top = s.amax(-1, keepdim=True)
    return torch.exp(s - top), top.squeeze(-1)


def _select_attention(E: torch.Tensor, mass: torch.Tensor, t: int) -> torch.Tensor:
    """The ``t`` keys with the highest mean attention probability over the reference queries."""
    return torch.topk((E / mass[:, None]).mean(0), t).indices.sort().values


def _select_omp(E: torch.Tensor, mass: torch.Tensor, t: int) -> torch.Tensor:
    """Orthogonal matching pursuit on the relative masses: each step adds the key whose column best explains
    what the chosen ones leave of every query's mass (the residual after projecting onto their span, kept by
    Gram–Schmidt: O(m·t) per step, no solve). The weights are fitted afterwards (:func:`_fit_weights`)."""
    A = E / mass[:, None]  # [m, T]
    norms = A.norm(dim=0).clamp_min(1e-300)
    residual = torch.ones(A.shape[0], dtype=A.dtype)
    basis = torch.empty(A.shape[0], t, dtype=A.dtype)
    taken = torch.zeros(A.shape[1], dtype=torch.bool)
    chosen = []
    for k in range(t):
        score = (A.T @ residual) / norms
        score[taken] = -torch.inf
        j = int(score.argmax())
        chosen.append(j)
        taken[j] = True
        q = A[:, j] - basis[:, :k] @ (basis[:, :k].T @ A[:, j])
        q = q - basis[:, :k] @ (basis[:, :k].T @ q)  # twice: Gram–Schmidt loses orthogonality once
        q = q / q.norm().clamp_min(1e-300)
        basis[:, k] = q
        residual = residual - q * (q @ residual)
    return torch.tensor(sorted(chosen))


def _fit_weights(E_sel: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """``w ≥ 0`` with ``Σ_j w_j E_qj ≈ mass_q`` relative to each query's mass (NNLS)."""
    A = (E_sel / mass[:, None]).numpy()
    w, _ = nnls(A, np.ones(A.shape[0]))
    return torch.from_numpy(w)


def compact_head(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, t: int, *, scale: float,
                 selection: str = "attention", fit_beta: bool = True, refit_values: bool = True,
                 ridge: float = DEFAULT_RIDGE) -> Compacted:
    """Compact one KV head's block ``keys`` ``[T, d]``, ``values`` ``[T, d_v]`` to ``t`` entries for the
    reference ``queries`` ``[m, d]`` (logits ``q·k·scale``). ``fit_beta=False`` keeps β = 0;
    ``refit_values=False`` keeps the chosen keys' own values."""
    T = keys.shape[0]
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}; got {selection!r}")
    if not 1 <= t <= T:
        raise ValueError(f"cannot keep {t} of {T} tokens: keep between 1 and {T}")
    E, _ = _logits(queries, keys, scale)
    mass = E.sum(-1)
    index = (_select_attention if selection == "attention" else _select_omp)(E, mass, t)
    E_sel = E[:, index]
    w = _fit_weights(E_sel, mass) if fit_beta else torch.ones(t, dtype=torch.float64)
    w = w.clamp(min=MIN_WEIGHT)
    chosen = values.double()[index]
    if refit_values:
        A = E_sel * w / (E_sel * w).sum(-1, keepdim=True)  # the compacted block's attention [m, t]
        target = (E @ values.double()) / mass[:, None]  # the block's output [m, d_v]
        gram = A.T @ A
        lam = ridge * float(gram.diagonal().mean())
        eye = torch.eye(t, dtype=torch.float64)
        chosen = torch.linalg.solve(gram + lam * eye, A.T @ target + lam * chosen)
    return Compacted(index, torch.log(w).to(keys.dtype), chosen.to(values.dtype))


def compacted_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, *, scale: float,
                        beta: torch.Tensor | None = None) -> torch.Tensor:
    """``softmax(q kᵀ·scale + β) v`` ``[m, d_v]``: attention over a (compacted) block, β = 0 where None."""
    s = (queries.double() @ keys.double().T) * scale
    if beta is not None:
        s = s + beta.double()
    return torch.softmax(s, -1) @ values.double()


def log_mass(queries: torch.Tensor, keys: torch.Tensor, *, scale: float,
             beta: torch.Tensor | None = None) -> torch.Tensor:
    """``log Σ_j exp(q·k_j·scale + β_j)`` ``[m]``: a block's attention mass for each query."""
    s = (queries.double() @ keys.double().T) * scale
    if beta is not None:
        s = s + beta.double()
    return torch.logsumexp(s, -1)


# ------------------------------------------------------------------------------------------- a whole layer
METHODS = ("am", "attention", "tova", "knorm", "sink", "recent")  # AM, and evictions in the same harness
SINK_TOKENS = 4  # StreamingLLM's attention sinks


def choose_and_fit(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, t: int, *, scale: float,
                   method: str = "am", **options) -> Compacted:
    """One KV head's block compacted by ``method``: ``am`` (:func:`compact_head` with ``options``), or an
    eviction that keeps ``t`` tokens as they are (β = 0), with kvpress's scores: ``attention`` (the
    most-attended by the reference queries, as SnapKV does) and ``tova`` (the same, for the queries of the
    last token only: the caller passes those), ``knorm`` (the keys of smallest norm), ``recent`` (the
    newest), ``sink`` (the first :data:`SINK_TOKENS` and the newest, as StreamingLLM does)."""
    T = keys.shape[0]
    if method == "am":
        return compact_head(keys, values, queries, t, scale=scale, **options)
    if method in ("attention", "tova"):
        return compact_head(keys, values, queries, t, scale=scale, fit_beta=False, refit_values=False)
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if not 1 <= t <= T:
        raise ValueError(f"cannot keep {t} of {T} tokens: keep between 1 and {T}")
    if method == "knorm":
        index = torch.topk(-keys.float().norm(dim=-1), t).indices.sort().values.cpu()
        return Compacted(index, torch.zeros(t, dtype=keys.dtype), values[index.to(values.device)])
    sinks = min(SINK_TOKENS, t - 1) if method == "sink" else 0
    index = torch.cat([torch.arange(sinks), torch.arange(T - (t - sinks), T)])
    return Compacted(index, torch.zeros(t, dtype=keys.dtype), values[index])


def compact_layer(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, t: int, *, scale: float,
                  method: str = "am", **options):
    """Every KV head of one layer: ``keys`` ``[B, G, T, d]``, ``values`` ``[B, G, T, d_v]``, reference
    ``queries`` ``[B, H, m, d]`` (the ``H / G`` query heads of a KV head are all its reference queries).
    Returns the kept keys ``[B, G, t, d]``, their β ``[B, G, t]``, the fitted values ``[B, G, t, d_v]`` and
    the kept indices ``[B, G, t]`` (positions are the block's at those indices)."""
    B, G = keys.shape[:2]
    per = queries.shape[1] // G
    out = [[choose_and_fit(keys[b, g], values[b, g], queries[b, g * per:(g + 1) * per].flatten(0, 1), t,
                           scale=scale, method=method, **options) for g in range(G)] for b in range(B)]
    index = torch.stack([torch.stack([c.index for c in row]) for row in out]).to(keys.device)
    kept = torch.gather(keys, 2, index[..., None].expand(-1, -1, -1, keys.shape[-1]))
    beta = torch.stack([torch.stack([c.beta for c in row]) for row in out]).to(keys.device)
    fitted = torch.stack([torch.stack([c.values for c in row]) for row in out]).to(values.device)
    return kept, beta, fitted, index
