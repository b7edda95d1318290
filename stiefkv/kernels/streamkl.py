"""StreamKL: the KL divergence between two attention distributions, fused, without N×N matrices.

For a teacher ``P_t = softmax(a)``, ``a = scale_t·q_t k_tᵀ``, and a student ``P_s = softmax(b)``,
``b = scale_s·q_s k_sᵀ``, every query row gets

    KL(P_t ‖ P_s) = Σ_j p_j (a_j − b_j) − LSE_t + LSE_s = u/ℓ_t − LSE_t + LSE_s,

with ``u = Σ_j exp(a_j − m_t)(a_j − b_j)`` and ``ℓ_t = Σ_j exp(a_j − m_t)`` kept as running sums over key
tiles and rescaled by ``exp(m_t − m_t')`` whenever the running max ``m_t`` moves (DESIGN.md, Kernels).
The backward recomputes each tile from the saved per-row ``LSE_t, LSE_s`` and ``e = u/ℓ_t``:

    ∂KL/∂a_j = p_j (a_j − b_j − e),        ∂KL/∂b_j = s_j − p_j.

Kernels work in log2 units (``a·log₂e``) so that every exponential is an ``exp2``; ``KL`` is converted
back to nats once per row. ``direction="reverse"`` is ``KL(P_s ‖ P_t)``: the same kernels with the roles
swapped on the host. Layout follows Triton's fused-attention tutorial: jit helpers → forward kernel →
backward kernels → host launchers → autograd Function → :func:`attention_kl`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._common import LN2, LOG2E, check_kl_inputs, interpreting, padded_dim
from .reference import attention_kl as attention_kl_reference

MAX_HEAD_DIM = 256  # two query tiles of this width still fit in registers/shared memory
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Module globals that a jit function reads must be constexprs.
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(LN2)


def _autotune(configs, key):
    """``triton.autotune`` over ``configs``; under the interpreter, which is serial and never tunes, one
    tiny block instead, so that the CPU tests cross many tile boundaries at small sizes."""
    if interpreting():
        configs = [{"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}]
    return triton.autotune(
        [triton.Config({"BLOCK_M": c["BLOCK_M"], "BLOCK_N": c["BLOCK_N"]}, num_warps=c["num_warps"],
                       num_stages=c["num_stages"]) for c in configs],
        key=key,
    )


# Few configs on purpose: every one compiles per (head dims, causal, dtype, gradient flags). Two query tiles
# (or two fp32 accumulators) of width d live in registers; these compile for sm_90 at d = 128 without
# spilling (ptxas -v, Triton 3.9), which 4 warps or larger tiles did not.
_FWD_CONFIGS = [  # BLOCK_M query rows per program, BLOCK_N keys per step
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
]
_DQ_CONFIGS = [
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2},
]
_DK_CONFIGS = [  # BLOCK_N keys per program, BLOCK_M query rows per step
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
]
# Not keyed on the length: tuning happens once per head dims and flags, at the first length seen.
_TUNE_KEY = ["D_T", "D_S", "CAUSAL", "T_GRAD", "S_GRAD"]


# ----------------------------------------------------------------------------------------------- jit helpers
@triton.jit
def _load_tile(Ptr, offs_row, offs_d, stride_row, stride_d, n_rows, D: tl.constexpr, TRANSPOSE: tl.constexpr):
    """``[rows, BLOCK_D]`` tile (``[BLOCK_D, rows]`` if ``TRANSPOSE``); zero past ``n_rows`` and ``D``."""
    if TRANSPOSE:
        ptrs = Ptr + offs_d[:, None] * stride_d + offs_row[None, :] * stride_row
        mask = (offs_d[:, None] < D) & (offs_row[None, :] < n_rows)
    else:
        ptrs = Ptr + offs_row[:, None] * stride_row + offs_d[None, :] * stride_d
        mask = (offs_row[:, None] < n_rows) & (offs_d[None, :] < D)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _logits(x_t, y_t, x_s, y_s, visible, qk_scale_t, qk_scale_s,
            MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Teacher and student logits of one tile in log2 units, ``a = log₂e·scale_t·x_t y_t`` (``b`` likewise).

    ``x`` are query tiles ``[rows, d]``, ``y`` transposed key tiles ``[d, keys]``. Hidden entries
    (``MASKED`` and not ``visible``) become ``−inf`` in ``a`` and ``b`` and 0 in ``a − b``.
    """
    a = tl.dot(x_t, y_t, input_precision=PRECISION) * qk_scale_t
    b = tl.dot(x_s, y_s, input_precision=PRECISION) * qk_scale_s
    diff = a - b
    if MASKED:
        a = tl.where(visible, a, float("-inf"))
        b = tl.where(visible, b, float("-inf"))
        diff = tl.where(visible, diff, 0.0)
    return a, b, diff


@triton.jit
def _fwd_inner(m_t, l_t, m_s, l_s, u, q_t, q_s, Kt, Ks, stride_ktn, stride_ktd, stride_ksn, stride_ksd,
               offs_m, lo, hi, n_keys, shift, qk_scale_t, qk_scale_s,
               D_T: tl.constexpr, D_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DT: tl.constexpr,
               BLOCK_DS: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Fold key tiles ``[lo, hi)`` into the running row statistics (the one softmax loop, per stage).

    ``m' = max(m, max_j a_j)``; ``ℓ_t ← ℓ_t·2^(m−m') + Σ_j 2^(a_j−m')``;
    ``u ← u·2^(m−m') + Σ_j 2^(a_j−m')(a_j−b_j)``; the student's ``m_s, ℓ_s`` likewise. ``MASKED`` stages
    apply the key bound and the causal mask.
    """
    offs_dt = tl.arange(0, BLOCK_DT)
    offs_ds = tl.arange(0, BLOCK_DS)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT_t = _load_tile(Kt, offs_n, offs_dt, stride_ktn, stride_ktd, n_keys, D_T, True)
        kT_s = _load_tile(Ks, offs_n, offs_ds, stride_ksn, stride_ksd, n_keys, D_S, True)
        visible = offs_n[None, :] < n_keys
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
        a, b, diff = _logits(q_t, kT_t, q_s, kT_s, visible, qk_scale_t, qk_scale_s, MASKED, PRECISION)
        m_t_new = tl.maximum(m_t, tl.max(a, 1))
        m_s_new = tl.maximum(m_s, tl.max(b, 1))
        p = tl.exp2(a - m_t_new[:, None])
        alpha_t = tl.exp2(m_t - m_t_new)
        l_t = l_t * alpha_t + tl.sum(p, 1)
        u = u * alpha_t + tl.sum(p * diff, 1)
        l_s = l_s * tl.exp2(m_s - m_s_new) + tl.sum(tl.exp2(b - m_s_new[:, None]), 1)
        m_t = m_t_new
        m_s = m_s_new
    return m_t, l_t, m_s, l_s, u


@triton.jit
def _grad_tile(x_t, y_t, x_s, y_s, lse_t, lse_s, e, g, visible, qk_scale_t, qk_scale_s,
               MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Recompute a tile from the row statistics; return ``g·p·(a−b−e)`` and ``g·(s−p)`` (log2 units).

    ``p = 2^(a − lse_t)``, ``s = 2^(b − lse_s)``; ``lse_*, e, g`` are per-row ``[rows, 1]``. Rows past the
    end carry ``lse = +inf, g = 0`` and so contribute nothing.
    """
    a, b, diff = _logits(x_t, y_t, x_s, y_s, visible, qk_scale_t, qk_scale_s, MASKED, PRECISION)
    p = tl.exp2(a - lse_t)
    s = tl.exp2(b - lse_s)
    return g * p * (diff - e), g * (s - p)


@triton.jit
def _key_range(start_m, n_q, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """Split the keys of query tile ``[start_m, start_m + BLOCK_M)``: ``[0, full)`` visible to every row of
    the tile (no mask), ``[full, hi)`` needs the mask. Query ``i`` sits at key index ``i + n_keys − n_q``."""
    if CAUSAL:
        shift = n_keys - n_q
        full = tl.maximum(start_m + shift + 1, 0) // BLOCK_N * BLOCK_N
        hi = tl.minimum(tl.maximum(start_m + BLOCK_M + shift, 0), n_keys)
    else:
        full = n_keys // BLOCK_N * BLOCK_N
        hi = n_keys
    return full, hi


# ---------------------------------------------------------------------------------------------------- forward
@_autotune(_FWD_CONFIGS, key=["D_T", "D_S", "CAUSAL"])
@triton.jit
def _streamkl_fwd(Qt, Kt, Qs, Ks, KL, LSE_T, LSE_S, E,
                  stride_qtb, stride_qth, stride_qtm, stride_qtd,
                  stride_ktb, stride_kth, stride_ktn, stride_ktd,
                  stride_qsb, stride_qsh, stride_qsm, stride_qsd,
                  stride_ksb, stride_ksh, stride_ksn, stride_ksd,
                  n_heads, n_q, n_keys, GROUP_T, GROUP_S, scale_t, scale_s,
                  D_T: tl.constexpr, D_S: tl.constexpr, BLOCK_DT: tl.constexpr, BLOCK_DS: tl.constexpr,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    """Per query row ``KL = ln2·(e − lse_t + lse_s)``, ``e = u/ℓ_t``, ``lse = m + log₂ℓ`` (log2 units).

    One program per (query tile, batch·head); query head ``h`` reads teacher KV head ``h // GROUP_T`` and
    student KV head ``h // GROUP_S``. Writes ``KL`` and the saved row statistics ``LSE_T, LSE_S, E``
    (contiguous ``[B·H, n_q]``); a row with no visible key gets ``KL = 0``, ``lse = +inf``, ``e = 0``.
    """
    tl.static_assert(BLOCK_DT >= D_T)
    tl.static_assert(BLOCK_DS >= D_S)
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // n_heads
    off_h = off_bh % n_heads
    Qt += off_b * stride_qtb + off_h * stride_qth
    Qs += off_b * stride_qsb + off_h * stride_qsh
    Kt += off_b * stride_ktb + (off_h // GROUP_T) * stride_kth
    Ks += off_b * stride_ksb + (off_h // GROUP_S) * stride_ksh
    offs_m = start_m + tl.arange(0, BLOCK_M)
    q_t = _load_tile(Qt, offs_m, tl.arange(0, BLOCK_DT), stride_qtm, stride_qtd, n_q, D_T, False)
    q_s = _load_tile(Qs, offs_m, tl.arange(0, BLOCK_DS), stride_qsm, stride_qsd, n_q, D_S, False)
    qk_scale_t = scale_t * _LOG2E
    qk_scale_s = scale_s * _LOG2E
    # A finite floor, not -inf: a row that has seen no visible key yet keeps 2^(m − m') free of inf − inf.
    m_t = tl.full([BLOCK_M], -1.0e30, tl.float32)
    m_s = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_t = tl.zeros([BLOCK_M], tl.float32)
    l_s = tl.zeros([BLOCK_M], tl.float32)
    u = tl.zeros([BLOCK_M], tl.float32)
    shift = n_keys - n_q
    full, hi = _key_range(start_m, n_q, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    # Two stages of the one loop: key tiles every row of the tile sees whole, then the masked rest.
    m_t, l_t, m_s, l_s, u = _fwd_inner(m_t, l_t, m_s, l_s, u, q_t, q_s, Kt, Ks, stride_ktn, stride_ktd,
                                       stride_ksn, stride_ksd, offs_m, 0, full, n_keys, shift, qk_scale_t,
                                       qk_scale_s, D_T, D_S, BLOCK_N, BLOCK_DT, BLOCK_DS, CAUSAL, False,
                                       PRECISION)
    m_t, l_t, m_s, l_s, u = _fwd_inner(m_t, l_t, m_s, l_s, u, q_t, q_s, Kt, Ks, stride_ktn, stride_ktd,
                                       stride_ksn, stride_ksd, offs_m, full, hi, n_keys, shift, qk_scale_t,
                                       qk_scale_s, D_T, D_S, BLOCK_N, BLOCK_DT, BLOCK_DS, CAUSAL, True,
                                       PRECISION)
    seen = l_t > 0.0  # False only for rows with no visible key (causal with n_q > n_keys)
    lse_t = m_t + tl.log2(tl.where(seen, l_t, 1.0))
    lse_s = m_s + tl.log2(tl.where(seen, l_s, 1.0))
    e = u / tl.where(seen, l_t, 1.0)
    kl = tl.where(seen, (e - lse_t + lse_s) * _LN2, 0.0)
    lse_t = tl.where(seen, lse_t, float("inf"))
    lse_s = tl.where(seen, lse_s, float("inf"))
    rows = off_bh * n_q + offs_m
    row_ok = offs_m < n_q
    tl.store(KL + rows, kl, mask=row_ok)
    tl.store(LSE_T + rows, lse_t, mask=row_ok)
    tl.store(LSE_S + rows, lse_s, mask=row_ok)
    tl.store(E + rows, e, mask=row_ok)


# --------------------------------------------------------------------------------------------------- backward
@triton.jit
def _dq_inner(dq_t, dq_s, q_t, q_s, lse_t, lse_s, e, g, Kt, Ks, stride_ktn, stride_ktd, stride_ksn,
              stride_ksd, offs_m, lo, hi, n_keys, shift, qk_scale_t, qk_scale_s,
              D_T: tl.constexpr, D_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DT: tl.constexpr,
              BLOCK_DS: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, T_GRAD: tl.constexpr,
              S_GRAD: tl.constexpr, PRECISION: tl.constexpr):
    """Accumulate ``Σ_j g·p·(a−b−e)·k_t,j`` and ``Σ_j g·(s−p)·k_s,j`` over key tiles ``[lo, hi)``."""
    offs_dt = tl.arange(0, BLOCK_DT)
    offs_ds = tl.arange(0, BLOCK_DS)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kT_t = _load_tile(Kt, offs_n, offs_dt, stride_ktn, stride_ktd, n_keys, D_T, True)
        kT_s = _load_tile(Ks, offs_n, offs_ds, stride_ksn, stride_ksd, n_keys, D_S, True)
        visible = offs_n[None, :] < n_keys
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None] + shift)
        da, db = _grad_tile(q_t, kT_t, q_s, kT_s, lse_t[:, None], lse_s[:, None], e[:, None], g[:, None],
                            visible, qk_scale_t, qk_scale_s, MASKED, PRECISION)
        if T_GRAD:
            dq_t = tl.dot(da.to(kT_t.dtype), tl.trans(kT_t), dq_t, input_precision=PRECISION)
        if S_GRAD:
            dq_s = tl.dot(db.to(kT_s.dtype), tl.trans(kT_s), dq_s, input_precision=PRECISION)
    return dq_t, dq_s


@triton.jit
def _dk_inner(dk_t, dk_s, kT_t, kT_s, Qt, Qs, stride_qtm, stride_qtd, stride_qsm, stride_qsd,
              LSE_T, LSE_S, E, G, offs_n, lo, hi, n_q, shift, qk_scale_t, qk_scale_s,
              D_T: tl.constexpr, D_S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DT: tl.constexpr,
              BLOCK_DS: tl.constexpr, MASKED: tl.constexpr, T_GRAD: tl.constexpr, S_GRAD: tl.constexpr,
              PRECISION: tl.constexpr):
    """Accumulate ``Σ_i g_i·p·(a−b−e_i)·q_t,i`` and ``Σ_i g_i·(s−p)·q_s,i`` over query tiles ``[lo, hi)``.

    Tiles are rows × keys as in the forward, so the keys (``kT``, loop-invariant) stay in shared memory;
    ``MASKED`` stages apply the causal mask. Query rows past ``n_q`` load ``lse = +inf`` and ``g = 0``,
    so they need no mask.
    """
    offs_dt = tl.arange(0, BLOCK_DT)
    offs_ds = tl.arange(0, BLOCK_DS)
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q_t = _load_tile(Qt, offs_m, offs_dt, stride_qtm, stride_qtd, n_q, D_T, False)
        q_s = _load_tile(Qs, offs_m, offs_ds, stride_qsm, stride_qsd, n_q, D_S, False)
        row_ok = offs_m < n_q
        lse_t = tl.load(LSE_T + offs_m, mask=row_ok, other=float("inf"))
        lse_s = tl.load(LSE_S + offs_m, mask=row_ok, other=float("inf"))
        e = tl.load(E + offs_m, mask=row_ok, other=0.0)
        g = tl.load(G + offs_m, mask=row_ok, other=0.0)
        visible = offs_n[None, :] <= offs_m[:, None] + shift
        da, db = _grad_tile(q_t, kT_t, q_s, kT_s, lse_t[:, None], lse_s[:, None], e[:, None], g[:, None],
                            visible, qk_scale_t, qk_scale_s, MASKED, PRECISION)
        if T_GRAD:
            dk_t = tl.dot(tl.trans(da.to(q_t.dtype)), q_t, dk_t, input_precision=PRECISION)
        if S_GRAD:
            dk_s = tl.dot(tl.trans(db.to(q_s.dtype)), q_s, dk_s, input_precision=PRECISION)
    return dk_t, dk_s


@_autotune(_DQ_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _streamkl_bwd_dq(Qt, Kt, Qs, Ks, DQt, DQs, LSE_T, LSE_S, E, G,
                     stride_qtb, stride_qth, stride_qtm, stride_qtd,
                     stride_ktb, stride_kth, stride_ktn, stride_ktd,
                     stride_qsb, stride_qsh, stride_qsm, stride_qsd,
                     stride_ksb, stride_ksh, stride_ksn, stride_ksd,
                     stride_dqtb, stride_dqth, stride_dqtm, stride_dqtd,
                     stride_dqsb, stride_dqsh, stride_dqsm, stride_dqsd,
                     n_heads, n_q, n_keys, GROUP_T, GROUP_S, scale_t, scale_s,
                     D_T: tl.constexpr, D_S: tl.constexpr, BLOCK_DT: tl.constexpr, BLOCK_DS: tl.constexpr,
                     CAUSAL: tl.constexpr, T_GRAD: tl.constexpr, S_GRAD: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query gradients of one query tile, the same key walk as the forward:

    ``dq_t = ln2·scale_t·Σ_j g·p_j·(a_j − b_j − e)·k_t,j`` (the ln2 turns log2-unit logits back into nats),
    ``dq_s = scale_s·Σ_j g·(s_j − p_j)·k_s,j``, with ``g = ∂L/∂KL`` of the row.
    """
    start_m = tl.program_id(0) * BLOCK_M
    off_bh = tl.program_id(1).to(tl.int64)
    off_b = off_bh // n_heads
    off_h = off_bh % n_heads
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dt = tl.arange(0, BLOCK_DT)
    offs_ds = tl.arange(0, BLOCK_DS)
    q_t = _load_tile(Qt + off_b * stride_qtb + off_h * stride_qth, offs_m, offs_dt, stride_qtm, stride_qtd,
                     n_q, D_T, False)
    q_s = _load_tile(Qs + off_b * stride_qsb + off_h * stride_qsh, offs_m, offs_ds, stride_qsm, stride_qsd,
                     n_q, D_S, False)
    Kt += off_b * stride_ktb + (off_h // GROUP_T) * stride_kth
    Ks += off_b * stride_ksb + (off_h // GROUP_S) * stride_ksh
    rows = off_bh * n_q + offs_m
    row_ok = offs_m < n_q
    lse_t = tl.load(LSE_T + rows, mask=row_ok, other=float("inf"))
    lse_s = tl.load(LSE_S + rows, mask=row_ok, other=float("inf"))
    e = tl.load(E + rows, mask=row_ok, other=0.0)
    g = tl.load(G + rows, mask=row_ok, other=0.0)
    qk_scale_t = scale_t * _LOG2E
    qk_scale_s = scale_s * _LOG2E
    dq_t = tl.zeros([BLOCK_M, BLOCK_DT], tl.float32)
    dq_s = tl.zeros([BLOCK_M, BLOCK_DS], tl.float32)
    shift = n_keys - n_q
    full, hi = _key_range(start_m, n_q, n_keys, BLOCK_M, BLOCK_N, CAUSAL)
    dq_t, dq_s = _dq_inner(dq_t, dq_s, q_t, q_s, lse_t, lse_s, e, g, Kt, Ks, stride_ktn, stride_ktd,
                           stride_ksn, stride_ksd, offs_m, 0, full, n_keys, shift, qk_scale_t, qk_scale_s,
                           D_T, D_S, BLOCK_N, BLOCK_DT, BLOCK_DS, CAUSAL, False, T_GRAD, S_GRAD, PRECISION)
    dq_t, dq_s = _dq_inner(dq_t, dq_s, q_t, q_s, lse_t, lse_s, e, g, Kt, Ks, stride_ktn, stride_ktd,
                           stride_ksn, stride_ksd, offs_m, full, hi, n_keys, shift, qk_scale_t, qk_scale_s,
                           D_T, D_S, BLOCK_N, BLOCK_DT, BLOCK_DS, CAUSAL, True, T_GRAD, S_GRAD, PRECISION)
    if T_GRAD:
        ptrs = DQt + off_b * stride_dqtb + off_h * stride_dqth + offs_m[:, None] * stride_dqtm \
            + offs_dt[None, :] * stride_dqtd
        tl.store(ptrs, (dq_t * (scale_t * _LN2)).to(DQt.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dt[None, :] < D_T))
    if S_GRAD:
        ptrs = DQs + off_b * stride_dqsb + off_h * stride_dqsh + offs_m[:, None] * stride_dqsm \
            + offs_ds[None, :] * stride_dqsd
        tl.store(ptrs, (dq_s * scale_s).to(DQs.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_ds[None, :] < D_S))


@_autotune(_DK_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _streamkl_bwd_dk(Qt, Kt, Qs, Ks, DKt, DKs, LSE_T, LSE_S, E, G,
                     stride_qtb, stride_qth, stride_qtm, stride_qtd,
                     stride_ktb, stride_kth, stride_ktn, stride_ktd,
                     stride_qsb, stride_qsh, stride_qsm, stride_qsd,
                     stride_ksb, stride_ksh, stride_ksn, stride_ksd,
                     stride_dktb, stride_dkth, stride_dktn, stride_dktd,
                     stride_dksb, stride_dksh, stride_dksn, stride_dksd,
                     n_heads, n_q, n_keys, scale_t, scale_s,
                     GROUP_T: tl.constexpr, GROUP_S: tl.constexpr, CHUNK: tl.constexpr, D_T: tl.constexpr,
                     D_S: tl.constexpr, BLOCK_DT: tl.constexpr, BLOCK_DS: tl.constexpr, CAUSAL: tl.constexpr,
                     T_GRAD: tl.constexpr, S_GRAD: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key gradients of one key tile, summed over the query heads that share each KV head:

    ``dk_t = ln2·scale_t·Σ_h Σ_i g_i·p·(a − b − e_i)·q_t,i``, ``dk_s = scale_s·Σ_h Σ_i g_i·(s − p)·q_s,i``.
    A program walks ``CHUNK = lcm(GROUP_T, GROUP_S)`` consecutive query heads, a union of whole teacher
    groups and whole student groups, and stores each accumulator when its group ends: no atomics. The
    walk is unrolled (constexpr): as a run-time loop it made the compiler spill (ptxas, sm_90).
    """
    start_n = tl.program_id(0) * BLOCK_N
    pid = tl.program_id(1).to(tl.int64)
    n_chunks = n_heads // CHUNK
    off_b = pid // n_chunks
    first_head = (pid % n_chunks) * CHUNK
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_dt = tl.arange(0, BLOCK_DT)
    offs_ds = tl.arange(0, BLOCK_DS)
    shift = n_keys - n_q
    # Query tiles [lo, mid) see only part of this key tile (masked); [mid, n_q) see all of it.
    lo = 0
    mid = 0
    if CAUSAL:
        lo = tl.maximum(start_n - shift, 0) // BLOCK_M * BLOCK_M
        mid = tl.maximum(tl.cdiv(tl.maximum(start_n + BLOCK_N - 1 - shift, 0), BLOCK_M) * BLOCK_M, lo)
        mid = tl.minimum(mid, tl.cdiv(n_q, BLOCK_M) * BLOCK_M)
    qk_scale_t = scale_t * _LOG2E
    qk_scale_s = scale_s * _LOG2E
    dk_t = tl.zeros([BLOCK_N, BLOCK_DT], tl.float32)
    dk_s = tl.zeros([BLOCK_N, BLOCK_DS], tl.float32)
    key_ok = offs_n < n_keys
    for j in tl.static_range(CHUNK):
        h = first_head + j
        kT_t = _load_tile(Kt + off_b * stride_ktb + (h // GROUP_T) * stride_kth, offs_n, offs_dt, stride_ktn,
                          stride_ktd, n_keys, D_T, True)
        kT_s = _load_tile(Ks + off_b * stride_ksb + (h // GROUP_S) * stride_ksh, offs_n, offs_ds, stride_ksn,
                          stride_ksd, n_keys, D_S, True)
        Qt_h = Qt + off_b * stride_qtb + h * stride_qth
        Qs_h = Qs + off_b * stride_qsb + h * stride_qsh
        row0 = (off_b * n_heads + h) * n_q  # this head's rows of the saved statistics
        dk_t, dk_s = _dk_inner(dk_t, dk_s, kT_t, kT_s, Qt_h, Qs_h, stride_qtm, stride_qtd, stride_qsm,
                               stride_qsd, LSE_T + row0, LSE_S + row0, E + row0, G + row0, offs_n, lo, mid,
                               n_q, shift, qk_scale_t, qk_scale_s, D_T, D_S, BLOCK_M, BLOCK_DT, BLOCK_DS,
                               True, T_GRAD, S_GRAD, PRECISION)
        dk_t, dk_s = _dk_inner(dk_t, dk_s, kT_t, kT_s, Qt_h, Qs_h, stride_qtm, stride_qtd, stride_qsm,
                               stride_qsd, LSE_T + row0, LSE_S + row0, E + row0, G + row0, offs_n, mid, n_q,
                               n_q, shift, qk_scale_t, qk_scale_s, D_T, D_S, BLOCK_M, BLOCK_DT, BLOCK_DS,
                               False, T_GRAD, S_GRAD, PRECISION)
        if T_GRAD:
            if (j + 1) % GROUP_T == 0:  # last query head of teacher KV head h // GROUP_T: flush
                ptrs = DKt + off_b * stride_dktb + (h // GROUP_T) * stride_dkth \
                    + offs_n[:, None] * stride_dktn + offs_dt[None, :] * stride_dktd
                tl.store(ptrs, (dk_t * (scale_t * _LN2)).to(DKt.dtype.element_ty),
                         mask=key_ok[:, None] & (offs_dt[None, :] < D_T))
                dk_t = tl.zeros([BLOCK_N, BLOCK_DT], tl.float32)
        if S_GRAD:
            if (j + 1) % GROUP_S == 0:
                ptrs = DKs + off_b * stride_dksb + (h // GROUP_S) * stride_dksh \
                    + offs_n[:, None] * stride_dksn + offs_ds[None, :] * stride_dksd
                tl.store(ptrs, (dk_s * scale_s).to(DKs.dtype.element_ty),
                         mask=key_ok[:, None] & (offs_ds[None, :] < D_S))
                dk_s = tl.zeros([BLOCK_N, BLOCK_DS], tl.float32)


# -------------------------------------------------------------------------------------------------- host side
def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 dots (the reference's arithmetic), not TF32; 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _dims(q_t, k_t, q_s, k_s) -> dict:
    B, H, n_q, d_t = q_t.shape
    return {"n_heads": H, "n_q": n_q, "n_keys": k_t.shape[2], "GROUP_T": H // k_t.shape[1],
            "GROUP_S": H // k_s.shape[1], "D_T": d_t, "D_S": q_s.shape[-1], "BLOCK_DT": padded_dim(d_t),
            "BLOCK_DS": padded_dim(q_s.shape[-1]), "PRECISION": _precision(q_t.dtype)}


def _streamkl_forward(q_t, k_t, q_s, k_s, causal: bool, scale_t: float, scale_s: float):
    """Launch the forward; returns per-row KL ``[B, H, n_q]`` and the row statistics ``[3, B, H, n_q]``
    (``lse_t, lse_s, e`` in log2 units), all float32."""
    B, H, n_q, _ = q_t.shape
    kl = torch.empty(B, H, n_q, device=q_t.device, dtype=torch.float32)
    stats = torch.empty(3, B, H, n_q, device=q_t.device, dtype=torch.float32)
    d = _dims(q_t, k_t, q_s, k_s)
    grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), B * H)  # noqa: E731
    _streamkl_fwd[grid](q_t, k_t, q_s, k_s, kl, stats[0], stats[1], stats[2],
                        *q_t.stride(), *k_t.stride(), *q_s.stride(), *k_s.stride(),
                        d["n_heads"], d["n_q"], d["n_keys"], d["GROUP_T"], d["GROUP_S"], scale_t, scale_s,
                        D_T=d["D_T"], D_S=d["D_S"], BLOCK_DT=d["BLOCK_DT"], BLOCK_DS=d["BLOCK_DS"],
                        CAUSAL=causal, PRECISION=d["PRECISION"])
    return kl, stats


def _streamkl_backward(grad_kl, q_t, k_t, q_s, k_s, stats, causal: bool, scale_t: float, scale_s: float,
                       needs: tuple[bool, bool, bool, bool]):
    """Gradients ``(dq_t, dk_t, dq_s, dk_s)`` in the inputs' dtypes; ``None`` where ``needs`` is False.

    Two launches, each recomputing the logits from the saved row statistics: a query-tile kernel for the
    ``dq`` and a key-tile kernel for the ``dk``. A single key-tile kernel that also added ``dq`` by float32
    atomics recomputed once, yet made forward + backward 1.4-1.5× slower on the H200 (BENCHMARKS.md,
    StreamKL); it was deleted and lives in the git history.
    """
    B, H, n_q, _ = q_t.shape
    n_keys = k_t.shape[2]
    g = grad_kl.float().expand(B, H, n_q).contiguous()
    d = _dims(q_t, k_t, q_s, k_s)
    common = (d["n_heads"], d["n_q"], d["n_keys"])
    consts = {k: d[k] for k in ("D_T", "D_S", "BLOCK_DT", "BLOCK_DS", "PRECISION")}
    dq_t, dk_t, dq_s, dk_s = (torch.empty_like(x) if need else None
                              for x, need in zip((q_t, k_t, q_s, k_s), needs))
    if needs[0] or needs[2]:
        # A gradient that is not needed is never written (T_GRAD/S_GRAD): its input stands in as the pointer.
        out_t, out_s = (dq_t if needs[0] else q_t), (dq_s if needs[2] else q_s)
        grid = lambda meta: (triton.cdiv(n_q, meta["BLOCK_M"]), B * H)  # noqa: E731
        _streamkl_bwd_dq[grid](q_t, k_t, q_s, k_s, out_t, out_s, stats[0], stats[1], stats[2], g,
                               *q_t.stride(), *k_t.stride(), *q_s.stride(), *k_s.stride(),
                               *out_t.stride(), *out_s.stride(), *common, d["GROUP_T"], d["GROUP_S"],
                               scale_t, scale_s, CAUSAL=causal, T_GRAD=needs[0], S_GRAD=needs[2], **consts)
    if needs[1] or needs[3]:
        out_t, out_s = (dk_t if needs[1] else k_t), (dk_s if needs[3] else k_s)
        chunk = math.lcm(d["GROUP_T"], d["GROUP_S"])
        grid = lambda meta: (triton.cdiv(n_keys, meta["BLOCK_N"]), B * (H // chunk))  # noqa: E731
        _streamkl_bwd_dk[grid](q_t, k_t, q_s, k_s, out_t, out_s, stats[0], stats[1], stats[2], g,
                               *q_t.stride(), *k_t.stride(), *q_s.stride(), *k_s.stride(),
                               *out_t.stride(), *out_s.stride(), *common, scale_t, scale_s,
                               GROUP_T=d["GROUP_T"], GROUP_S=d["GROUP_S"], CHUNK=chunk,
                               CAUSAL=causal, T_GRAD=needs[1], S_GRAD=needs[3], **consts)
    return dq_t, dk_t, dq_s, dk_s


class StreamKLFunction(torch.autograd.Function):
    """Per-row ``KL(P_t ‖ P_s)`` ``[B, H, n_q]`` (float32) with the recomputing backward."""

    @staticmethod
    def forward(ctx, q_t, k_t, q_s, k_s, causal: bool, scale_t: float, scale_s: float):
        kl, stats = _streamkl_forward(q_t, k_t, q_s, k_s, causal, scale_t, scale_s)
        ctx.save_for_backward(q_t, k_t, q_s, k_s, stats)
        ctx.causal, ctx.scale_t, ctx.scale_s = causal, scale_t, scale_s
        return kl

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_kl):
        q_t, k_t, q_s, k_s, stats = ctx.saved_tensors
        grads = _streamkl_backward(grad_kl, q_t, k_t, q_s, k_s, stats, ctx.causal, ctx.scale_t, ctx.scale_s,
                                   tuple(ctx.needs_input_grad[:4]))
        return (*grads, None, None, None)


def _check_inputs(q_t, k_t, q_s, k_s) -> None:
    """Device, shape and dtype checks, so that nothing the backward cannot do gets through."""
    check_kl_inputs(q_t, k_t, q_s, k_s)
    if q_t.device.type != "cuda" and not (q_t.device.type == "cpu" and interpreting()):
        raise RuntimeError(f"the StreamKL kernels run on CUDA tensors (or on the CPU under "
                           f"TRITON_INTERPRET=1), got {q_t.device.type}; stiefkv.kernels.attention_kl picks "
                           "the reference there")
    for name, x in (("q_t", q_t), ("k_t", k_t), ("q_s", q_s), ("k_s", k_s)):
        if x.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {x.dtype}; StreamKL takes float16, bfloat16 or float32 "
                             "(stiefkv.kernels.attention_kl_reference takes any)")
    for name, d in (("k_t", q_t.shape[-1]), ("k_s", q_s.shape[-1])):
        if d > MAX_HEAD_DIM:
            raise ValueError(f"{name} head dim {d} exceeds the kernel's {MAX_HEAD_DIM}; use the reference")


def attention_kl(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    causal: bool = True,
    scale_t: float | None = None,
    scale_s: float | None = None,
    reduction: str = "mean",
    direction: str = "forward",
) -> torch.Tensor:
    """KL divergence between a teacher's and a student's attention distributions, streamed.

    Same function as :func:`stiefkv.kernels.reference.attention_kl`: ``P_t = softmax(scale_t·q_t k_tᵀ)``,
    ``P_s`` likewise, per query row ``KL(P_t ‖ P_s)`` (``direction="forward"``) or ``KL(P_s ‖ P_t)``
    (``"reverse"``), in float32, with ``O(N)`` extra memory in both passes.

    Parameters
    ----------
    q_t : ``[B, H, Nq, d_t]``, k_t : ``[B, H_t, Nk, d_t]`` teacher queries and keys.
    q_s : ``[B, H, Nq, d_s]``, k_s : ``[B, H_s, Nk, d_s]`` student queries and keys; GQA independently,
        ``d_t`` and ``d_s`` may differ (up to 256). float16, bfloat16 or float32; statistics in float32.
    causal : query ``i`` sees keys up to index ``Nk − Nq + i``.
    scale_t, scale_s : logit scales, ``d**-0.5`` by default.
    reduction : ``"none"`` ``[B, H, Nq]``, ``"sum"`` or ``"mean"`` over all rows.
    direction : ``"forward"`` or ``"reverse"``.

    Runs the Triton kernels on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``; anything else
    raises (:func:`stiefkv.kernels.attention_kl` chooses between this and the reference). Gradients reach
    every input that requires them; double backward is not supported.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be 'forward' or 'reverse', got {direction!r}")
    kwargs = dict(causal=causal, scale_t=scale_t, scale_s=scale_s, reduction=reduction, direction=direction)
    _check_inputs(q_t, k_t, q_s, k_s)
    if q_t.shape[2] == 0 or k_t.shape[2] == 0:  # nothing to stream; keep the reference's conventions
        return attention_kl_reference(q_t, k_t, q_s, k_s, **kwargs)
    scale_t = q_t.shape[-1] ** -0.5 if scale_t is None else float(scale_t)
    scale_s = q_s.shape[-1] ** -0.5 if scale_s is None else float(scale_s)
    # The kernels take one dtype for all four; promoting mixed inputs (e.g. bf16 with fp32) is exact.
    dtype = torch.promote_types(torch.promote_types(q_t.dtype, k_t.dtype),
                                torch.promote_types(q_s.dtype, k_s.dtype))
    if q_t.device.type == "cpu" and dtype == torch.bfloat16:
        # The interpreter (triton 3.9) multiplies bf16 bit patterns in tl.dot; fp32 holds bf16 exactly.
        dtype = torch.float32
    q_t, k_t, q_s, k_s = q_t.to(dtype), k_t.to(dtype), q_s.to(dtype), k_s.to(dtype)
    if direction == "reverse":  # KL(P_s ‖ P_t): the student becomes the weighting distribution
        q_t, k_t, q_s, k_s, scale_t, scale_s = q_s, k_s, q_t, k_t, scale_s, scale_t
    kl = StreamKLFunction.apply(q_t, k_t, q_s, k_s, bool(causal), scale_t, scale_s)
    if reduction == "none":
        return kl
    return kl.sum() if reduction == "sum" else kl.mean()
