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

Everything here works on plain tensors (the PyTorch reference; float64 for the fits), one KV head at a time
or, for the default fit, all heads of a layer at once. The queries of the ``H / G`` query heads that share
a KV head are all reference queries of that head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
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


# The batched fits' logits: float32 keeps each logit to ~1e-7 of its size (bf16 caches hold keys to 4e-3),
# at half float64's bytes and with the fast exponential (float64 logits were a third of compaction's H200
# time at 32k tokens; docs/notes/compaction.md). The chosen keys' exponentials and everything solved from
# them are float64 (:func:`_chosen_logits`). Under TF32 matmuls (``set_float32_matmul_precision``) the
# logits keep only ~1e-3 of their size: the fits degrade with them.
FIT_LOGITS = torch.float32


def _logits(queries: torch.Tensor, keys: torch.Tensor, scale: float,
            dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """``exp(q·k·s − m_q)`` ``[..., m, T]`` and the row maxima ``m_q`` ``[..., m]``, in ``dtype``."""
    s = (queries.to(dtype) * scale) @ keys.to(dtype).transpose(-1, -2)
    top = s.amax(-1, keepdim=True)
    return s.sub_(top).exp_(), top.squeeze(-1)  # in place: these are the largest tensors compaction makes


POOLINGS = ("mean", "rms", "max")


def key_scores(E: torch.Tensor, mass: torch.Tensor, pooling: str = "mean") -> torch.Tensor:
    """Each key's attention probability over the reference queries, pooled by ``pooling`` ``[..., T]``
    (means as products with the queries' inverse masses: one pass over ``E``, no ``E / mass``)."""
    m = E.shape[-2]
    if pooling == "mean":
        return (mass.reciprocal()[..., None, :] @ E)[..., 0, :] / m
    if pooling == "rms":
        return ((mass.reciprocal().square()[..., None, :] @ E.square())[..., 0, :] / m).sqrt()
    if pooling == "max":
        return (E / mass[..., None]).amax(-2)
    raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")


def _select_attention(E: torch.Tensor, mass: torch.Tensor, t: int, pooling: str = "mean") -> torch.Tensor:
    """The ``t`` keys with the highest attention probability over the reference queries, pooled by
    ``pooling``."""
    return torch.topk(key_scores(E, mass, pooling), t).indices.sort(-1).values


def _select_omp(E: torch.Tensor, mass: torch.Tensor, t: int, pooling: str = "mean") -> torch.Tensor:
    """Orthogonal matching pursuit on the relative masses: each step adds the key whose column best explains
    what the chosen ones leave of every query's mass (the residual after projecting onto their span, kept by
    Gram–Schmidt: O(m·t) per step, no solve). The weights are fitted afterwards (:func:`_fit_weights`)."""
    A = E / mass[:, None]  # [m, T]
    norms = A.norm(dim=0).clamp_min(1e-300)
    residual = torch.ones(A.shape[0], dtype=A.dtype, device=A.device)
    basis = torch.empty(A.shape[0], t, dtype=A.dtype, device=A.device)
    taken = torch.zeros(A.shape[1], dtype=torch.bool, device=A.device)
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
    return torch.tensor(sorted(chosen), device=A.device)


SOLVERS = ("nnls", "projected")
PROJECTED_STEPS = 50


def _largest_eigenvalue(gram: torch.Tensor, steps: int = 30) -> torch.Tensor:
    """Power iteration on symmetric positive semi-definite matrices ``[..., n, n]``, from the all-ones
    vector (the Gram matrices here are non-negative, so it starts inside the leading eigenvector's cone); a
    little above the estimate ``[...]``, so that a step of its inverse stays stable."""
    v = torch.ones(gram.shape[:-1], dtype=gram.dtype, device=gram.device)
    for _ in range(steps):
        v = (gram @ v[..., None])[..., 0]
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return 1.05 * (v * (gram @ v[..., None])[..., 0]).sum(-1)


def _solve(M: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``M⁻¹ b`` for symmetric positive definite ``M`` ``[..., n, n]`` (a Gram matrix plus a ridge) and ``b``
    ``[..., n]`` or ``[..., n, k]``, by Cholesky (a general solve for a matrix whose factorisation fails).
    On CUDA the matrices are factorised together and solved by two triangular solves (cusolver's batched
    Cholesky; ``cholesky_solve`` and one factorisation per matrix were slower on the H200, batched LU
    slowest); on the CPU one at a time, since a batched factorisation there nests MKL's threaded LAPACK
    inside torch's parallel loop, which deadlocked the suite."""
    vector = b.dim() == M.dim() - 1
    rhs = b[..., None] if vector else b
    x = _solve_batched(M, rhs) if M.is_cuda else _solve_each(M, rhs)
    return x[..., 0] if vector else x


def _solve_batched(M: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    L, info = torch.linalg.cholesky_ex(M)
    x = torch.linalg.solve_triangular(L, rhs, upper=False)
    x = torch.linalg.solve_triangular(L.transpose(-1, -2), x, upper=True)
    failed = info != 0
    if bool(failed.any()):
        x[failed] = torch.linalg.solve(M[failed], rhs[failed])
    return x


def _solve_each(M: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    flat_M, flat_b = M.reshape(-1, *M.shape[-2:]), rhs.reshape(-1, *rhs.shape[-2:])
    out = []
    for m, v in zip(flat_M, flat_b):
        L, info = torch.linalg.cholesky_ex(m)
        out.append(torch.cholesky_solve(v, L) if int(info) == 0 else torch.linalg.solve(m, v))
    return torch.stack(out).reshape(rhs.shape)


def _ridged(gram: torch.Tensor, ridge: float, pad: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``gram + λ·I`` with ``λ`` ``ridge`` × the mean diagonal over the entries that are not ``pad``
    (``[..., t]``, True for padding, whose zero rows and columns get a unit diagonal: their solution is
    then 0 and the other entries' is that of the unpadded system), and ``λ`` ``[..., 1, 1]``."""
    diagonal = gram.diagonal(dim1=-2, dim2=-1)
    if pad is None:
        lam = ridge * diagonal.mean(-1)
    else:
        lam = ridge * diagonal.sum(-1) / (~pad).sum(-1).clamp_min(1)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    M = gram + lam[..., None, None] * eye
    if pad is not None:
        M = M + torch.diag_embed(pad.to(gram.dtype))
    return M, lam[..., None, None]


def _fit_projected(A: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
    """``w ≥ 0`` ``[..., t]`` with ``A w ≈ 1`` for ``A`` ``[..., m, t]``: clamped least squares, then
    :data:`PROJECTED_STEPS` projected gradient steps, batched over the leading dimensions. ``pad``
    ``[..., t]`` marks padding columns (zero in ``A``; their weight stays 0).

    The least squares lean towards ``w = 1`` (β = 0) by a vanishing ridge: where the masses do not determine
    the weights (fewer queries than entries, as when every token is kept) they start from the solution
    nearest no bias, not from the one nearest 0, which put no weight on most entries."""
    gram = A.transpose(-1, -2) @ A
    rhs = A.sum(-2)
    M, lam = _ridged(gram, 1e-9, pad)
    ones = torch.ones_like(rhs) if pad is None else (~pad).to(rhs.dtype)
    w = _solve(M, rhs + lam[..., 0] * ones).clamp_min(0)
    step = (1 / _largest_eigenvalue(gram))[..., None]
    for _ in range(PROJECTED_STEPS):
        w = (w - step * ((gram @ w[..., None])[..., 0] - rhs)).clamp_min(0)
    return w


def _fit_weights(E_sel: torch.Tensor, mass: torch.Tensor, solver: str = "nnls") -> torch.Tensor:
    """``w ≥ 0`` with ``Σ_j w_j E_qj ≈ mass_q`` relative to each query's mass: scipy's active-set NNLS
    (exact; slow for thousands of keys), or ``projected``: clamped least squares, then projected gradient
    steps (on the tensors' device; the reference code's way)."""
    A = E_sel / mass[:, None]
    if solver == "nnls":
        m, t = A.shape
        b = np.ones(m)
        if t > m:  # the masses do not determine the weights: the ones nearest no bias (w = 1) among them
            mu = math.sqrt(1e-9 * float((A * A).sum()) / t)
            A, b = torch.cat([A, mu * torch.eye(t, dtype=A.dtype, device=A.device)]), np.concatenate(
                [b, np.full(t, mu)])
        w, _ = nnls(A.cpu().numpy(), b)
        return torch.from_numpy(w).to(A.device)
    if solver != "projected":
        raise ValueError(f"solver must be one of {', '.join(SOLVERS)}; got {solver!r}")
    return _fit_projected(A)


def _block_output(E: torch.Tensor, mass: torch.Tensor, V: torch.Tensor) -> torch.Tensor:
    """The block's attention output for each reference query ``[..., m, d_v]`` (float64)."""
    return (E @ V.to(E.dtype)).double() / mass.double()[..., None]


def _refit_values(E_sel: torch.Tensor, w: torch.Tensor, target: torch.Tensor, chosen: torch.Tensor,
                  ridge: float, pad: torch.Tensor | None = None) -> torch.Tensor:
    """``C_v`` ``[..., t, d_v]`` by ridge least squares: the compacted block's attention ``A`` ``[..., m, t]``
    times ``C_v`` ≈ the block's output ``target`` (:func:`_block_output`), pulled towards ``chosen`` (the
    kept keys' own values). ``pad`` as in :func:`_fit_projected` (padding entries come out 0)."""
    A = E_sel * w[..., None, :]
    A = A / A.sum(-1, keepdim=True).clamp_min(1e-300)  # a row of zeros (a query none of them reach) drops out
    M, lam = _ridged(A.transpose(-1, -2) @ A, ridge, pad)
    return _solve(M, A.transpose(-1, -2) @ target + lam * chosen)


def compact_head(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, t: int, *, scale: float,
                 selection: str = "attention", fit_beta: bool = True, refit_values: bool = True,
                 ridge: float = DEFAULT_RIDGE, pooling: str = "mean", solver: str = "nnls") -> Compacted:
    """Compact one KV head's block ``keys`` ``[T, d]``, ``values`` ``[T, d_v]`` to ``t`` entries for the
    reference ``queries`` ``[m, d]`` (logits ``q·k·scale``). ``fit_beta=False`` keeps β = 0;
    ``refit_values=False`` keeps the chosen keys' own values."""
    T = keys.shape[0]
    if selection not in SELECTIONS:
        raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}; got {selection!r}")
    if not 1 <= t <= T:
        raise ValueError(f"cannot keep {t} of {T} tokens: keep between 1 and {T}")
    if selection == "attention" and (solver == "projected" or not fit_beta):
        return Compacted(*compact_heads(keys, values, queries, t, scale=scale, fit_beta=fit_beta,
                                        refit_values=refit_values, ridge=ridge, pooling=pooling))
    E, _ = _logits(queries, keys, scale)
    mass = E.sum(-1)
    index = (_select_attention if selection == "attention" else _select_omp)(E, mass, t, pooling)
    E_sel = E[:, index]
    w = _fit_weights(E_sel, mass, solver) if fit_beta else torch.ones(t, dtype=torch.float64,
                                                                        device=E.device)
    w = w.clamp(min=MIN_WEIGHT)
    chosen = values.double()[index]
    if refit_values:
        chosen = _refit_values(E_sel, w, _block_output(E, mass, values), chosen, ridge)
    return Compacted(index, torch.log(w).to(keys.dtype), chosen.to(values.dtype))


def compact_heads(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, t: int, *, scale: float,
                  fit_beta: bool = True, refit_values: bool = True, ridge: float = DEFAULT_RIDGE,
                  pooling: str = "mean") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`compact_head` with ``selection="attention"`` and ``solver="projected"`` for many heads at once:
    ``keys`` ``[..., T, d]``, ``values`` ``[..., T, d_v]``, ``queries`` ``[..., m, d]``, the same ``t`` for
    all. Returns the indices ``[..., t]``, β ``[..., t]`` and the values ``[..., t, d_v]``."""
    T = keys.shape[-2]
    if not 1 <= t <= T:
        raise ValueError(f"cannot keep {t} of {T} tokens: keep between 1 and {T}")
    E, top = _logits(queries, keys, scale, FIT_LOGITS)
    mass = E.sum(-1)
    index = _select_attention(E, mass, t, pooling)  # [..., t]
    return (index, *_fit_chosen(queries, keys, values, E, top, mass, index, scale=scale, fit_beta=fit_beta,
                                refit_values=refit_values, ridge=ridge))


def _fit_chosen(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, E: torch.Tensor,
                top: torch.Tensor, mass: torch.Tensor, index: torch.Tensor, *, scale: float, fit_beta: bool,
                refit_values: bool, ridge: float):
    """β ``[..., t]`` and values ``[..., t, d_v]`` of the keys at ``index`` ``[..., t]`` of a block whose
    logits less each query's maximum ``top`` are ``E`` ``[..., m, T]`` (:func:`_logits`), ``mass`` their
    sums (the fit is relative to each query's mass, so β does not depend on the shift)."""
    E_sel, chosen, target = _gathered(queries, keys, values, E, top, mass, index, scale, refit_values)
    w, fitted = _fit_gathered(E_sel, mass, chosen, target, fit_beta=fit_beta, ridge=ridge)
    return torch.log(w).to(keys.dtype), fitted.to(values.dtype)


def _chosen_logits(queries: torch.Tensor, keys: torch.Tensor, index: torch.Tensor, top: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``exp(q·k·s − top)`` ``[..., m, t]`` of the keys at ``index`` ``[..., t]``, made as :func:`_logits`
    makes them but exponentiated in float64: float32's ``exp`` is 0 from 104 below a query's best key, and a
    query whose chosen keys all lie that far would leave the value fit a row of zeros to normalise."""
    k = keys.gather(-2, index[..., None].expand(*index.shape, keys.shape[-1]))
    s = (queries.to(FIT_LOGITS) * scale) @ k.to(FIT_LOGITS).transpose(-1, -2)
    return (s - top[..., None]).double().exp_()


def _gathered(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, E: torch.Tensor,
              top: torch.Tensor, mass: torch.Tensor, index: torch.Tensor, scale: float, refit_values: bool):
    """What the fits need of a block, in float64: the chosen keys' logits ``[..., m, t]``, their values
    ``[..., t, d_v]``, and the block's output (None without a refit)."""
    V = values.double()
    chosen = V.gather(-2, index[..., None].expand(*index.shape, V.shape[-1]))
    return (_chosen_logits(queries, keys, index, top, scale), chosen,
            _block_output(E, mass, values) if refit_values else None)


def _fit_gathered(E_sel: torch.Tensor, mass: torch.Tensor, chosen: torch.Tensor, target: torch.Tensor | None,
                  *, fit_beta: bool, ridge: float, pad: torch.Tensor | None = None):
    """The weights ``w`` ``[..., t]`` and values ``[..., t, d_v]`` (float64) from :func:`_gathered`'s parts;
    ``pad`` ``[..., t]`` marks padding entries (zero logits and values)."""
    w = (_fit_projected(E_sel / mass.double()[..., None], pad) if fit_beta
         else torch.ones_like(E_sel[..., 0, :]))
    w = w.clamp(min=MIN_WEIGHT)
    if target is not None:
        chosen = _refit_values(E_sel, w, target, chosen, ridge, pad)
    return w, chosen


def block_counts(scores: torch.Tensor, t: int, block: int) -> list[int]:
    """Entries per block of ``block`` tokens for heads keeping ``t`` of ``T`` keys by ``scores``
    ``[..., T]``: each block's share of every head's top ``t``, averaged over heads, at least 1 per block,
    rounded to sum ``t`` (largest remainders); fewer entries than blocks go to the blocks of largest share
    (the others get 0 and are dropped)."""
    T = scores.shape[-1]
    starts = list(range(0, T, block))
    top = torch.zeros_like(scores, dtype=torch.float64).scatter_(-1, scores.topk(t, -1).indices, 1.0)
    share = torch.stack([top[..., s:s + block].sum(-1) for s in starts], -1).flatten(0, -2).mean(0)
    sizes = [min(block, T - s) for s in starts]
    least = 1 if t >= len(starts) else 0  # fewer entries than blocks: the blocks of smallest share get none
    floor = [max(least, min(size, int(x))) for x, size in zip(share.tolist(), sizes)]
    order = sorted(range(len(starts)), key=lambda i: float(share[i]) - int(share[i]), reverse=True)
    while sum(floor) < t:  # hand the remainder to the largest fractions, never past a block's size
        grew = False
        for i in order:
            if sum(floor) < t and floor[i] < sizes[i]:
                floor[i] += 1
                grew = True
        if not grew:
            break
    while sum(floor) > t:  # the floor of 1 per block overshot: take back from the largest counts
        i = max(range(len(floor)), key=lambda i: floor[i])
        floor[i] -= 1
    return floor


def compact_heads_blocked(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, *, scale: float,
                          scores: torch.Tensor, counts: list[int], block: int, fit_beta: bool = True,
                          refit_values: bool = True, ridge: float = DEFAULT_RIDGE):
    """:func:`compact_heads` on consecutive blocks of ``block`` tokens, each compacted on its own to its
    entry of ``counts`` (the compacted blocks, joined, reproduce the whole: each keeps its mass and its
    output). Keys are chosen by the whole layer's ``scores`` ``[..., T]``; the fits see one block at a
    time, so their cost, quadratic and cubic in the entries kept, falls by the number of blocks.

    The logits are made block by block; the fits of all blocks run together, each block's entries padded
    to the largest count (one batch of solves and projected steps per layer, not one per block: on the
    H200 the blocks' small launches, not their arithmetic, were most of the fits' time)."""
    starts = [(s, n) for s, n in zip(range(0, keys.shape[-2], block), counts) if n > 0]  # 0: dropped
    widest = max(n for _, n in starts)
    # blocks fitted together: their chosen keys' float64 logits within BATCH_BYTES
    together = max(1, BATCH_BYTES // (8 * queries[..., 0].numel() * widest))
    index, beta, fitted = [], [], []
    for first in range(0, len(starts), together):
        group = starts[first:first + together]
        i, b, f = _fit_blocks(keys, values, queries, scale=scale, scores=scores, block=block, group=group,
                              widest=widest, fit_beta=fit_beta, refit_values=refit_values, ridge=ridge)
        index += i
        beta += b
        fitted += f
    return torch.cat(index, -1), torch.cat(beta, -1), torch.cat(fitted, -2)


def _fit_blocks(keys, values, queries, *, scale: float, scores: torch.Tensor, block: int,
                group: list[tuple[int, int]], widest: int, fit_beta: bool, refit_values: bool, ridge: float):
    """The blocks ``group`` (first token, entries kept) fitted as one batch, their entries padded to
    ``widest``: per block, the kept indices ``[..., n]``, β ``[..., n]`` and values ``[..., n, d_v]``."""
    parts = []
    for s, n in group:
        k, v, sc = keys[..., s:s + block, :], values[..., s:s + block, :], scores[..., s:s + block]
        E, top = _logits(queries, k, scale, FIT_LOGITS)
        mass = E.sum(-1)
        index = sc.topk(n, -1).indices.sort(-1).values
        E_sel, chosen, target = _gathered(queries, k, v, E, top, mass, index, scale, refit_values)
        del E
        extra = widest - n
        parts.append((index + s, F.pad(E_sel, (0, extra)), mass, F.pad(chosen, (0, 0, 0, extra)), target,
                      torch.arange(widest, device=keys.device) >= n))
    index, E_sel, mass, chosen, target, pad = zip(*parts)
    target = torch.stack(target) if refit_values else None
    shape = E_sel[0].shape[:-2]
    pad = torch.stack(pad).reshape(len(group), *[1] * len(shape), widest).expand(len(group), *shape, widest)
    w, fitted = _fit_gathered(torch.stack(E_sel), torch.stack(mass), torch.stack(chosen), target,
                              fit_beta=fit_beta, ridge=ridge, pad=pad)
    beta, fitted = torch.log(w).to(keys.dtype), fitted.to(values.dtype)
    return (list(index), [beta[j, ..., :n] for j, (_, n) in enumerate(group)],
            [fitted[j, ..., :n, :] for j, (_, n) in enumerate(group)])


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
METHODS = ("am", "attention")  # AM, and eviction by the same reference queries' attention (as SnapKV does)
ALLOCATIONS = ("uniform", "global", "layers", "layers-max")
# AM's measured defaults (docs/notes/compaction.md; BENCHMARKS.md §5): per-layer counts from the keys of
# highest RMS attention across all layers and heads, weights fitted by projected gradient, layers longer
# than 4096 tokens fitted in blocks of 4096 (C 4096, 3 CPU chunks: blocks of 2048 cost +0.004 PPL, of 1024
# +0.06; the fits' cost falls with the number of blocks). The eviction ``attention`` keeps SnapKV's shape:
# the same count for every head, keys by mean attention.
AM_DEFAULTS = {"allocation": "layers-max", "pooling": "rms", "solver": "projected", "block": 4096}


OPTIONS = ("selection", "fit_beta", "refit_values", "allocation", "pooling", "solver", "ridge", "block")
FIT_ONLY = ("selection", "fit_beta", "refit_values", "solver", "ridge", "block")  # am's: eviction has no fit


def effective_options(method: str, options: dict) -> dict:
    """``options`` over ``method``'s defaults (``allocation`` among them), checked: a name or value a fit
    would not take is refused here, with what it takes."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown compaction option {', '.join(map(repr, unknown))}: the options are "
                         f"{', '.join(OPTIONS)} (and pin)")
    fitting = sorted(set(options) & set(FIT_ONLY))
    if method != "am" and fitting:
        raise ValueError(f"{', '.join(fitting)}: option{'s' if len(fitting) > 1 else ''} of method 'am' (the "
                         f"fit); method {method!r} keeps the tokens it chooses as they are and takes "
                         "allocation and pooling only")
    merged = {**(AM_DEFAULTS if method == "am" else {"allocation": "uniform"}), **options}
    for name, allowed in (("allocation", ALLOCATIONS), ("selection", SELECTIONS), ("pooling", POOLINGS),
                          ("solver", SOLVERS)):
        if name in merged and merged[name] not in allowed:
            raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {merged[name]!r}")
    for name in ("fit_beta", "refit_values"):
        if name in merged and not isinstance(merged[name], bool):
            raise ValueError(f"{name} is True or False; got {merged[name]!r}")
    ridge = merged.get("ridge", DEFAULT_RIDGE)
    if isinstance(ridge, bool) or not isinstance(ridge, (int, float)) or not 0 <= ridge < math.inf:
        raise ValueError(f"ridge must be a finite number ≥ 0 (× the fit's mean diagonal); got {ridge!r}")
    block = merged.get("block")
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be a whole number of tokens ≥ 1, or None for whole layers; got "
                         f"{block!r}")
    return merged


def choose_and_fit(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, t: int, *, scale: float,
                   method: str = "am", **options) -> Compacted:
    """One KV head's block compacted by ``method``: ``am`` (:func:`compact_head` with ``options``), or
    ``attention``, which keeps the ``t`` tokens of highest attention (pooled by ``options``' ``pooling``)
    as they are (β = 0). kvpress's presses are in :mod:`stiefkv.presses`."""
    if method == "am":
        return compact_head(keys, values, queries, t, scale=scale, **options)
    if method == "attention":
        return compact_head(keys, values, queries, t, scale=scale, fit_beta=False, refit_values=False,
                            pooling=options.get("pooling", "mean"))
    raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")


def _head_in_blocks(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, t: int, *, scale: float,
                    scores: torch.Tensor, block: int, **options) -> Compacted:
    """One KV head compacted by AM in blocks of ``block`` tokens, each to its share of ``t`` by the head's
    ``scores`` ``[T]`` (:func:`block_counts`): :func:`compact_heads_blocked` for the fits that have no
    batched form (OMP selection, the NNLS solver, counts that differ between heads), whose logits would
    otherwise span the whole layer."""
    parts = []
    for s, n in zip(range(0, keys.shape[0], block), block_counts(scores[None], t, block)):
        if n:
            c = compact_head(keys[s:s + block], values[s:s + block], queries, n, scale=scale, **options)
            parts.append(Compacted(c.index + s, c.beta, c.values))
    return Compacted(*(torch.cat(x) for x in zip(*((c.index, c.beta, c.values) for c in parts))))


PAD_BETA = -1e4  # β of padding entries (heads of one layer kept to different counts): never attended


def _padded(c: Compacted, n: int) -> Compacted:
    """``c`` padded to ``n`` entries that attention never reads (β = :data:`PAD_BETA`, zero values)."""
    extra = n - c.index.numel()
    if extra == 0:
        return c
    return Compacted(torch.cat([c.index, c.index[-1:].expand(extra)]),
                     torch.cat([c.beta, c.beta.new_full((extra,), PAD_BETA)]),
                     torch.cat([c.values, c.values.new_zeros(extra, c.values.shape[-1])]))


def compact_layer(keys: torch.Tensor, values: torch.Tensor, queries: torch.Tensor, t, *, scale: float,
                  method: str = "am", **options):
    """Every KV head of one layer: ``keys`` ``[B, G, T, d]``, ``values`` ``[B, G, T, d_v]``, reference
    ``queries`` ``[B, H, m, d]`` (the ``H / G`` query heads of a KV head are all its reference queries).
    ``t`` is the entries kept per head, one count or a ``[B, G]`` tensor of them (heads kept to fewer
    entries are padded with entries attention never reads). Returns the kept keys ``[B, G, t, d]``, their
    β ``[B, G, t]``, the fitted values ``[B, G, t, d_v]`` and the kept indices ``[B, G, t]`` (positions are
    the block's at those indices).

    ``block`` (AM, a count common to the heads): a layer of more tokens is compacted in blocks of that many
    (:func:`compact_heads_blocked`; one head at a time by :func:`_head_in_blocks` for the fits that have no
    batched form), each block's count from its share of the row's top keys. ``scores``: the layer's
    :func:`layer_scores`, when already computed."""
    B, G = keys.shape[:2]
    per = queries.shape[1] // G
    budget = torch.as_tensor(t).expand(B, G)
    if bool((budget >= keys.shape[2]).all()):  # every token kept: the block itself, exactly
        index = torch.arange(keys.shape[2], device=keys.device).expand(B, G, -1)
        return keys, keys.new_zeros(B, G, keys.shape[2]), values, index
    options = dict(options)
    scores, block = options.pop("scores", None), options.pop("block", None)
    if _batchable(budget, method, options):
        if method == "attention":  # keeps the chosen tokens as they are
            options = {"pooling": options.get("pooling", "mean"), "fit_beta": False, "refit_values": False}
        return _compact_layer_batched(keys, values, queries, int(budget[0, 0]), scale=scale,
                                      block=block if method == "am" else None, scores=scores, **options)
    if B > 1 and bool((budget == budget[:, :1]).all()) and _batchable(budget[:1], method, options):
        # rows of different counts (each row's own allocation), each uniform over its heads: row by row on
        # the batched path, padded to the largest
        return _rows_padded([compact_layer(keys[b:b + 1], values[b:b + 1], queries[b:b + 1], budget[b:b + 1],
                                           scale=scale, method=method, block=block,
                                           scores=None if scores is None else scores[b:b + 1], **options)
                             for b in range(B)])
    if method == "am" and block is not None and keys.shape[2] > block:  # each head in blocks, one by one
        if scores is None:
            scores = layer_scores(keys, queries, scale, options.get("pooling", "mean"))
        out = [[_head_in_blocks(keys[b, g], values[b, g], queries[b, g * per:(g + 1) * per].flatten(0, 1),
                                int(budget[b, g]), scale=scale, scores=scores[b, g], block=block, **options)
                for g in range(G)] for b in range(B)]
    else:
        out = [[choose_and_fit(keys[b, g], values[b, g], queries[b, g * per:(g + 1) * per].flatten(0, 1),
                               int(budget[b, g]), scale=scale, method=method, **options)
                for g in range(G)] for b in range(B)]
    n = int(budget.max())
    out = [[_padded(c, n) for c in row] for row in out]
    index = torch.stack([torch.stack([c.index for c in row]) for row in out]).to(keys.device)
    kept = torch.gather(keys, 2, index[..., None].expand(-1, -1, -1, keys.shape[-1]))
    beta = torch.stack([torch.stack([c.beta for c in row]) for row in out]).to(keys.device)
    fitted = torch.stack([torch.stack([c.values for c in row]) for row in out]).to(values.device)
    return kept, beta, fitted, index


def _rows_padded(rows: list[tuple]) -> tuple:
    """:func:`compact_layer`'s results for single rows joined into one batch, each padded to the largest
    count with entries attention never reads (the last kept key again, β = :data:`PAD_BETA`, zero values)."""
    n = max(index.shape[-1] for *_, index in rows)
    out = []
    for kept, beta, fitted, index in rows:
        extra = n - index.shape[-1]
        if extra:
            kept = torch.cat([kept, kept[..., -1:, :].expand(*kept.shape[:2], extra, -1)], 2)
            beta = torch.cat([beta, beta.new_full((*beta.shape[:2], extra), PAD_BETA)], 2)
            fitted = torch.cat([fitted, fitted.new_zeros(*fitted.shape[:2], extra, fitted.shape[-1])], 2)
            index = torch.cat([index, index[..., -1:].expand(*index.shape[:2], extra)], 2)
        out.append((kept, beta, fitted, index))
    return tuple(torch.cat(parts) for parts in zip(*out))


HEADS = {"global": "each", "layers": "mean", "layers-max": "max"}  # global_budgets' heads= per allocation


def compact_layers(keys: list[torch.Tensor], values: list[torch.Tensor], queries: list[torch.Tensor],
                   t: int, *, scales: list[float], method: str = "am", **options):
    """Every layer of a model's cache compacted to ``t`` entries per KV head on average: yields
    :func:`compact_layer`'s results layer by layer, with the counts of ``options``' ``allocation`` (over
    ``method``'s defaults). Each layer's key scores are computed once, for the allocation and the fit, and
    each entry of ``keys`` is let go (set to None) once its layer is done."""
    options = effective_options(method, options)
    allocation = options.pop("allocation")
    L = len(keys)
    budgets, scores = [t] * L, [None] * L
    if allocation != "uniform":
        pooling = options.get("pooling", "mean")
        scores = [layer_scores(k, q, s, pooling) for k, q, s in zip(keys, queries, scales)]
        budgets = global_budgets(keys, queries, t, scales=scales, pooling=pooling, heads=HEADS[allocation],
                                 scores=scores)
    for i in range(L):
        yield compact_layer(keys[i], values[i], queries[i], budgets[i], scale=scales[i], method=method,
                            scores=scores[i], **options)
        keys[i] = scores[i] = None


BATCH_BYTES = 2 << 30  # logits held at once when heads (or blocks' chosen keys) are compacted together


def _batchable(budget: torch.Tensor, method: str, options: dict) -> bool:
    """Every head keeps the same count and the fit has a batched form (attention selection, projected
    weights or none)."""
    if not bool((budget == budget.flatten()[0]).all()) or method not in METHODS:
        return False
    if method == "attention":
        return True
    return (options.get("selection", "attention") == "attention"
            and (options.get("solver", "nnls") == "projected" or options.get("fit_beta") is False))


def _heads_per_slice(m: int, T: int, B: int) -> int:
    """KV heads whose logits ``[B, m, T]``, counted as float64, fit :data:`BATCH_BYTES` together (at least
    one)."""
    return max(1, BATCH_BYTES // (m * T * 8 * B))


def _group_queries(queries: torch.Tensor, G: int) -> torch.Tensor:
    """``[B, H, m, d]`` → ``[B, G, (H/G)·m, d]``: each KV head's query heads' queries together."""
    B, H, m, d = queries.shape
    return queries.reshape(B, G, H // G, m, d).flatten(2, 3)


def _compact_layer_batched(keys, values, queries, t: int, *, scale: float, selection: str = "attention",
                           solver: str = "projected", fit_beta: bool = True, refit_values: bool = True,
                           ridge: float = DEFAULT_RIDGE, pooling: str = "mean", block: int | None = None,
                           scores: torch.Tensor | None = None):
    """:func:`compact_layer` for a common count, every head at once (in slices of heads whose float64
    logits fit :data:`BATCH_BYTES`); a layer longer than ``block`` tokens in blocks
    (:func:`compact_heads_blocked`), chosen by ``scores`` ``[B, G, T]`` (computed here when not given)."""
    B, G, T, _ = keys.shape
    if not 1 <= t <= T:
        raise ValueError(f"cannot keep {t} of {T} tokens: keep between 1 and {T}")
    q = _group_queries(queries, G)
    blocked = block is not None and T > block
    step = _heads_per_slice(q.shape[2], min(T, block or T), B)
    if blocked and B > 1:  # each row's blocks get the shares of its own keys, not the batch's
        rows = [_compact_layer_batched(keys[b:b + 1], values[b:b + 1], queries[b:b + 1], t, scale=scale,
                                       selection=selection, solver=solver, fit_beta=fit_beta,
                                       refit_values=refit_values, ridge=ridge, pooling=pooling, block=block,
                                       scores=None if scores is None else scores[b:b + 1]) for b in range(B)]
        return tuple(torch.cat(parts) for parts in zip(*rows))
    if blocked:
        if scores is None:
            scores = layer_scores(keys, queries, scale, pooling)
        counts = block_counts(scores, t, block)
        parts = [compact_heads_blocked(keys[:, g:g + step], values[:, g:g + step], q[:, g:g + step],
                                       scale=scale, scores=scores[:, g:g + step], counts=counts, block=block,
                                       fit_beta=fit_beta, refit_values=refit_values, ridge=ridge)
                 for g in range(0, G, step)]
    else:
        parts = [compact_heads(keys[:, g:g + step], values[:, g:g + step], q[:, g:g + step], t, scale=scale,
                               fit_beta=fit_beta, refit_values=refit_values, ridge=ridge, pooling=pooling)
                 for g in range(0, G, step)]
    index, beta, fitted = (torch.cat(x, 1) for x in zip(*parts))
    kept = torch.gather(keys, 2, index[..., None].expand(-1, -1, -1, keys.shape[-1]))
    return kept, beta, fitted, index


def layer_scores(keys: torch.Tensor, queries: torch.Tensor, scale: float, pooling: str) -> torch.Tensor:
    """Every key's attention from the reference queries, pooled by ``pooling`` ``[B, G, T]``, for one layer's
    ``keys`` ``[B, G, T, d]`` and ``queries`` ``[B, H, m, d]`` (in slices of heads, as the fits)."""
    B, G, T = keys.shape[:3]
    q = _group_queries(queries, G)
    step = _heads_per_slice(q.shape[2], T, B)
    out = []
    for g in range(0, G, step):
        E, _ = _logits(q[:, g:g + step], keys[:, g:g + step], scale, FIT_LOGITS)
        out.append(key_scores(E, E.sum(-1), pooling))
    return torch.cat(out, 1)


def global_budgets(keys: list[torch.Tensor], queries: list[torch.Tensor], t: int, *, scales: list[float],
                   pooling: str = "mean", floor: int = 1, heads: str = "each",
                   scores: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Per layer ``[B, G]`` counts from the keys of highest attention (``pooling``) across every layer and
    head of a batch row, at least ``floor`` each, ``t`` per head on average (more under ``"each"`` and
    ``"mean"`` where the floor lifts heads the cut left below it: at ``t`` near ``floor``):

    - ``heads="each"``: each head its own count (a dense cache pads a layer's heads to the largest);
    - ``"mean"``: each layer's heads its mean count;
    - ``"max"``: each layer's heads its largest count, the cut lowered until that stores ``t`` per head on
      average (what a dense cache holds under ``"each"``, with the padding filled by keys).

    ``scores``: the layers' :func:`layer_scores`, when already computed."""
    per_layer = scores if scores is not None else [layer_scores(k, q, scale, pooling)
                                                   for k, q, scale in zip(keys, queries, scales)]
    allk = torch.stack(per_layer, 1)  # [B, L, G, T]
    B, L, G, T = allk.shape
    total = t * L * G
    ranked = allk.flatten(1).sort(-1, descending=True).values  # [B, L·G·T]

    def counts_at(n) -> torch.Tensor:  # [B, L, G]: each head's keys among the n best of its row ([B] or one)
        n = torch.as_tensor(n, device=ranked.device).expand(B)
        cut = ranked.gather(1, (n - 1)[:, None])
        return (allk >= cut[:, :, None, None]).sum(-1)

    if heads == "max":
        # per row, the largest n whose per-layer maxima store ≤ total (each row its own: one row's keys
        # never move another's cut)
        lo = torch.ones(B, dtype=torch.long, device=ranked.device)
        hi = torch.full_like(lo, ranked.shape[1])
        while bool((lo < hi).any()):
            mid = (lo + hi + 1) // 2
            fits = counts_at(mid).amax(-1).clamp(floor, T).sum(-1) * G <= total  # with the floor's lift
            open_ = lo < hi
            lo, hi = torch.where(open_ & fits, mid, lo), torch.where(open_ & ~fits, mid - 1, hi)
        counts = counts_at(lo).amax(-1, keepdim=True).expand(B, L, G)
    else:
        counts = counts_at(total)
        if heads == "mean":
            counts = (counts.sum(-1, keepdim=True).double() / G).round().long().expand(B, L, G)
    counts = counts.clamp(floor, T)
    return [counts[:, i] for i in range(L)]
