"""Rotary embedding of a decoder layer's queries and, for ``post_rope`` latents, its keys rotated and
projected onto their basis: one launch per layer instead of the ~13 small kernels of the PyTorch path
(``rotate_with`` is a multiply, a negation, a concatenation, a multiply and an add per tensor; ``to_latent``
a cast, a matmul and a cast back). At a decode step every one of them is a few microseconds of a captured
graph over a few kilobytes, 32 layers over (docs/notes/serving.md, ninth session).

One program takes one token of one batch row and one KV head: the ``GROUP`` query heads that share it and,
with keys, the key, ``z = P_kᵀ rot(k)`` in float32 (the PyTorch path rounds ``rot(k)`` to the model's dtype
first). The reference is :func:`rope_latent_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x1, x2, c1, s1, c2, s2):
    """transformers' ``x·cos + rotate_half(x)·sin`` on the halves ``x1``, ``x2`` (float32)."""
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2


@triton.jit
def _rope_latent_fwd(
    Q, K, COS, SIN, P, QO, Z,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kg, stride_kd,
    stride_cb, stride_cn, stride_cd,
    stride_sb, stride_sn, stride_sd,
    stride_pg, stride_pd, stride_pr,
    stride_ob, stride_on, stride_oh, stride_od,
    stride_zb, stride_zg, stride_zn, stride_zr,
    n_tokens,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr, R: tl.constexpr,
    R_P2: tl.constexpr, HAS_K: tl.constexpr,
):
    HALF: tl.constexpr = HEAD_DIM // 2
    pid = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    b = pid // n_tokens
    n = pid % n_tokens
    offs_h = tl.arange(0, HALF)
    c_row = COS + b * stride_cb + n * stride_cn
    s_row = SIN + b * stride_sb + n * stride_sn
    c1 = tl.load(c_row + offs_h * stride_cd).to(tl.float32)
    c2 = tl.load(c_row + (offs_h + HALF) * stride_cd).to(tl.float32)
    s1 = tl.load(s_row + offs_h * stride_sd).to(tl.float32)
    s2 = tl.load(s_row + (offs_h + HALF) * stride_sd).to(tl.float32)

    heads = g * GROUP + tl.arange(0, GROUP_P2)
    ok = (tl.arange(0, GROUP_P2) < GROUP)[:, None]
    q_ptr = Q + b * stride_qb + n * stride_qn + heads[:, None] * stride_qh + offs_h[None, :] * stride_qd
    q1 = tl.load(q_ptr, mask=ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + HALF * stride_qd, mask=ok, other=0.0).to(tl.float32)
    o1, o2 = _rotate(q1, q2, c1[None, :], s1[None, :], c2[None, :], s2[None, :])
    o_ptr = QO + b * stride_ob + n * stride_on + heads[:, None] * stride_oh + offs_h[None, :] * stride_od
    tl.store(o_ptr, o1.to(QO.dtype.element_ty), mask=ok)
    tl.store(o_ptr + HALF * stride_od, o2.to(QO.dtype.element_ty), mask=ok)

    if HAS_K:
        k_ptr = K + b * stride_kb + n * stride_kn + g * stride_kg + offs_h * stride_kd
        k1 = tl.load(k_ptr).to(tl.float32)
        k2 = tl.load(k_ptr + HALF * stride_kd).to(tl.float32)
        r1, r2 = _rotate(k1, k2, c1, s1, c2, s2)
        offs_r = tl.arange(0, R_P2)
        p_ptr = P + g * stride_pg + offs_h[:, None] * stride_pd + offs_r[None, :] * stride_pr
        r_ok = (offs_r < R)[None, :]
        p1 = tl.load(p_ptr, mask=r_ok, other=0.0).to(tl.float32)  # [d/2, R_P2]
        p2 = tl.load(p_ptr + HALF * stride_pd, mask=r_ok, other=0.0).to(tl.float32)
        z = tl.sum(r1[:, None] * p1, 0) + tl.sum(r2[:, None] * p2, 0)
        z_ptr = Z + b * stride_zb + g * stride_zg + n * stride_zn + offs_r * stride_zr
        tl.store(z_ptr, z.to(Z.dtype.element_ty), mask=offs_r < R)


def rope_latent(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                P: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Triton kernel of :func:`stiefkv.kernels.rope_latent` (inputs checked there)."""
    B, N, H, d = q.shape
    has_k = k is not None
    G = k.shape[2] if has_k else 1  # queries alone: one program rotates a token's every head
    q_out = torch.empty(B, N, H, d, device=q.device, dtype=q.dtype)
    r = P.shape[2] if has_k else 1
    z = torch.empty(B, G, N, r, device=q.device, dtype=q.dtype) if has_k else q_out
    k_t, P_t = (k, P) if has_k else (q, q)
    k_strides = k.stride() if has_k else (0, 0, 0, 0)
    p_strides = P.stride() if has_k else (0, 0, 0)
    z_strides = z.stride() if has_k else (0, 0, 0, 0)
    group = H // G
    _rope_latent_fwd[(B * N, G)](
        q, k_t, cos, sin, P_t, q_out, z,
        *q.stride(), *k_strides, *cos.stride(), *sin.stride(), *p_strides, *q_out.stride(), *z_strides,
        N, GROUP=group, GROUP_P2=triton.next_power_of_2(group), HEAD_DIM=d, R=r,
        R_P2=max(16, triton.next_power_of_2(r)), HAS_K=has_k, num_warps=1,
    )
    return q_out.transpose(1, 2), (z if has_k else None)
