"""Fused attention kernels over tensors, each beside its PyTorch reference (``reference.py``).

This package imports nothing from the rest of StiefKV. Triton is imported lazily by the kernel modules,
so the references work on machines without it.
"""

from .reference import RopeSpec, attention_kl as attention_kl_reference, lowrank_attention as lowrank_attention_reference

__all__ = ["RopeSpec", "attention_kl_reference", "lowrank_attention_reference"]
