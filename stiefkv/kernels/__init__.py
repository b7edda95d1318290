"""Fused attention kernels over tensors, each beside its PyTorch reference (``reference.py``).

:func:`lowrank_attention` and :func:`attention_kl` run the Triton kernel (``lowrank.py``,
``streamkl.py``) on CUDA tensors where Triton is importable, and the PyTorch reference everywhere else.
The choice follows the device of the inputs, never ``TRITON_INTERPRET``: that variable is for the kernel
tests, and CPU callers must not end up in Triton's (slow, serial) interpreter. ``backend="triton"`` forces
the kernel (the interpreter tests reach it that way), ``backend="reference"`` the reference.

This package imports nothing from the rest of StiefKV, and importing it does not import Triton: the kernel
modules are imported on the first call that runs a kernel.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from ._common import (
    KEY_MODES,
    CodesAndBand,
    ExactTail,
    QuantizedLatents,
    RopeSpec,
    as_float_latents,
    check_prior,
    merge_by_lse,
    merge_prior,
)
from .reference import attention_kl as attention_kl_reference
from .reference import lowrank_attention as lowrank_attention_reference
from .reference import rope_latent as rope_latent_reference

BACKENDS = ("auto", "triton", "reference")
log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "KEY_MODES", "CodesAndBand", "ExactTail", "QuantizedLatents", "RopeSpec",
           "attention_kl", "attention_kl_reference", "kernel_runs", "lowrank_attention",
           "lowrank_attention_reference", "rope_latent", "rope_latent_reference", "triton_available"]


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports here (it ships with CUDA builds of torch). Imports it on the first call."""
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


@functools.cache
def _warn_grad_fallback() -> None:
    """Say once per process that ``auto`` left the kernel for the reference: the cost is silent otherwise."""
    log.warning("lowrank_attention: inputs on CUDA require grad and the Triton kernel has no backward, so "
                "backend='auto' runs the PyTorch reference; call it under torch.no_grad() for the kernel")


_fallbacks = [0]  # calls that backend="auto" sent to the reference for want of a tile that fits


def reference_fallbacks() -> int:
    """How many calls ``backend="auto"`` ran on the reference because the kernel's tiles fit no GPU config
    (``lowrank.TilesTooLarge``): a caller about to capture a CUDA graph checks it around a warm-up step,
    since the reference reads ``n_valid`` on the host and cannot be captured."""
    return _fallbacks[0]


def _warn_tiles_fallback(reason: str) -> None:
    _fallbacks[0] += 1
    _say_tiles_fallback(reason)


@functools.cache
def _say_tiles_fallback(reason: str) -> None:
    """Say once per kernel that ``auto`` left it for the reference (see ``lowrank.TilesTooLarge``)."""
    log.warning("%s: backend='auto' runs these through the PyTorch reference", reason.split(";")[0])


def _use_kernel(backend: str, device: torch.device, *, needs_grad: bool = False) -> bool:
    """Resolve ``backend`` for inputs on ``device``; ``needs_grad`` keeps ``auto`` off a forward-only
    kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        # Device first: a CPU call never imports Triton.
        if device.type != "cuda" or not triton_available():
            return False
        if needs_grad:
            _warn_grad_fallback()
        return not needs_grad
    if backend == "triton" and not triton_available():
        raise RuntimeError("backend='triton' needs triton (pip install triton); use backend='auto' or "
                           "'reference'")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"backend='triton' runs the Triton kernels on CUDA and the tensors are on {device} "
                         "(set TRITON_INTERPRET=1 to interpret them there, slowly): use backend='auto' or "
                         "'reference'")
    return backend == "triton"


def kernel_runs(backend: str, *tensors: torch.Tensor) -> bool:
    """Whether a kernel of this package runs for ``tensors`` under ``backend`` (rather than its reference):
    for callers that keep their own PyTorch path where the kernel does not run."""
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return _use_kernel(backend, tensors[0].device, needs_grad=needs_grad)


def rope_latent(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                P: torch.Tensor | None, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor | None]:
    """A decoder layer's queries rotated and, with ``k`` and ``P``, its ``post_rope`` key latents, in one
    launch (``rope.py``): ``q`` ``[B, N, H, d]`` → ``[B, H, N, d]``; ``k`` ``[B, N, G, d]`` → ``Pᵀ rot(k)``
    ``[B, G, N, r]`` for ``P`` ``[G, d, r]``. ``cos, sin`` ``[B, N, d]`` as transformers' rotary embedding
    gives them. Forward-only, like :func:`lowrank_attention`; see :func:`rope_latent_reference`."""
    if (q.dim() != 4 or cos.dim() != 3 or cos.shape[0] not in (1, q.shape[0])
            or cos.shape[1:] != (q.shape[1], q.shape[3]) or sin.shape != cos.shape):
        raise ValueError(f"rope_latent: q [B, N, H, d] and cos, sin [B, N, d] (or [1, N, d]); got "
                         f"{tuple(q.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
    cos, sin = cos.expand(q.shape[0], -1, -1), sin.expand(q.shape[0], -1, -1)  # shared positions: stride 0
    if (k is None) != (P is None):
        raise ValueError("rope_latent: pass k and P together (keys are rotated and projected), or neither")
    if k is not None and (k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3] or P.shape[:2] != (
            k.shape[2], k.shape[3]) or q.shape[2] % k.shape[2]):
        raise ValueError(f"rope_latent: k [B, N, G, d] with G dividing H and P [G, d, r]; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, P {tuple(P.shape)}")
    d = q.shape[3]
    if kernel_runs(backend, q, k, P) and d >= 32 and d & (d - 1) == 0:
        from . import rope

        return rope.rope_latent(q, k, cos, sin, P)
    return rope_latent_reference(q, k, cos, sin, P)


def lowrank_attention(
    q: torch.Tensor,
    z_k: torch.Tensor,
    z_v: torch.Tensor,
    P_k: torch.Tensor,
    P_v: torch.Tensor | None,
    *,
    key_mode: str = "pre_rope",
    positions: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
    bias: torch.Tensor | None = None,
    causal: bool = True,
    lengths: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    scale: float | None = None,
    exact: ExactTail | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over a latent KV cache: ``softmax(scale·q kᵀ + bias) z_v``, then ``P_v`` times that.

    Parameters
    ----------
    q : ``[B, H, Nq, d]`` queries, already rotated at their positions.
    z_k : ``[B, G, Nk, r_k]`` and z_v : ``[B, G, Nk, r_v]`` key and value latents (``H % G == 0``), float or
        :class:`QuantizedLatents` (8-, 4-, 3- or 2-bit codes the kernel dequantizes in registers).
    P_k : ``[G, d, r_k]`` and P_v : ``[G, d, r_v]`` orthonormal bases; ``P_v=None`` returns the output in
        latent space ``[B, H, Nq, r_v]`` (for a ``P_v`` folded into ``o_proj``).
    key_mode : ``"pre_rope"`` (keys rebuilt as ``P_k z_k`` and rotated at ``positions`` ``[B, Nk]``, or
        ``[B, G, Nk]`` per KV head, with ``rope``) or ``"post_rope"`` (attention in ``r_k`` dimensions on
        ``P_kᵀ q``).
    bias : ``[B, G, Nk]`` additive logit bias per key (compacted tokens).
    causal : query ``i`` sits at key index ``Nk − Nq + i`` and sees keys up to it.
    lengths : ``[B]`` real keys per row, right-aligned (left padding); all real when ``None``.
    n_valid : one int32 on the inputs' device: only the first ``n_valid`` of the ``Nk`` key slots hold
        keys (a preallocated static cache); ``Nk`` and ``lengths`` above then count those. The kernel reads
        it from device memory (a captured graph replays with the count of the moment); the reference reads
        it back to the host.
    scale : softmax scale, ``d**-0.5`` by default.
    exact : :class:`ExactTail`, for a forward of many queries over quantized latents: each query reads its
        recent keys exact, as decoding them one by one would. Where the kernel runs, it takes the keys below
        the band (every query reads them as stored) and the band kernel (``band.py``) the band, the first
        continuing the second's softmax (:func:`_below_and_band`); elsewhere the reference takes all
        (decode needs none: its one query reads the cache as it is).
    backend : ``"auto"`` (the kernel for CUDA inputs that need no gradient, else the reference),
        ``"triton"`` (the kernel; on the CPU only under ``TRITON_INTERPRET=1``) or ``"reference"``.
    return_lse : also return each row's log-sum-exp of its scaled, biased logits ``[B, H, Nq]`` (float32,
        −inf where no key is visible): two attentions over disjoint keys merge by it (the exact recent
        tokens of a static cache beside its codes).
    prior : ``(o, lse)``, an attention over other keys (its output, as this call's, and log-sum-exp): the
        result is attention over both key sets, as :func:`merge_by_lse` of the two gives. The kernel starts
        its softmax from that state (latent outputs, ``P_v=None``: no merge kernels); with ``P_v`` the two
        are merged after.

    Returns
    -------
    ``[B, H, Nq, d]`` (or ``[B, H, Nq, r_v]``) in ``q.dtype``; a row with no visible key is 0.

    The kernel is forward-only: ``auto`` takes the reference where autograd needs a backward, and
    ``"triton"`` refuses such inputs. See ``lowrank.py`` for what the kernel supports (power-of-two head
    dims ≥ 32, GQA groups ≤ 16); outside that it raises ``ValueError`` rather than falling back.
    """
    prior_tensors = prior if isinstance(prior, (tuple, list)) else ()
    tensors = (q, P_k, P_v, bias, *(t for t in (z_k, z_v, *prior_tensors) if isinstance(t, torch.Tensor)))
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    kwargs = dict(key_mode=key_mode, positions=positions, rope=rope, bias=bias, causal=causal,
                  lengths=lengths, n_valid=n_valid, scale=scale, return_lse=return_lse)
    if prior is not None:
        kwargs["prior"] = prior
    if (exact is not None and _use_kernel(backend, q.device, needs_grad=needs_grad)
            and _band_splits(q, z_k, z_v, exact, kwargs)):
        return _below_and_band(q, z_k, z_v, P_k, P_v, exact, backend, **kwargs)
    # codes beside a band not split here are read whole (plain codes stay codes: the kernel reads them)
    z_k, z_v = (as_float_latents(z, q.dtype) if isinstance(z, CodesAndBand) else z for z in (z_k, z_v))
    if exact is not None:
        return lowrank_attention_reference(q, z_k, z_v, P_k, P_v, exact=exact, **kwargs)
    if _use_kernel(backend, q.device, needs_grad=needs_grad):
        from . import lowrank

        try:
            if prior is not None and P_v is not None:  # the kernel continues a softmax in latent space only
                check_prior(prior, q, q.shape[3])
                out, lse = lowrank.lowrank_attention(q, z_k, z_v, P_k, P_v, **dict(kwargs, return_lse=True,
                                                                                  prior=None))
                return merge_prior(prior, out, lse, q.dtype, return_lse)
            return lowrank.lowrank_attention(q, z_k, z_v, P_k, P_v, **kwargs)
        except lowrank.TilesTooLarge as err:
            if backend != "auto":
                raise
            _warn_tiles_fallback(str(err))
    return lowrank_attention_reference(q, z_k, z_v, P_k, P_v, **kwargs)


def _band_splits(q, z_k, z_v, exact: ExactTail, kwargs: dict) -> bool:
    """Whether a forward with an exact band has keys below it to give the kernel: float latents, or a static
    cache's :class:`CodesAndBand` split where the band starts (codes are not cut here: their channel groups),
    keys older than the band, a band that starts at or before the first query when causal (else the keys
    below it are not all visible to every query), one forward's own count (no ``n_valid``) and its output
    alone (no ``return_lse``)."""
    band = exact.z_k.shape[2]
    cut = z_k.shape[2] - band
    plain = all(isinstance(z, torch.Tensor) or (isinstance(z, CodesAndBand) and z.split == cut)
                for z in (z_k, z_v))
    return (plain and z_k.shape[2] > band and (band >= q.shape[2] or not kwargs["causal"])
            and kwargs["n_valid"] is None and not kwargs["return_lse"] and "prior" not in kwargs)


def _below_and_band(q, z_k, z_v, P_k, P_v, exact: ExactTail, backend: str, *, positions, bias, lengths,
                    causal, **kwargs) -> torch.Tensor:
    """Attention with an exact band in two parts: the keys below the band, which every query reads as
    stored and sees (the band starts at or before the first query), in the kernel with ``causal=False``;
    the band, with each query's exact keys, in one launch of :func:`band.band_attention` (the reference
    where Triton's head dims do not fit it). With a latent output (``P_v=None``) the kernel below continues
    the band's softmax (``prior=``); otherwise the two merge by their log-sum-exp. Either part's cost then
    grows with the band (a prefill chunk and the exact window), not with every key held."""
    band = exact.z_k.shape[2]
    cut = z_k.shape[2] - band
    below_lengths = band_lengths = None
    if lengths is not None:  # real keys are the last ``lengths`` of each row
        below_lengths = (lengths - band).clamp(min=0)
        band_lengths = lengths.clamp(max=band)

    def part(t, lo, hi):
        return None if t is None else t[..., lo:hi]

    shifted = ExactTail(exact.z_k, exact.z_v, exact.key_from - cut, exact.value_from - cut)
    band_args = dict(key_mode=kwargs["key_mode"], positions=part(positions, cut, None), rope=kwargs["rope"],
                     bias=part(bias, cut, None), lengths=band_lengths, causal=causal, scale=kwargs["scale"])
    z_k_band, z_v_band = z_k[:, :, cut:], z_v[:, :, cut:]
    from .band import band_attention, fits

    if fits(q.shape[3], z_k.shape[3], z_v.shape[3]) and backend != "reference":
        o2, l2 = band_attention(q, z_k_band, z_v_band, shifted, P_k, P_v, **band_args)
    else:
        o2, l2 = lowrank_attention_reference(q, z_k_band, z_v_band, P_k, P_v, exact=shifted,
                                             return_lse=True, **band_args)
    below = dict(kwargs, positions=part(positions, 0, cut), bias=part(bias, 0, cut), lengths=below_lengths,
                 causal=False, backend=backend)
    if P_v is None:
        return lowrank_attention(q, z_k[:, :, :cut], z_v[:, :, :cut], P_k, P_v, prior=(o2, l2), **below)
    o1, l1 = lowrank_attention(q, z_k[:, :, :cut], z_v[:, :, :cut], P_k, P_v, **dict(below, return_lse=True))
    return merge_by_lse(o1, l1, o2, l2, q.dtype)


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
    backend: str = "auto",
) -> torch.Tensor:
    """KL divergence between a teacher's and a student's attention distributions (StreamKL).

    ``P_t = softmax(scale_t·q_t k_tᵀ)``, ``P_s = softmax(scale_s·q_s k_sᵀ)``; per query row
    ``KL(P_t ‖ P_s)`` (``direction="forward"``) or ``KL(P_s ‖ P_t)`` (``"reverse"``), float32.

    Parameters
    ----------
    q_t : ``[B, H, Nq, d_t]``, k_t : ``[B, H_t, Nk, d_t]`` teacher queries and keys.
    q_s : ``[B, H, Nq, d_s]``, k_s : ``[B, H_s, Nk, d_s]`` student queries and keys; GQA independently.
    causal : query ``i`` sees keys up to index ``Nk − Nq + i``.
    scale_t, scale_s : logit scales, ``d**-0.5`` by default.
    reduction : ``"none"`` ``[B, H, Nq]``, ``"sum"`` or ``"mean"`` over all rows.
    direction : ``"forward"`` or ``"reverse"``.
    backend : ``"auto"`` (the kernel for CUDA inputs, else the reference), ``"triton"`` (the kernel; on the
        CPU only under ``TRITON_INTERPRET=1``) or ``"reference"`` (materialises ``[B, H, Nq, Nk]``).

    Both paths are differentiable in every input; the kernel stores nothing of size ``Nq × Nk``.
    """
    kwargs = dict(causal=causal, scale_t=scale_t, scale_s=scale_s, reduction=reduction, direction=direction)
    if _use_kernel(backend, q_t.device):
        from . import streamkl

        return streamkl.attention_kl(q_t, k_t, q_s, k_s, **kwargs)
    return attention_kl_reference(q_t, k_t, q_s, k_s, **kwargs)
