"""Rank allocation: which ``(r_k, r_v)`` each layer gets under a global KV budget."""

from __future__ import annotations

import logging
import math

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


def total_units(num_layers: int, budget: float, head_dim: int, rank_step: int) -> int:
    """The budget in rank units: ``⌊budget · L · 2d / rank_step⌋``."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    return int(budget * num_layers * 2 * head_dim / rank_step + 1e-9)


def knapsack(costs: list[list[float]], capacity: int) -> list[int]:
    """Exact multiple-choice knapsack: pick one option per group, option ``j`` costing ``j + 1`` units.

    ``costs[g][j]`` is group ``g``'s error with ``j + 1`` units. Minimises the summed error with at most
    ``capacity`` units by dynamic programming over units, ``O(groups · capacity · options)``. Returns the
    units chosen per group. Raises ``ValueError`` when even one unit per group does not fit.
    """
    n = len(costs)
    if capacity < n:
        raise ValueError(f"the budget ({capacity} rank units) is below the minimum of one unit per group "
                         f"({n})")
    inf = math.inf
    # best[c]: least error of the groups so far using exactly c units; choice[g][c]: units of group g there
    best = [0.0] + [inf] * capacity
    choice = []
    for group in costs:
        new = [inf] * (capacity + 1)
        pick = [0] * (capacity + 1)
        for c in range(capacity + 1):
            for j, err in enumerate(group):
                u = j + 1
                if u <= c and best[c - u] + err < new[c]:
                    new[c], pick[c] = best[c - u] + err, u
        best = new
        choice.append(pick)
    c = min(range(capacity + 1), key=lambda i: (best[i], -i))
    units = []
    for pick in reversed(choice):
        units.append(pick[c])
        c -= pick[c]
    return units[::-1]


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
