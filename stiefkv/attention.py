"""Inference with low-rank keys and values: ``LowRankAttention``, ``LatentCache`` and ``load``.

``load(model, ckpt)`` swaps each decoder layer's attention for a :class:`LowRankAttention` that computes
q, k, v as the model does, stores only the latents ``z_k = P_kᵀ k`` and ``z_v = P_vᵀ v`` in the cache,
and attends through :func:`stiefkv.kernels` (Triton on CUDA, the PyTorch reference elsewhere).
"""

from __future__ import annotations

import inspect
import logging
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from stiefkv.kernels import RopeSpec, reference
from stiefkv.models import arch_of, decoder_layers, rope_spec
from stiefkv.projections import Projections

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "reference")


def _dynamic_cache_class():
    from transformers import DynamicCache

    return DynamicCache


class LatentCache(_dynamic_cache_class()):
    """A transformers ``Cache`` whose layers hold ``z_k`` ``[B, G, N, r_k]`` and ``z_v`` ``[B, G, N, r_v]``.

    Besides the latents it keeps one ``[B, N]`` int32 tensor of token positions (shared by all layers),
    which ``pre_rope`` attention needs to rotate rebuilt keys. Pass it as ``cache=`` (transformers ≥ 5.24)
    or ``past_key_values=``; ``generate`` on a model prepared by :func:`load` creates one by itself.
    """

    def __init__(self):
        super().__init__()
        self.positions: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held: every layer's latents plus the positions."""
        total = 0 if self.positions is None else self.positions.nbytes
        for layer in self.layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.nbytes
        return int(total)

    def append_positions(self, positions: torch.Tensor) -> torch.Tensor:
        positions = positions.to(torch.int32)
        self.positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=1)
        return self.positions

    # The positions must follow every batch or length edit transformers makes to the layers.
    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))

    def crop(self, max_length: int):
        super().crop(max_length)
        if self.positions is not None:
            self.positions = self.positions[:, : self.get_seq_length()]

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions = self.positions[indices]

    def reset(self):
        super().reset()
        self.positions = None


def cache_keyword(model: nn.Module) -> str:
    """The keyword this transformers version's ``forward`` takes a cache by (renamed in 5.24)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cache_positions(cache, layer_idx: int, positions: torch.Tensor) -> torch.Tensor:
    """All cached positions ``[B, N]`` after adding ``positions`` (layer 0 adds, the others read).

    A cache that is not a :class:`LatentCache` (the ``DynamicCache`` a model makes for itself when called
    with ``use_cache=True``) keeps its positions in an attribute of ours.
    """
    if not isinstance(cache, LatentCache):
        if layer_idx == 0:
            old = getattr(cache, "_stiefkv_positions", None)
            new = positions.to(torch.int32)
            cache._stiefkv_positions = new if old is None else torch.cat([old, new], dim=1)
        return cache._stiefkv_positions
    if layer_idx == 0:
        return cache.append_positions(positions)
    return cache.positions


def lengths_from_mask(mask: torch.Tensor | None, batch: int, n_keys: int) -> torch.Tensor | None:
    """Real keys per row ``[B]`` from the model's 4-D attention mask, or None when nothing is padded.

    Only left padding is representable in the kernels' interface; any other mask is refused.
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        raise ValueError(f"LowRankAttention needs a 4-D tensor attention mask, got {type(mask).__name__}")
    row = mask[:, 0, -1, -n_keys:]
    visible = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min / 2
    visible = visible.expand(batch, n_keys)
    lengths = visible.sum(dim=-1)
    if not torch.equal(visible, reference.key_padding_mask(lengths, batch, n_keys, visible.device)):
        raise ValueError(
            "StiefKV's latent attention supports left-padded batches only; got a mask with padding on the "
            "right or holes. Set tokenizer.padding_side = 'left'."
        )
    return None if bool((lengths == n_keys).all()) else lengths.to(torch.int32)


def rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE: ``x·cos + rotate_half(x)·sin`` with full-width ``cos, sin`` ``[B, N, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def dispatch_attention(backend: str, q, z_k, z_v, P_k, P_v, **kw) -> torch.Tensor:
    """The Triton kernel on CUDA tensors (``auto``/``triton``), the PyTorch reference otherwise."""
    if backend == "triton" or (backend == "auto" and q.is_cuda and triton_available()):
        from stiefkv.kernels.lowrank import lowrank_attention

        return lowrank_attention(q, z_k, z_v, P_k, P_v, **kw)
    return reference.lowrank_attention(q, z_k, z_v, P_k, P_v, **kw)


def triton_available() -> bool:
    try:
        import stiefkv.kernels.lowrank  # noqa: F401
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class LowRankAttention(nn.Module):
    """Drop-in for a Llama-style attention module whose cache holds low-rank latents.

    Parameters
    ----------
    attn : the model's attention module (its projections and norms are reused, not copied).
    P_k : ``[G, d, r_k]`` and P_v : ``[G, d, r_v]`` orthonormal bases (float32).
    key_mode : ``"pre_rope"`` or ``"post_rope"``.
    rope : the model's :class:`RopeSpec`.
    """

    def __init__(self, attn: nn.Module, P_k: torch.Tensor, P_v: torch.Tensor, *, key_mode: str, rope: RopeSpec,
                 backend: str = "auto"):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.inner = attn
        self.layer_idx = attn.layer_idx
        self.key_mode = key_mode
        self.backend = backend
        device = attn.q_proj.weight.device
        self.register_buffer("P_k", P_k.detach().to(device, torch.float32), persistent=False)
        self.register_buffer("P_v", P_v.detach().to(device, torch.float32), persistent=False)
        self.rope = RopeSpec(rope.inv_freq.to(device), rope.attention_scaling)
        # P_v folded into o_proj (exact): attention returns its output in r_v dimensions and one matmul of
        # [D, H·r_v] replaces P_v's epilogue plus o_proj; measured faster on the H200 (BENCHMARKS.md §2).
        self.register_buffer("o_fold", fold_values_into_o_proj(attn.o_proj.weight, self.P_v), persistent=False)
        fold = fold_bases_into_kv_proj(attn, self.P_k, self.P_v, key_mode)
        for name, tensor in zip(("zk_weight", "zk_bias", "zv_weight", "zv_bias"), fold):
            self.register_buffer(name, tensor, persistent=False)
        self._cast_key: tuple | None = None  # (P_k's storage, version, device, dtype) of the cached cast
        self._cast_P_k: torch.Tensor | None = None

    def key_basis(self, dtype: torch.dtype) -> torch.Tensor:
        """``P_k`` in the latents' dtype, as the kernels take it: cast once, not on every call (again after
        the module moves or ``P_k`` is written in place)."""
        key = (self.P_k.data_ptr(), self.P_k._version, self.P_k.device, dtype)
        if key != self._cast_key:
            self._cast_P_k, self._cast_key = self.P_k.to(dtype), key
        return self._cast_P_k

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, position_ids=None, **kwargs):
        cache = cache if cache is not None else past_key_values
        B, N, _ = hidden_states.shape
        if position_ids is None:
            past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            position_ids = torch.arange(past, past + N, device=hidden_states.device)[None]
        out = attend(self.inner, hidden_states, self.P_k, self.P_v, key_mode=self.key_mode, rope=self.rope,
                     position_embeddings=position_embeddings, attention_mask=attention_mask,
                     positions=position_ids.expand(B, N), cache=cache, backend=self.backend, o_fold=self.o_fold,
                     kv_fold=FoldedKV(self.zk_weight, self.zk_bias, self.zv_weight, self.zv_bias),
                     key_basis=self.key_basis)
        return out, None


class FoldedKV(NamedTuple):
    """``k_proj`` and ``v_proj`` with the bases folded in: ``z = (blockdiag(Pᵀ) W) x + blockdiag(Pᵀ) b``, one
    linear ``[G·r, D]`` per latent in the model's dtype. ``key_weight`` is None where the keys cannot be folded
    (``post_rope`` rotates them before projecting, and a key norm sits between ``k_proj`` and the basis)."""

    key_weight: torch.Tensor | None
    key_bias: torch.Tensor | None
    value_weight: torch.Tensor
    value_bias: torch.Tensor | None


def fold_basis_into_linear(linear: nn.Linear, P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``blockdiag(P_gᵀ) · W`` ``[G·r, D]`` and ``blockdiag(P_gᵀ) · b`` for a ``linear`` of weight ``[G·d, D]``
    and ``P`` ``[G, d, r]``; computed in float32, returned in the linear's dtype."""
    G, d, r = P.shape
    W = linear.weight.float().view(G, d, -1)
    weight = torch.einsum("gdr,gdD->grD", P.float(), W).reshape(G * r, -1).to(linear.weight.dtype)
    bias = None
    if linear.bias is not None:
        bias = torch.einsum("gdr,gd->gr", P.float(), linear.bias.float().view(G, d)).reshape(-1)
        bias = bias.to(linear.bias.dtype)
    return weight, bias


def fold_bases_into_kv_proj(attn: nn.Module, P_k: torch.Tensor, P_v: torch.Tensor, key_mode: str) -> FoldedKV:
    """Serving needs the keys and values only as latents, so their bases fold into ``k_proj`` and ``v_proj``:
    one linear per latent instead of a projection to ``d`` per head, a cast to float32, a matmul with the basis and
    a cast back (exact in exact arithmetic; in the model's dtype it rounds once instead of twice)."""
    key_weight = key_bias = None
    if key_mode == "pre_rope" and getattr(attn, "k_norm", None) is None:
        key_weight, key_bias = fold_basis_into_linear(attn.k_proj, P_k)
    value_weight, value_bias = fold_basis_into_linear(attn.v_proj, P_v)
    return FoldedKV(key_weight, key_bias, value_weight, value_bias)


def _folded_latent(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, G: int) -> torch.Tensor:
    """``[B, N, D]`` → ``[B, G, N, r]`` through a folded projection."""
    B, N, _ = x.shape
    return torch.nn.functional.linear(x, weight, bias).view(B, N, G, -1).transpose(1, 2)


def fold_values_into_o_proj(o_weight: torch.Tensor, P_v: torch.Tensor) -> torch.Tensor:
    """``W_o · blockdiag(P_v of each query head's KV head)``: ``[D, H·r_v]`` in ``o_weight``'s dtype.

    ``o_weight`` ``[D, H·d]``; ``P_v`` ``[G, d, r_v]``; query head ``h`` reads KV head ``h // (H / G)``.
    """
    G, d, r = P_v.shape
    D = o_weight.shape[0]
    H = o_weight.shape[1] // d
    per_head = o_weight.float().view(D, H, d)
    P = P_v.float().repeat_interleave(H // G, dim=0)  # [H, d, r]
    return torch.einsum("ohd,hdr->ohr", per_head, P).reshape(D, H * r).to(o_weight.dtype)


def project_qkv(attn: nn.Module, hidden_states: torch.Tensor, *, keys: bool = True, values: bool = True):
    """q ``[B, H, N, d]``, k ``[B, G, N, d]`` (before RoPE, after any QK-norm), v ``[B, G, N, d]``; k or v is
    None when not asked for."""
    shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(hidden_states).view(shape)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    k = v = None
    if keys:
        k = attn.k_proj(hidden_states).view(shape)
        if getattr(attn, "k_norm", None) is not None:
            k = attn.k_norm(k)
        k = k.transpose(1, 2)
    if values:
        v = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
    return q.transpose(1, 2), k, v


def attend(attn: nn.Module, hidden_states: torch.Tensor, P_k: torch.Tensor, P_v: torch.Tensor, *, key_mode: str,
           rope: RopeSpec, position_embeddings, attention_mask, positions: torch.Tensor, cache=None,
           backend: str = "reference", o_fold: torch.Tensor | None = None, kv_fold: FoldedKV | None = None,
           key_basis=None) -> torch.Tensor:
    """The attention block of one layer with low-rank keys and values, ``o_proj`` included: ``[B, N, D]``.

    ``attn`` is the model's attention module (projections, norms, ``o_proj``); ``P_k, P_v`` float32 bases,
    which may require grad (calibration differentiates through this function); ``positions`` ``[B, N]``
    are the new tokens' positions. With a ``cache`` the new latents are appended and attention runs over
    everything cached. ``o_fold`` (see :func:`fold_values_into_o_proj`) replaces ``P_v`` and ``o_proj``'s weight;
    ``kv_fold`` (see :func:`fold_bases_into_kv_proj`) replaces ``k_proj``/``v_proj`` and the bases where it can;
    ``key_basis(dtype)`` returns ``P_k`` in the latents' dtype (cached by the caller). The folds serve inference;
    calibration, which differentiates through ``P_k, P_v``, passes neither.
    """
    B, N, _ = hidden_states.shape
    G = P_k.shape[0]
    cos, sin = position_embeddings
    q, k, v = project_qkv(attn, hidden_states, keys=kv_fold is None or kv_fold.key_weight is None,
                          values=kv_fold is None)
    q = rotate_with(q, cos, sin)
    if k is not None:
        if key_mode == "post_rope":
            k = rotate_with(k, cos, sin)
        # [B, G, N, d] @ [G, d, r], broadcast over B: matmul, as einsum's host time per call is ~2.6× larger
        z_k = torch.matmul(k.float(), P_k).to(k.dtype)
    else:
        z_k = _folded_latent(hidden_states, kv_fold.key_weight, kv_fold.key_bias, G)
    if v is not None:
        z_v = torch.matmul(v.float(), P_v).to(v.dtype)
    else:
        z_v = _folded_latent(hidden_states, kv_fold.value_weight, kv_fold.value_bias, G)
    if cache is not None:
        z_k, z_v = cache.update(z_k, z_v, attn.layer_idx)
        positions = cache_positions(cache, attn.layer_idx, positions)
    if cache is not None and attn.layer_idx > 0 and hasattr(cache, "_stiefkv_lengths"):
        lengths = cache._stiefkv_lengths  # one mask per forward: inspected (and synced) once, at layer 0
    else:
        lengths = lengths_from_mask(attention_mask, B, z_k.shape[2])
        if cache is not None:
            cache._stiefkv_lengths = lengths
    P_k_latent = key_basis(z_k.dtype) if key_basis is not None else P_k.to(z_k.dtype)
    out = dispatch_attention(
        backend, q, z_k, z_v, P_k_latent, None if o_fold is not None else P_v.to(z_v.dtype),
        key_mode=key_mode, positions=positions, rope=rope, causal=True, lengths=lengths, scale=attn.scaling,
    )
    out = out.transpose(1, 2).reshape(B, N, -1).to(hidden_states.dtype)
    if o_fold is not None:
        return torch.nn.functional.linear(out, o_fold, attn.o_proj.bias)
    return attn.o_proj(out)


# ------------------------------------------------------------------------------------------ load / unload


def apply_projections(model: nn.Module, proj: Projections, *, backend: str = "auto") -> nn.Module:
    """Swap every decoder layer's attention for :class:`LowRankAttention` (in place)."""
    arch_of(model.config)
    proj.check(model)
    if is_compressed(model):
        unload(model)
    rope = rope_spec(model.config)
    for i, layer in enumerate(decoder_layers(model)):
        layer.self_attn = LowRankAttention(layer.self_attn, proj.keys[i], proj.values[i], key_mode=proj.key_mode,
                                           rope=rope, backend=backend)
    _patch_generate_cache(model)
    model.stiefkv_projections = proj
    return model


def load(model: nn.Module, ckpt: str | Path | Projections, *, backend: str = "auto") -> nn.Module:
    """Serve ``model`` with the low-rank bases of ``ckpt`` (a path or :class:`Projections`), in place.

    After this, every forward and ``generate`` keeps only latents in the KV cache. ``backend`` forces the
    Triton kernels (``"triton"``) or the PyTorch reference (``"reference"``); ``"auto"`` picks Triton on
    CUDA. Raises ``ValueError`` when the checkpoint was made for another model. Undo with :func:`unload`.
    """
    proj = ckpt if isinstance(ckpt, Projections) else Projections.load(ckpt)
    return apply_projections(model, proj, backend=backend)


def is_compressed(model: nn.Module) -> bool:
    return any(isinstance(layer.self_attn, LowRankAttention) for layer in decoder_layers(model))


def unload(model: nn.Module) -> nn.Module:
    """Restore the model's original attention modules and cache."""
    for layer in decoder_layers(model):
        if isinstance(layer.self_attn, LowRankAttention):
            layer.self_attn = layer.self_attn.inner
    model.__dict__.pop("_prepare_cache_for_generation", None)
    model.__dict__.pop("stiefkv_projections", None)
    return model


@contextmanager
def compressed(model: nn.Module, proj: Projections, *, backend: str = "auto"):
    """``with compressed(model, proj): ...`` runs the block with the bases applied, then restores."""
    apply_projections(model, proj, backend=backend)
    try:
        yield model
    finally:
        unload(model)


class Switch:
    """The low-rank attention of every layer built once; ``with switch:`` swaps it in for the block.

    For code that alternates between the original and the compressed model many times (evaluation runs
    every window both ways): :func:`compressed` would check the checkpoint and rebuild the modules each time.
    """

    def __init__(self, model: nn.Module, proj: Projections, *, backend: str = "auto"):
        self.layers = decoder_layers(model)
        with compressed(model, proj, backend=backend):
            self.modules = [layer.self_attn for layer in self.layers]

    def __enter__(self):
        for layer, module in zip(self.layers, self.modules):
            layer.self_attn = module

    def __exit__(self, *exc):
        for layer, module in zip(self.layers, self.modules):
            layer.self_attn = module.inner


def _patch_generate_cache(model: nn.Module) -> None:
    """Make ``generate`` create a :class:`LatentCache` where it would create a ``DynamicCache``.

    transformers has no registry for custom cache classes, so the model's own cache preparation is wrapped
    on this instance (undone by :func:`unload`); a cache passed by the user is left as it is.
    """
    original = type(model)._prepare_cache_for_generation
    DynamicCache = _dynamic_cache_class()

    def prepare(*args, **kwargs):
        result = original(model, *args, **kwargs)
        for obj in list(args) + list(kwargs.values()):
            if isinstance(obj, dict):
                for key in ("cache", "past_key_values"):
                    if type(obj.get(key)) is DynamicCache and obj[key].get_seq_length() == 0:
                        obj[key] = LatentCache()
        return result

    model._prepare_cache_for_generation = prepare

