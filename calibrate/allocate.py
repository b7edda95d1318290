"""Rank allocation: which ``(r_k, r_v)`` each layer gets under a global KV budget."""

from __future__ import annotations

import logging
import math

import numpy as np

from stiefkv.quant import FLOAT_BYTES, POSITION_BYTES, REFERENCE_CONTEXT, QuantSpec

log = logging.getLogger(__name__)

ALLOCATIONS = ("dp", "uniform")


def uniform_rank(budget: float, head_dim: int, rank_step: int) -> int:
    """The same rank for keys and values of every layer: ``budget · d`` rounded down to a multiple of
    ``rank_step`` (never above the budget), at least ``rank_step``."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    if rank_step < 1 or head_dim % rank_step:
        raise ValueError(f"rank_step {rank_step} must divide the head dimension {head_dim}")
    r = max(rank_step, min(head_dim, int(budget * head_dim / rank_step + 1e-9) * rank_step))
    if abs(r / head_dim - budget) > 1e-9:
        log.warning("budget %.4g asks for rank %.4g of d=%d; ranks are multiples of %d: using r = %d "
                    "(%.4g of the cache)", budget, budget * head_dim, head_dim, rank_step, r, r / head_dim)
    return r


def uniform(num_layers: int, budget: float, head_dim: int, rank_step: int = 8) -> list[tuple[int, int]]:
    r = uniform_rank(budget, head_dim, rank_step)
    return [(r, r)] * num_layers


def uniform_storage(L: int, G: int, d: int, rank_step: int, budget: float, spec_k: QuantSpec,
                    spec_v: QuantSpec, shared: bool = False) -> list[tuple[int, int]]:
    """The same rank for keys and values of every layer, stored as ``spec_k`` and ``spec_v``: the largest
    multiple of ``rank_step`` (``G ×`` it for one latent ``shared`` by the heads) whose bytes, everything
    counted as :func:`storage_dp` counts them, fit ``budget`` × the uncompressed bf16 cache's."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    heads, copies = (G, 1) if shared else (1, G)
    room = budget * cache_bytes(L, G, d) - POSITION_BYTES
    def used(r: int) -> float:
        return L * copies * (spec_k.bytes_per_token(heads * r) + spec_v.bytes_per_token(heads * r))

    fits = [r for r in range(rank_step, d + 1, rank_step) if used(r) <= room + 1e-9]
    if not fits:
        floor = smallest_budget(L, G, d, rank_step, {"k": [spec_k], "v": [spec_v]}, shared)
        raise ValueError(f"budget {budget:g} is below the smallest cache of {spec_k} keys and {spec_v} "
                         f"values: {floor:.4g} (rank {heads * rank_step} in every layer); raise the budget")
    return [(heads * fits[-1], heads * fits[-1])] * L


def total_units(num_layers: int, budget: float, head_dim: int, rank_step: int) -> int:
    """The budget in rank units: ``⌊budget · L · 2d / rank_step⌋``."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    return int(budget * num_layers * 2 * head_dim / rank_step + 1e-9)


def knapsack(costs: list[list[float]], capacity: int) -> list[int]:
    """Exact multiple-choice knapsack: pick one option per group, option ``j`` costing ``j + 1`` units.

    ``costs[g][j]`` is group ``g``'s error with ``j + 1`` units. Minimises the summed error with at most
    ``capacity`` units by dynamic programming over units, ``O(groups · capacity · options)``. Returns the
    units chosen per group. Raises ``ValueError`` when even one unit per group does not fit. The rank-unit
    case of :func:`knapsack_options`.
    """
    n = len(costs)
    if capacity < n:
        raise ValueError(f"the budget ({capacity} rank units) is below the minimum of one unit per group "
                         f"({n})")
    chosen = knapsack_options([[(j + 1, err) for j, err in enumerate(group)] for group in costs], capacity)
    return [j + 1 for j in chosen]


def dp(profiles, budget: float, head_dim: int, rank_step: int = 8,
       weighting: str = "output") -> list[tuple[int, int]]:
    """Per-layer ``(r_k, r_v)`` minimising the summed predicted error (keys' plus values') under the
    budget."""
    groups = []
    for prof in profiles:
        if prof.ranks != list(range(rank_step, head_dim + 1, rank_step)):
            raise ValueError(f"profile ranks {prof.ranks} are not the multiples of {rank_step} up to "
                             f"{head_dim}")
        groups += [prof.relative("k", weighting), prof.relative("v", weighting)]
    units = knapsack(groups, total_units(len(profiles), budget, head_dim, rank_step))
    return [(units[2 * i] * rank_step, units[2 * i + 1] * rank_step) for i in range(len(profiles))]


# Bytes are counted exactly as those of the whole reference cache (REFERENCE_CONTEXT tokens): a per-channel
# group's scale and low (4 bytes over 64 tokens) and the exact recent tokens are fractions of a byte per token
# but whole bytes per cache. The knapsack divides every cost by their gcd, so its capacity stays small.
UNITS_PER_BYTE = REFERENCE_CONTEXT
# Most units the knapsack runs over (its time and memory grow with them): exact bytes can need millions (an
# odd `recent`, a large model); beyond this, costs are rounded up to coarser units.
MAX_UNITS = 1 << 20


def cache_bytes(L: int, G: int, d: int) -> int:
    """Bytes per token of the uncompressed bf16 KV cache: ``L · G · 2d · 2``."""
    return L * G * 2 * d * FLOAT_BYTES


def per_latent(specs) -> dict[str, list[QuantSpec]]:
    """``specs`` as candidates per latent: a list is shared by keys (``k``) and values (``v``)."""
    return specs if isinstance(specs, dict) else {"k": specs, "v": specs}


def smallest_budget(L: int, G: int, d: int, rank_step: int, specs, shared: bool = False) -> float:
    """The smallest budget a cache of these storages (a list, or one per latent) can meet: every latent at
    rank ``rank_step`` (``G · rank_step`` for one latent ``shared`` by the heads) in its cheapest storage,
    plus the positions."""
    rank, copies = (G * rank_step, 1) if shared else (rank_step, G)
    least = sum(min(spec.bytes_per_token(rank) for spec in s) for s in per_latent(specs).values())
    return (L * copies * least + POSITION_BYTES) / cache_bytes(L, G, d)


def frontier(options: list[tuple[int, float]]) -> list[int]:
    """Indices (ascending) of the options no other beats: each has less error than every option costing
    less, or the same as the best of those at a higher cost (the knapsack's ties go to more cost used); of
    options equal in cost and error, the first. Any choice through a dropped option does better through
    the one that beats it, for no more cost, so the knapsack's answer is the same over the frontier."""
    kept, least, at = [], float("inf"), -1
    for j in sorted(range(len(options)), key=lambda j: (options[j][0], options[j][1], j)):
        cost, err = options[j]
        if err < least or (err == least and cost > at):
            kept.append(j)
            least, at = err, cost
    return sorted(kept)


def knapsack_options(groups: list[list[tuple[int, float]]], capacity: int) -> list[int]:
    """Exact multiple-choice knapsack with arbitrary integer costs: one option per group, options
    ``(cost, error)``, summed cost ≤ ``capacity``, least summed error (ties: more cost used). Dynamic
    programming over cost, vectorised over the capacity axis, over each group's :func:`frontier` only (a
    calibration's profiles leave about a fifth of their options there). Returns the chosen option's index
    per group.
    """
    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0
    picks = []
    for options in groups:
        new = np.full(capacity + 1, np.inf)
        pick = np.full(capacity + 1, -1, dtype=np.int32)
        better = np.empty(capacity + 1, dtype=bool)
        cand = np.empty(capacity + 1)
        front = frontier(options)
        for j in front:
            cost, err = options[j]
            if cost > capacity:
                continue
            n = capacity + 1 - cost
            np.add(best[:n], err, out=cand[:n])
            np.less(cand[:n], new[cost:], out=better[:n])
            np.copyto(new[cost:], cand[:n], where=better[:n])
            np.copyto(pick[cost:], j, where=better[:n])
        best = new
        picks.append(pick)
    if not np.isfinite(best).any():
        raise ValueError(f"no choice of one option per group fits {capacity} units")
    c = int(np.flatnonzero(best == best.min()).max())
    chosen = []
    for options, pick in zip(reversed(groups), reversed(picks)):
        j = int(pick[c])
        chosen.append(j)
        c -= options[j][0]
    return chosen[::-1]


def storage_dp(profiles, budget: float, G: int, d: int, rank_step: int, specs, weighting: str = "kl",
               shared: bool = False) -> tuple[list[tuple[int, int]], list[tuple[QuantSpec, QuantSpec]]]:
    """Per layer, separately for keys and values, the ``(rank, storage)`` minimising the summed profiled
    error under ``budget`` × the uncompressed bf16 cache's bytes per token, everything counted (codes,
    scales, lows, the positions). ``specs`` are the storages allowed (bf16 among them or not), one list for
    both latents or one per latent (``{"k": ..., "v": ...}``); full rank is a candidate, so a
    quantization-only cache is one of the answers. ``shared``: each layer's latents are one a token for its
    ``G`` heads (bases ``[1, G·d, r]``), profiled at ranks ``G · rank_step`` … ``G·d``."""
    L = len(profiles)
    specs = per_latent(specs)
    step, top, copies = (G * rank_step, G * d, 1) if shared else (rank_step, d, G)
    floor = smallest_budget(L, G, d, rank_step, specs, shared)
    if budget < floor:
        raise ValueError(f"budget {budget:g} is below the smallest cache these bit widths can make, "
                         f"{floor:.4g} (rank {rank_step} at the fewest bits in every layer)")
    groups, labels = [], []
    for prof in profiles:
        if prof.ranks != list(range(step, top + 1, step)):
            raise ValueError(f"profile ranks {prof.ranks} are not the multiples of {step} up to {top}")
        for which in ("k", "v"):
            opts = prof.options(which, weighting, specs[which])
            labels.append([(r, spec) for r, spec, _ in opts])
            groups.append([(copies * spec.cache_bytes(r, UNITS_PER_BYTE), err)
                           for r, spec, err in opts])
    unit = math.gcd(*(c for g in groups for c, _ in g))
    groups = [[(c // unit, e) for c, e in g] for g in groups]
    capacity = int((budget * cache_bytes(L, G, d) - POSITION_BYTES) * UNITS_PER_BYTE / unit + 1e-9)
    if capacity > MAX_UNITS:  # coarser units, costs rounded up: the choice still fits the budget
        scale = -(-capacity // MAX_UNITS)
        groups = [[(-(-c // scale), e) for c, e in g] for g in groups]
        capacity //= scale
    chosen = knapsack_options(groups, capacity)
    picked = [labels[g][j] for g, j in enumerate(chosen)]
    ranks = [(picked[2 * i][0], picked[2 * i + 1][0]) for i in range(L)]
    quant = [(picked[2 * i][1], picked[2 * i + 1][1]) for i in range(L)]
    return ranks, quant
