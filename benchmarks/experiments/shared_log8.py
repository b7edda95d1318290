"""Would one log8 scale byte per token shared by a layer's KV heads beat one per head? Not built.

At 6.25 % of the bytes the allocation stores 2 bits at ranks 8-32 per head, where a per-token group's log8
scale byte is a fifth to a third of the head's bytes. This experiment patches (1) the bytes a log8 storage
counts, one scale byte per token for all ``G`` heads instead of one per head, and (2) the fake quantizer that
calibration (profiles, refinement) and evaluation apply, so that every head of a token takes the scale of
the largest magnitude over all heads (ranks ≤ 64: one group per head). It calibrates with the patches and
scores the WikiText-2 test windows, and with ``--control`` does the same unpatched in the same process.
The served cache (``LatentCache``, the kernels) is not patched: these checkpoints are for this script only.

    python benchmarks/experiments/shared_log8.py MODEL --budget 0.0625 [--control] [--windows 3]
"""

from __future__ import annotations

import math

import torch

import stiefkv.attention as attention
import stiefkv.calibrate.profile as profile
import stiefkv.calibrate.rotation as rotation
import stiefkv.layers as layers
from stiefkv import quant

PLAIN_FAKE_QUANT = quant.fake_quant
PLAIN_CACHE_BYTES = quant.QuantSpec.cache_bytes
USERS = (quant, attention, layers, profile, rotation)  # modules that imported fake_quant by name


def shared_fake_quant(x, spec, *, straight_through=False, held=None):
    """:func:`stiefkv.quant.fake_quant` with a log8 spec's scale shared by the heads (axis −3)."""
    if not (spec.quantized and spec.log8):
        return PLAIN_FAKE_QUANT(x, spec, straight_through=straight_through, held=held)
    # exact tokens in int8 for -w8
    x = quant.held_exact(x, spec, straight_through=straight_through) if held is None else held
    n = quant.quantized_length(x.shape[-2], spec)
    if n == 0:
        return x
    head = x[..., :n, :].detach().float()
    levels = (1 << spec.bits) - 1
    biggest = head.abs().amax(-1, keepdim=True).amax(-3, keepdim=True)  # [..., 1, n, 1]
    step = quant.log8_scale(quant.log8_code(biggest * (2 / levels), spec.bits))
    low = quant.log8_low(step, spec.bits)
    deq = (torch.round((head - low) / step).clamp_(0, levels) * step + low).to(x.dtype)
    if straight_through:
        deq = x[..., :n, :] + (deq - x[..., :n, :]).detach()
    return deq if n == x.shape[-2] else torch.cat([deq, x[..., n:, :]], -2)


def shared_cache_bytes(heads: int):
    def cache_bytes(self, rank, context=quant.REFERENCE_CONTEXT):
        if not (self.quantized and self.log8):
            return PLAIN_CACHE_BYTES(self, rank, context)
        held = quant.quantized_length(context, self)
        exact = (context - held) * quant.exact_token_bytes(rank, self.window8)
        groups = math.ceil(rank / quant.GROUP)
        return held * quant.packed_bytes(rank, self.bits) + math.ceil(held * groups / heads) + exact
    return cache_bytes


def patch(shared: bool, heads: int) -> None:
    for module in USERS:
        module.fake_quant = shared_fake_quant if shared else PLAIN_FAKE_QUANT
    quant.QuantSpec.cache_bytes = shared_cache_bytes(heads) if shared else PLAIN_CACHE_BYTES


HEADS = {}


def patch_heads(on: bool) -> None:
    patch(on, HEADS["G"])


if __name__ == "__main__":
    import patched_arms  # benchmarks/experiments/: the script's folder is first on sys.path

    patched_arms.run(__doc__, patch_heads, ("shared log8 scales", "per-head log8 scales"),
                     setup=lambda model: HEADS.update(G=model.config.num_key_value_heads))
