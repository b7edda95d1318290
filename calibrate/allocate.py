"""Rank allocation: which ``(r_k, r_v)`` each layer gets under a global KV budget."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ALLOCATIONS = ("uniform",)


def uniform_rank(budget: float, head_dim: int, rank_step: int) -> int:
    """The same rank for keys and values of every layer: ``budget · d`` rounded down to a multiple of
    ``rank_step`` (never above the budget), at least ``rank_step``."""
    if not 0 < budget <= 1:
        raise ValueError(f"budget must be in (0, 1], got {budget}")
    if rank_step < 1 or head_dim % rank_step:
        raise ValueError(f"rank_step {rank_step} must divide the head dimension {head_dim}")
    r = max(rank_step, min(head_dim, int(budget * head_dim / rank_step + 1e-9) * rank_step))
    if abs(r / head_dim - budget) > 1e-9:
        log.warning("budget %.4g asks for rank %.4g of d=%d; ranks are multiples of %d: using r = %d (%.4g of the "
                    "cache)", budget, budget * head_dim, head_dim, rank_step, r, r / head_dim)
    return r


def uniform(num_layers: int, budget: float, head_dim: int, rank_step: int = 8) -> list[tuple[int, int]]:
    r = uniform_rank(budget, head_dim, rank_step)
    return [(r, r)] * num_layers
