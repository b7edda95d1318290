"""Would the exact tokens of a quantized latent be worth storing in int8? Not built.

At 6.25 % of the bytes most latents store 2-bit codes, and the tokens a cache still holds exact (the 16
newest, and for the channel layout the group of up to 64 still filling) are bf16: at a 2048-token cache
they cost a quarter of a channel-layout int2 latent's codes. This experiment patches (1) the bytes a
quantized storage counts for its exact tokens, one byte a channel plus one log8 scale byte a token and
group instead of two bytes a channel, and (2) what calibration (profiles, refinement) and evaluation read
of those tokens: int8 per token with log8 scales (the fake quantizer's exact tail and each query's exact
band alike). It calibrates with the patches and scores the WikiText-2 test windows, and with ``--control``
does the same unpatched in the same process. The served cache is not patched: these checkpoints are for
this script only.

    python benchmarks/experiments/int8_window.py MODEL --budget 0.0625 [--control] [--windows 3]
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
PLAIN_EXACT_BAND = layers.exact_band
PLAIN_CACHE_BYTES = quant.QuantSpec.cache_bytes
USERS = (quant, attention, layers, profile, rotation)  # modules that imported fake_quant by name
WINDOW = quant.QuantSpec(8, "token", log8=True)  # how the exact tokens are held under the patch


def _int8(x: torch.Tensor) -> torch.Tensor:
    return quant.dequantize(quant.quantize(x.detach(), WINDOW), x.dtype) if x.shape[-2] else x


def window_fake_quant(x, spec, *, straight_through=False):
    """:func:`stiefkv.quant.fake_quant` with the tokens it keeps exact held in int8 instead."""
    out = PLAIN_FAKE_QUANT(x, spec, straight_through=straight_through)
    if not spec.quantized:
        return out
    n = quant.quantized_length(x.shape[-2], spec)
    if n == x.shape[-2]:
        return out
    tail = x[..., n:, :]
    deq = _int8(tail)
    if straight_through:
        deq = tail + (deq - tail).detach()
    return torch.cat([out[..., :n, :], deq], -2)


def window_exact_band(quant_specs, n_queries, read, tails):
    """:func:`stiefkv.layers.exact_band` over exact latents held in int8."""
    tails = tuple((_int8(z) if spec.quantized else z, start) for spec, (z, start) in zip(quant_specs, tails))
    return PLAIN_EXACT_BAND(quant_specs, n_queries, read, tails)


def window_cache_bytes(self, rank, context=quant.REFERENCE_CONTEXT):
    plain = PLAIN_CACHE_BYTES(self, rank, context)
    if not self.quantized:
        return plain
    exact = context - quant.quantized_length(context, self)
    return plain - exact * quant.FLOAT_BYTES * rank + exact * (rank + math.ceil(rank / quant.GROUP))


def patch(on: bool) -> None:
    for module in USERS:
        module.fake_quant = window_fake_quant if on else PLAIN_FAKE_QUANT
    attention.exact_band = layers.exact_band = window_exact_band if on else PLAIN_EXACT_BAND
    quant.QuantSpec.cache_bytes = window_cache_bytes if on else PLAIN_CACHE_BYTES


if __name__ == "__main__":
    import patched_arms  # benchmarks/experiments/: the script's folder is first on sys.path

    patched_arms.run(__doc__, patch, ("exact tokens int8", "exact tokens bf16"))
