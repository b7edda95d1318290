"""A prefill chunk's attention over keys it sees whole, through keys rebuilt once at full width.

Below a prefill chunk (the keys before its queries, or below a windowed store's exact band) every query
sees every key, so no mask is needed. The low-rank prefill kernel rebuilds (and for ``pre_rope`` rotates)
each key tile once per 128-row query tile, and its softmax loop ran at 1.8× (``post_rope``) to 3.9×
(``pre_rope``) SDPA's time in BENCHMARKS.md's prefill table. Here the keys of a slice are rebuilt once,
``k = rot(P_k z)`` in one Triton pass (:func:`rebuild_keys`), the value latents zero-padded to the head
dimension, and the group's query heads folded into the query axis of one non-causal FlashAttention call
that also returns the log-sum-exp, so the parts still merge (:func:`attend_rebuilt`). The output stays in
the latent space (its first ``r_v`` channels), as the kernel's does with ``P_v=None``.

Taken for ``pre_rope`` keys only (``lowrank.PREFILL_REBUILT``): on an H100 at SmolLM2's heads it took a
layer below a 128-query chunk from 1.42 to 0.90 ms over bf16 latents, while ``post_rope``, whose kernel
attends at the rank and rotates nothing, was faster on the kernel (docs/notes/serving.md, 2026-12-07).

The transient is one slice's keys and values at full width (``2·B·G·S·d`` elements), which
``lowrank.PREFILL_CODE_SLICE`` bounds. The reference is :func:`stiefkv.kernels.reference.rebuild_keys`
and :func:`stiefkv.kernels.reference.lowrank_attention` with ``causal=False``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._common import RopeSpec, interpreting, padded_dim

BLOCK_N = 64  # keys a program
HEAD_DIMS = (32, 64, 128, 256)  # taken by FlashAttention; halves a power of two ≥ 16 for the rebuild's dots
# the rebuild holds the key basis in float32 (4·R_P2·d bytes of shared memory): at most 64 KiB, which every
# GPU of compute capability 8.x and 9.0 holds (sm_86/89: 99 KiB); r 512 at d 128 would need 256 KiB
BASIS_TILE_BYTES = 64 * 1024


@triton.jit
def _rebuild_keys_fwd(
    Z, P, POS, INV_FREQ, OUT, N, G, scaling,
    stride_zb, stride_zg, stride_zn, stride_zr,
    stride_pg, stride_pd, stride_pr,
    stride_posb, stride_posg, stride_posn,
    stride_ob, stride_og, stride_on, stride_od,
    R: tl.constexpr, R_P2: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr, PRE_ROPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bg = tl.program_id(1).to(tl.int64)
    b, g = bg // G, bg % G
    offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
    offs_r = tl.arange(0, R_P2)
    offs_h = tl.arange(0, HALF)
    in_n, in_r = offs_n < N, offs_r < R
    z = tl.load(Z + b * stride_zb + g * stride_zg + offs_n[:, None] * stride_zn + offs_r[None, :] * stride_zr,
                mask=in_n[:, None] & in_r[None, :], other=0.0).to(tl.float32)
    # the basis halves transposed, [R_P2, HALF]: key channels j and j + d/2 are the rotation's pair
    p = P + g * stride_pg + offs_r[:, None] * stride_pr + offs_h[None, :] * stride_pd
    p1t = tl.load(p, mask=in_r[:, None], other=0.0)
    p2t = tl.load(p + HALF * stride_pd, mask=in_r[:, None], other=0.0)
    k1 = tl.dot(z, p1t, input_precision=DOT_PREC)
    k2 = tl.dot(z, p2t, input_precision=DOT_PREC)
    if PRE_ROPE:
        pos = tl.load(POS + b * stride_posb + g * stride_posg + offs_n * stride_posn, mask=in_n, other=0)
        angle = pos.to(tl.float32)[:, None] * tl.load(INV_FREQ + offs_h)[None, :]
        cos, sin = tl.cos(angle) * scaling, tl.sin(angle) * scaling
        k1, k2 = k1 * cos - k2 * sin, k2 * cos + k1 * sin
    out = OUT + b * stride_ob + g * stride_og + offs_n[:, None] * stride_on + offs_h[None, :] * stride_od
    tl.store(out, k1.to(OUT.dtype.element_ty), mask=in_n[:, None])
    tl.store(out + HALF * stride_od, k2.to(OUT.dtype.element_ty), mask=in_n[:, None])


def rebuild_keys(z_k: torch.Tensor, P_k: torch.Tensor, *, key_mode: str, positions: torch.Tensor | None,
                 rope: RopeSpec | None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Keys ``[B, G, N, d]`` in ``dtype`` (``z_k``'s by default) from float latents ``z_k`` ``[B, G, N, r]``
    and bases ``P_k`` ``[G, d, r]``, rotated at ``positions`` (``[B, N]`` or ``[B, G, N]``) for
    ``pre_rope``: one Triton pass (CUDA, or the CPU under ``TRITON_INTERPRET=1``), products in tf32 on
    the GPU (float32 under the interpreter), sin and cos as the reference takes them."""
    B, G, N, R = z_k.shape
    d = P_k.shape[1]
    pre = key_mode == "pre_rope"
    if pre and (positions is None or rope is None):
        raise ValueError("key_mode='pre_rope' needs the key positions and the rope spec")
    out = torch.empty(B, G, N, d, dtype=dtype or z_k.dtype, device=z_k.device)
    if out.numel() == 0:
        return out
    P = P_k.float().contiguous()
    if pre:
        pos = positions if positions.dim() == 3 else positions[:, None]  # a G axis of stride 0 for [B, N]
        pos_strides = (pos.stride(0), pos.stride(1) if pos.shape[1] > 1 else 0, pos.stride(2))
        inv_freq, scaling = rope.inv_freq.to(z_k.device, torch.float32).contiguous(), rope.attention_scaling
    else:
        pos, pos_strides, inv_freq, scaling = P, (0, 0, 0), P, 1.0  # unread: PRE_ROPE is off
    _rebuild_keys_fwd[(triton.cdiv(N, BLOCK_N), B * G)](
        z_k, P, pos, inv_freq, out, N, G, float(scaling),
        *z_k.stride(), *P.stride(), *pos_strides, *out.stride(),
        R=R, R_P2=max(16, padded_dim(R)), HALF=d // 2, BLOCK=BLOCK_N, PRE_ROPE=pre,
        DOT_PREC="ieee" if interpreting() else "tf32")
    return out


def flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Non-causal attention of ``q`` ``[B, h, L, d]`` over ``k``, ``v`` ``[B, h, S, d]`` and each row's
    natural log-sum-exp of its scaled logits ``[B, h, L]`` (float32): PyTorch's FlashAttention on CUDA,
    its CPU counterpart elsewhere (the tests')."""
    if q.is_cuda:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    else:
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out[0], out[1][..., : q.shape[2]]


def takes(q: torch.Tensor, z_k, z_v) -> bool:
    """Whether :func:`attend_rebuilt` serves queries ``q`` ``[B, H, Nq, d]`` over latents ``z_k``, ``z_v``
    (float or codes): half-precision queries (what FlashAttention takes) at a head dimension it takes,
    value ranks up to ``d``, a key basis whose tile fits the rebuild's shared memory on every GPU it runs on
    (:data:`BASIS_TILE_BYTES`: shared bases' ranks above ``d`` stay on the kernel, which fits its tiles),
    float latents already in the queries' dtype (float32 ones keep the kernel's float32 products), and a
    GPU FlashAttention runs on (compute capability 8.0 or above), or the CPU under the interpreter."""
    if q.is_cuda:
        device_ok = torch.cuda.get_device_capability(q.device)[0] >= 8
    else:
        device_ok = interpreting()
    d = q.shape[3]
    floats_ok = all(not isinstance(z, torch.Tensor) or z.dtype == q.dtype for z in (z_k, z_v))
    return q.dtype in (torch.bfloat16, torch.float16) and d in HEAD_DIMS and z_v.shape[3] <= d \
        and 4 * max(16, padded_dim(z_k.shape[3])) * d <= BASIS_TILE_BYTES and floats_ok and device_ok


def attend_rebuilt(q: torch.Tensor, z_k: torch.Tensor, z_v: torch.Tensor, P_k: torch.Tensor, *,
                   key_mode: str, positions: torch.Tensor | None, rope: RopeSpec | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query of ``q`` ``[B, H, Nq, d]`` over every key of float latents ``z_k``
    ``[B, G, S, r_k]`` (values ``z_v`` ``[B, G, S, w]``, ``w ≤ d``, zero past the value rank): the latent
    output ``[B, H, Nq, w]`` (float32) and its log-sum-exp ``[B, H, Nq]``. No mask: the caller passes
    only keys every query sees, none of them padding, and no bias."""
    B, H, Nq, d = q.shape
    G, w = z_k.shape[1], z_v.shape[3]
    keys = rebuild_keys(z_k, P_k, key_mode=key_mode, positions=positions, rope=rope, dtype=q.dtype)
    values = z_v.to(q.dtype) if w == d else F.pad(z_v.to(q.dtype), (0, d - w))  # codes come at width d
    o, lse = flash_with_lse(q.reshape(B, G, (H // G) * Nq, d), keys, values, scale)
    return o.reshape(B, H, Nq, d)[..., :w].float(), lse.reshape(B, H, Nq)
