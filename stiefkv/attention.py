"""Serving with low-rank keys and values: ``LowRankAttention`` and ``load``.

``load(model, ckpt)`` swaps each decoder layer's attention for a :class:`LowRankAttention` that computes
q as the model does, projects the layer input straight to the latents ``z_k = P_kᵀ k`` and ``z_v = P_vᵀ v``
(the bases folded into ``k_proj``/``v_proj``), stores only those in a :class:`~stiefkv.cache.LatentCache`,
and attends through :func:`stiefkv.kernels.lowrank_attention` (Triton on CUDA, the PyTorch reference
elsewhere). The differentiable path that calibration and evaluation use is :mod:`stiefkv.layers`.

The model's state dict keeps its original names (the swapped module holds the original's submodules
under their own names; the bases are non-persistent buffers), so ``save_pretrained`` writes the original
weights, plus the bases beside them in ``stiefkv_projections.safetensors``.
"""

from __future__ import annotations

import logging
import os
import types
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from stiefkv import kernels
from stiefkv.cache import (
    LatentCache,
    as_latent_cache,
    basis_tag,
    cache_keyword,
    check_bases,
    forget_checked_mask,
    lengths_from_mask,
    refuse_no_tokens,
)
from stiefkv.kernels import CodesAndBand, QuantizedLatents, RopeSpec
from stiefkv.layers import exact_band, head_bases, head_latents, project_qkv, rotate_with, to_latent
from stiefkv.models import arch_of, decoder_layers, rope_spec
from stiefkv.projections import PROJECTIONS_FILE, Projections
from stiefkv.quant import FLOAT, QuantSpec, fake_quant, held_exact
from stiefkv.static_cache import CacheOverflowError, RingSplit, StaticLatentCache, transformers_static_length

log = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "reference")

__all__ = ["LatentCache", "LowRankAttention", "cache_keyword", "compressed", "is_compressed", "load",
           "unload"]


class LowRankAttention(nn.Module):
    """Drop-in for a Llama-style attention module whose cache holds low-rank latents.

    The original module's submodules (``q_proj`` … ``o_proj``, any ``q_norm``/``k_norm``) are registered
    here under their own names, shared, not copied: the model's state dict is unchanged by the swap. The
    original module itself is kept outside the module tree, for :func:`unload`.

    Parameters
    ----------
    attn : the model's attention module.
    P_k : ``[G, d, r_k]`` and P_v : ``[G, d, r_v]`` orthonormal bases (float32).
    key_mode : ``"pre_rope"`` or ``"post_rope"``.
    rope : the model's :class:`RopeSpec`.
    backend : ``"auto"`` (Triton on CUDA), ``"triton"`` or ``"reference"``.
    quant : ``(key, value)`` :class:`~stiefkv.quant.QuantSpec`: how the cache stores the latents. Attention
        always reads what the cache would hold — quantized latents dequantized, even without a cache, each
        query with the keys exact that decoding it would have found exact — so a forward scores what
        token-by-token decoding computes.
    """

    def __init__(self, attn: nn.Module, P_k: torch.Tensor, P_v: torch.Tensor, *, key_mode: str,
                 rope: RopeSpec, backend: str = "auto", quant: tuple[QuantSpec, QuantSpec] = (FLOAT, FLOAT)):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        for name, child in attn.named_children():
            self.add_module(name, child)
        for name, param in attn.named_parameters(recurse=False):
            self.register_parameter(name, param)
        object.__setattr__(self, "original", attn)  # not a submodule: its weights are already ours
        self.train(attn.training)  # a new module is in training mode; the model's may not be
        self.layer_idx, self.head_dim, self.scaling = attn.layer_idx, attn.head_dim, attn.scaling
        self.key_mode = key_mode
        self.backend = backend
        self.quant = tuple(quant)
        device = attn.q_proj.weight.device
        # a basis [1, G·d, r] shared by the KV heads: one latent a token, read by every head
        self.kv_heads = attn.k_proj.weight.shape[0] // attn.head_dim
        self.shared = P_k.shape[0] != self.kv_heads or P_v.shape[0] != self.kv_heads
        self.register_buffer("P_k", _ordinary(P_k.detach().to(device, torch.float32)), persistent=False)
        self.register_buffer("P_v", _ordinary(P_v.detach().to(device, torch.float32)), persistent=False)
        self.rope = RopeSpec(_ordinary(rope.inv_freq.to(device)), rope.attention_scaling)
        # P_v folded into o_proj (exact): attention returns its output in r_v dimensions and one matmul of
        # [D, H·r_v] replaces P_v's epilogue plus o_proj; measured faster on the H200 (BENCHMARKS.md §2, P_v).
        for name in ("o_fold", "zk_weight", "zk_bias", "zv_weight", "zv_bias"):
            self.register_buffer(name, None, persistent=False)
        self._folded: tuple | None = None
        # float32 bases for folding, outside the module's buffers so that a cast of the module keeps them
        with torch.inference_mode(False):
            self._masters = (self.P_k.detach().clone(), self.P_v.detach().clone())
        self.refold()
        self.basis_tag = basis_tag(P_k, P_v, key_mode, self.quant)  # checked against each cache it writes
        self._cast_key: tuple | None = None  # (P_k's storage, version, device, dtype) of the cached cast
        self._cast_P_k: torch.Tensor | None = None

    def _fold_sources(self) -> tuple:
        """The weights the folds are made of, each as (tensor, version): a write into any of them
        (``load_state_dict``, an optimizer's step, an in-place edit) changes its version; a move or a cast
        of the module does not (a parameter keeps its object). Inference tensors have no version (they
        cannot be written outside inference mode): 0."""
        attn = self.original  # the parameters read from the dicts, not module attributes: every forward
        params = [m._parameters.get(name) for m in (attn.o_proj, attn.k_proj, attn.v_proj)
                  for name in ("weight", "bias")]
        return tuple((t, 0 if t.is_inference() else t._version) for t in params if t is not None)

    def refold(self) -> None:
        """Fold the bases into ``k_proj``/``v_proj`` and ``P_v`` into ``o_proj`` again if those weights were
        written since the last fold, so that a served model never computes with weights it no longer has.
        The bases are folded from their float32 copies taken at load (a cast of the module rounds the
        buffers); to change the bases, ``stiefkv.load`` others. The folds are buffers, not functions of the
        weights: gradients do not reach ``k_proj``, ``v_proj`` or ``o_proj`` through a served model (train
        the unserved one). Not under ``torch.compile``, whose graphs would break on the versions."""
        if torch.compiler.is_compiling():
            return
        sources = self._fold_sources()
        if self._folded is not None and len(sources) == len(self._folded) and all(
                t is u and v == w for (t, v), (u, w) in zip(sources, self._folded)):
            return
        attn = self.original
        device = attn.o_proj.weight.device
        P_k, P_v = (P.to(device) for P in self._masters)
        # buffers: no graph to keep (and to deepcopy), and ordinary tensors even under inference_mode
        with torch.inference_mode(False), torch.no_grad():
            o_fold = fold_values_into_o_proj(attn.o_proj.weight, head_bases(P_v, self.kv_heads))
            fold = fold_bases_into_kv_proj(attn, P_k, P_v, self.key_mode)
        self.o_fold = o_fold
        for name, tensor in zip(("zk_weight", "zk_bias", "zv_weight", "zv_bias"), fold):
            setattr(self, name, tensor)
        self._folded = sources

    def key_basis(self, dtype: torch.dtype) -> torch.Tensor:
        """``P_k`` in the latents' dtype, as the kernels take it: cast once, not on every call (again after
        the module moves or ``P_k`` is written in place)."""
        version = 0 if self.P_k.is_inference() else self.P_k._version
        key = (self.P_k.data_ptr(), version, self.P_k.device, dtype)
        if key != self._cast_key:
            P = head_bases(self.P_k, self.kv_heads)  # a shared basis: head g's block of rows
            with torch.inference_mode(False):
                self._cast_P_k, self._cast_key = P.to(dtype, copy=True), key
        return self._cast_P_k

    def latents(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries ``[B, H, N, d]`` (rotated), ``z_k`` ``[B, G, N, r_k]`` and ``z_v`` ``[B, G, N, r_v]``
        (``[B, 1, N, r]`` for a shared basis)."""
        fold_keys = self.zk_weight is not None
        q, k, _ = project_qkv(self, hidden_states, keys=not fold_keys, values=False)
        rotated = not fold_keys and self.key_mode == "post_rope"  # keys rotated, then projected
        z_k = None
        if kernels.kernel_runs(self.backend, hidden_states, self.P_k):
            # one launch for what rotate_with and to_latent take ~13 small kernels a layer to do
            fused = rotated and self.P_k.shape[0] == self.kv_heads  # the kernel takes per-head bases
            q, z_k = kernels.rope_latent(q.transpose(1, 2), k.transpose(1, 2) if fused else None, cos, sin,
                                         self.P_k if fused else None, backend=self.backend)
        else:
            q = rotate_with(q, cos, sin)
        if fold_keys:
            z_k = _folded_latent(hidden_states, self.zk_weight, self.zk_bias, self.P_k.shape[0])
        elif z_k is None:
            z_k = to_latent(rotate_with(k, cos, sin) if rotated else k, self.P_k)
        return q, z_k, _folded_latent(hidden_states, self.zv_weight, self.zv_bias, self.P_v.shape[0])

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, position_ids=None, **kwargs):
        cache = as_latent_cache(cache if cache is not None else past_key_values)
        refuse_no_tokens(hidden_states, cache)
        self.refold()
        _say_once_what_is_not_served(self.training and torch.is_grad_enabled(),
                                     bool(kwargs.get("output_attentions")))
        B, N, _ = hidden_states.shape
        if position_ids is None:
            past = cache.get_seq_length(self.layer_idx) if cache is not None else 0
            position_ids = torch.arange(past, past + N, device=hidden_states.device)[None]
        positions = position_ids.expand(B, N)
        q, z_k, z_v = self.latents(hidden_states, *position_embeddings)
        fresh, tails = (z_k, z_v), None
        if cache is not None:
            check_bases(cache, self.layer_idx, self.basis_tag)
            z_k, z_v, positions, lengths = cache.update_layer(z_k, z_v, self.layer_idx, positions,
                                                              attention_mask, quant=self.quant)
            if isinstance(z_k, RingSplit):  # a static cache's codes beside its exact window
                out = self._attend_split(q, z_k, positions)
                out = out.transpose(1, 2).reshape(B, N, -1).to(hidden_states.dtype)
                return torch.nn.functional.linear(out, self.o_fold, self.o_proj.bias), None
            tails = cache.exact_tails(self.layer_idx)
        else:
            z_k, z_v = fake_quant(z_k, self.quant[0]), fake_quant(z_v, self.quant[1])
            lengths = lengths_from_mask(attention_mask, B, z_k.shape[2])
        n_valid = cache.valid_count(q.device) if cache is not None else None  # a static cache's slots
        exact = None  # a static cache quantizes every token as it is written: no query reads an exact band
        if n_valid is None:
            if tails is None and N > 1:  # the exact latents as a cache would hold them (int8 for window8)
                tails = tuple((held_exact(z, spec), 0) for z, spec in zip(fresh, self.quant))
            exact = exact_band(self.quant, N, (z_k, z_v), tails)
        bias = cache.bias(self.layer_idx) if cache is not None else None  # β of a compacted prefix
        if self.shared:  # one latent a token: every head reads it (views, no copies)
            z_k, z_v = heads_view(z_k, self.kv_heads), heads_view(z_v, self.kv_heads)
            if positions.dim() == 3:  # a compacted prefix: one entry's position and β for all heads
                positions = positions.expand(-1, self.kv_heads, -1)
                bias = bias.expand(-1, self.kv_heads, -1) if bias is not None else None
            if exact is not None:
                exact = exact._replace(z_k=head_latents(exact.z_k, self.kv_heads),
                                       z_v=head_latents(exact.z_v, self.kv_heads))
        dtype = getattr(z_k, "dtype", q.dtype)  # codes of a static cache dequantize to the queries' dtype
        out = kernels.lowrank_attention(q, z_k, z_v, self.key_basis(dtype), None, key_mode=self.key_mode,
                                        positions=positions, rope=self.rope, causal=True, lengths=lengths,
                                        bias=bias, n_valid=n_valid,
                                        scale=self.scaling, exact=exact, backend=self.backend)
        out = out.transpose(1, 2).reshape(B, N, -1).to(hidden_states.dtype)
        return torch.nn.functional.linear(out, self.o_fold, self.o_proj.bias), None

    def _attend_split(self, q: torch.Tensor, split: RingSplit, positions: torch.Tensor) -> torch.Tensor:
        """Decode attention over codes read in place, then over the exact ring beside them continuing the
        same softmax (``prior=``: the kernel starts from the first call's output and log-sum-exp, so no
        merge kernels run between the two)."""
        common = dict(key_mode=self.key_mode, rope=self.rope, scale=self.scaling, backend=self.backend)
        if self.shared:  # one latent a token, its codes and its ring read by every head (views)
            G = self.kv_heads

            def heads(t):  # a compacted prompt's per-head positions and β: one entry's for every head
                return t.expand(-1, G, -1) if isinstance(t, torch.Tensor) and t.dim() == 3 else t

            split = split._replace(codes_k=heads_view(split.codes_k, G), codes_v=heads_view(split.codes_v, G),
                                   ring_k=heads_view(split.ring_k, G), ring_v=heads_view(split.ring_v, G),
                                   ring_bias=heads(split.ring_bias),
                                   ring_positions=heads(split.ring_positions),
                                   codes_positions=heads(split.codes_positions),
                                   codes_bias=heads(split.codes_bias))
        codes_positions = positions if split.codes_positions is None else split.codes_positions
        o1, l1 = kernels.lowrank_attention(q, split.codes_k, split.codes_v, self.key_basis(q.dtype), None,
                                           positions=codes_positions, bias=split.codes_bias,
                                           lengths=split.codes_lengths, n_valid=split.n_codes, causal=True,
                                           return_lse=True, **common)
        return kernels.lowrank_attention(q, split.ring_k, split.ring_v, self.key_basis(split.ring_k.dtype),
                                         None, positions=split.ring_positions, bias=split.ring_bias,
                                         causal=False, prior=(o1, l1), **common)


def heads_view(z, G: int):
    """Latents of a basis shared by ``G`` KV heads (``[B, 1, N, r]``) as every head's, without copies:
    floats, :class:`~stiefkv.kernels.QuantizedLatents` (codes and scales of a static cache, read in place by
    the kernels) or :class:`~stiefkv.kernels.CodesAndBand`."""
    if isinstance(z, torch.Tensor):
        return head_latents(z, G)
    if isinstance(z, QuantizedLatents):
        return z._replace(codes=head_latents(z.codes, G), scale=head_latents(z.scale, G),
                          low=None if z.low is None else head_latents(z.low, G))
    if isinstance(z, CodesAndBand):
        return CodesAndBand(heads_view(z.below, G), head_latents(z.band, G))
    raise TypeError(f"latents of type {type(z).__name__} have no per-head view")


class FoldedKV(NamedTuple):
    """``k_proj`` and ``v_proj`` with the bases folded in: ``z = (blockdiag(Pᵀ) W) x + blockdiag(Pᵀ) b``,
    one linear ``[G·r, D]`` per latent in the model's dtype. ``key_weight`` is None where the keys cannot be
    folded (``post_rope`` rotates them before projecting, and a key norm sits between ``k_proj`` and the
    basis)."""

    key_weight: torch.Tensor | None
    key_bias: torch.Tensor | None
    value_weight: torch.Tensor
    value_bias: torch.Tensor | None


def fold_basis_into_linear(linear: nn.Linear, P: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``blockdiag(P_gᵀ) · W`` ``[G·r, D]`` and ``blockdiag(P_gᵀ) · b`` for a ``linear`` of weight
    ``[G·d, D]`` and ``P`` ``[G, d, r]``; computed in float32, returned in the linear's dtype."""
    G, d, r = P.shape
    W = linear.weight.float().view(G, d, -1)
    weight = torch.einsum("gdr,gdD->grD", P.float(), W).reshape(G * r, -1).to(linear.weight.dtype)
    bias = None
    if linear.bias is not None:
        bias = torch.einsum("gdr,gd->gr", P.float(), linear.bias.float().view(G, d)).reshape(-1)
        bias = bias.to(linear.bias.dtype)
    return weight, bias


def fold_bases_into_kv_proj(attn: nn.Module, P_k: torch.Tensor, P_v: torch.Tensor, key_mode: str) -> FoldedKV:
    """Serving needs the keys and values only as latents, so their bases fold into ``k_proj`` and
    ``v_proj``: one linear per latent instead of a projection to ``d`` per head, a cast to float32, a matmul
    with the basis and a cast back (exact in exact arithmetic; in the model's dtype it rounds once instead
    of twice)."""
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


# ------------------------------------------------------------------------------------------ load / unload


# Keyed weakly by the model: nothing of ours is stored on it but the forward pre-hook and the instance methods
# apply_projections installs (which carry the projections too, so that a deep copy of the model finds them).
_SERVED: weakref.WeakKeyDictionary[nn.Module, Projections] = weakref.WeakKeyDictionary()


def apply_projections(model: nn.Module, proj: Projections, *, backend: str = "auto") -> nn.Module:
    """Swap every decoder layer's attention for :class:`LowRankAttention` (in place)."""
    arch_of(model.config)
    proj.check(model)
    if backend not in BACKENDS:  # before anything changes: a refused load leaves a served model as it was
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    rope = rope_spec(model.config)
    layers = decoder_layers(model)
    before = projections_of(model) if is_compressed(model) else None
    before_backend = _served_backend(model) if before is not None else None
    modes = [layer.self_attn.training for layer in layers]
    if before is not None:  # the old folds go before the new are made: one set of them at a time
        unload(model)
    try:
        for i, layer in enumerate(layers):
            attn = LowRankAttention(layer.self_attn, proj.keys[i], proj.values[i], key_mode=proj.key_modes[i],
                                    rope=rope, backend=backend, quant=proj.specs[i])
            layer.self_attn = attn.train(modes[i])
    except BaseException:
        unload(model)
        if before is not None:
            apply_projections(model, before, backend=before_backend)
        raise
    if any(t.is_inference() for layer in layers for t, _ in layer.self_attn._fold_sources()):
        log.warning("the model's k_proj, v_proj or o_proj weights are inference tensors (made inside "
                    "torch.inference_mode()): StiefKV cannot see writes to them, so after changing them "
                    "call stiefkv.load again, or the served model keeps computing with the old ones")
    # config.json names the bases while the model is served: a folder saved after unload does not, so
    # load_model does not serve bases a folder kept from before (save_pretrained leaves other files there)
    model.config.stiefkv_projections = PROJECTIONS_FILE
    getattr(model, "model", model).register_forward_pre_hook(_latent_cache_hook, with_kwargs=True)
    wrappers = (("_prepare_cache_for_generation", _wrap_prepare_cache), ("save_pretrained", _wrap_save))
    methods = {name: wrap(getattr(type(model), name)) for name, wrap in wrappers
               if hasattr(type(model), name)}
    methods.update(_pickle_guards())
    for name, method in methods.items():
        # bound methods, not closures over this instance: a deep copy of the model rebinds them to itself
        method._stiefkv_projections = proj
        setattr(model, name, types.MethodType(method, model))
    _SERVED[model] = proj
    return model


_SAID: set = set()


def _say_once_what_is_not_served(training: bool, attentions: bool) -> None:
    """Warn once a process of what a served model does not do: train its k/v/o projections (the folds are
    buffers) or drop attention weights, and return attention weights."""
    import warnings

    for asked, key, text in (
            (training, "train", "a served model computes with k_proj, v_proj and o_proj folded into "
                                "buffers: they get no gradient through it, and attention dropout is not "
                                "applied; train the unserved model (stiefkv.unload), then load again"),
            (attentions, "weights", "a served model's latent attention returns no attention weights "
                                    "(output_attentions gives None for its layers)")):
        if asked and key not in _SAID:
            _SAID.add(key)
            warnings.warn(text, UserWarning, stacklevel=3)


def _pickle_guards() -> dict:
    """``__reduce_ex__`` and ``__deepcopy__`` for a served model's instance. Pickling refuses with the way
    out: the instance methods ``load`` installs pickle by their function's name, and unpickled as
    transformers' own methods or not at all (``torch.load`` failed with "no attribute 'prepare'"). A deep
    copy goes on as before: the guards step aside for it and are bound to the copy."""
    def __reduce_ex__(model, protocol):
        raise TypeError("a model served by stiefkv.load does not pickle (torch.save(model)): save it with "
                        "model.save_pretrained(folder) and read it back with stiefkv.load_model(folder), "
                        "save its state_dict, or stiefkv.unload(model) first")

    def __deepcopy__(model, memo):
        import copy

        guards = {name: model.__dict__.pop(name) for name in ("__reduce_ex__", "__deepcopy__")}
        try:
            new = copy.deepcopy(model, memo)
        finally:
            model.__dict__.update(guards)
        for name, method in guards.items():
            new.__dict__[name] = types.MethodType(method.__func__, new)
        return new

    return {"__reduce_ex__": __reduce_ex__, "__deepcopy__": __deepcopy__}


def _ordinary(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it that is an ordinary tensor where it is an inference tensor (made inside
    ``torch.inference_mode()``): those have no version counter and cannot be saved for backward, so a model
    served from inside inference mode failed in every forward (``key_basis`` reads the version) and in any
    backward afterwards."""
    if not t.is_inference():
        return t
    with torch.inference_mode(False):
        return t.clone()


def load(model: nn.Module, ckpt: str | Path | Projections, *, backend: str = "auto") -> nn.Module:
    """Serve ``model`` with the low-rank bases of ``ckpt`` (a path or :class:`Projections`), in place.

    After this, every forward and ``generate`` keeps only latents in the KV cache, and ``save_pretrained``
    writes the original weights plus the bases (``stiefkv.load_model(folder)`` gives back this model,
    ``from_pretrained(folder)`` the original). ``backend`` forces the Triton kernels (``"triton"``) or the
    PyTorch reference (``"reference"``); ``"auto"`` picks Triton on CUDA. Raises
    :class:`~stiefkv.CheckpointError` when the checkpoint was made for another model. Undo with
    :func:`unload`.
    """
    if not isinstance(ckpt, (str, os.PathLike, Projections)):
        raise TypeError(f"stiefkv.load takes a checkpoint path or Projections, got {type(ckpt).__name__}: "
                        "pass the file `stiefkv calibrate -o` wrote")
    proj = ckpt if isinstance(ckpt, Projections) else Projections.load(ckpt)
    return apply_projections(model, proj, backend=backend)


def is_compressed(model: nn.Module) -> bool:
    return any(isinstance(layer.self_attn, LowRankAttention) for layer in decoder_layers(model))


def projections_of(model: nn.Module) -> Projections | None:
    """The projections a model is served with, or None (a deep copy of a served model answers too)."""
    proj = _SERVED.get(model)
    if proj is not None:
        return proj
    return next((m.__func__._stiefkv_projections for m in _our_methods(model).values()), None)


def _our_methods(model: nn.Module) -> dict:
    """The instance methods :func:`apply_projections` installed on ``model`` (or on the model it was copied
    from), by name."""
    return {name: m for name, m in vars(model).items()
            if isinstance(m, types.MethodType) and hasattr(m.__func__, "_stiefkv_projections")}


def unload(model: nn.Module) -> nn.Module:
    """Restore the model's original attention modules, cache and methods (also of a deep copy of a served
    model, whose hook and methods :func:`load` never registered)."""
    for layer in decoder_layers(model):
        if isinstance(layer.self_attn, LowRankAttention):
            # the original sits outside the module tree while served: train()/eval() did not reach it
            layer.self_attn = layer.self_attn.original.train(layer.self_attn.training)
    _SERVED.pop(model, None)
    if hasattr(model.config, "stiefkv_projections"):
        del model.config.stiefkv_projections
    for name in _our_methods(model):
        del model.__dict__[name]
    base = getattr(model, "model", model)
    for key, hook in list(base._forward_pre_hooks.items()):
        if hook is _latent_cache_hook:
            del base._forward_pre_hooks[key]
            base._forward_pre_hooks_with_kwargs.pop(key, None)
    return model


def _served_backend(model: nn.Module) -> str:
    return next(layer.self_attn.backend for layer in decoder_layers(model)
                if isinstance(layer.self_attn, LowRankAttention))


@contextmanager
def compressed(model: nn.Module, proj: Projections, *, backend: str = "auto"):
    """``with compressed(model, proj): ...`` runs the block with the bases applied, then restores the model
    as it was (served with its own checkpoint again, if it was)."""
    before = projections_of(model)
    before_backend = _served_backend(model) if before is not None and is_compressed(model) else None
    try:
        apply_projections(model, proj, backend=backend)
        yield model
    finally:
        unload(model)
        if before is not None:
            apply_projections(model, before, backend=before_backend or "auto")


class Switch:
    """The low-rank attention of every layer built once; ``with switch:`` swaps it in for the block.

    For code that alternates between the original and the compressed model many times (evaluation runs
    every window both ways): :func:`compressed` would check the checkpoint and rebuild the modules each time.
    Inside the block a forward that makes its own cache makes a :class:`LatentCache`, as after :func:`load`.
    """

    def __init__(self, model: nn.Module, proj: Projections, *, backend: str = "auto"):
        self.base = getattr(model, "model", model)
        self.layers = decoder_layers(model)
        self.hook = None
        with compressed(model, proj, backend=backend):
            self.modules = [layer.self_attn for layer in self.layers]

    def __enter__(self):
        self.before = [layer.self_attn for layer in self.layers]  # a served model's own, if it is served
        for layer, module in zip(self.layers, self.modules):
            layer.self_attn = module
        self.hook = self.base.register_forward_pre_hook(_latent_cache_hook, with_kwargs=True)

    def __exit__(self, *exc):
        self.hook.remove()
        for layer, module in zip(self.layers, self.before):
            layer.self_attn = module


def _latent_cache_hook(module: nn.Module, args, kwargs):
    """Forward pre-hook on the decoder stack: where it would make a ``DynamicCache`` for itself
    (``use_cache`` on and no cache given), give it a :class:`LatentCache`; refuse any other cache."""
    forget_checked_mask()  # each forward checks its own mask once (its layers share it)
    names = [n for n in ("cache", "past_key_values") if kwargs.get(n) is not None]
    if names:
        as_latent_cache(kwargs[names[0]])
        return None
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(module.config, "use_cache", False)
        if getattr(module, "gradient_checkpointing", False) and module.training and torch.is_grad_enabled():
            use_cache = False
    if not use_cache:
        return None
    kwargs.pop("past_key_values" if cache_keyword(module) == "cache" else "cache", None)
    kwargs[cache_keyword(module)] = LatentCache()
    return args, kwargs


def _wrap_prepare_cache(original):
    """``generate`` makes its ``DynamicCache`` (or, with ``cache_implementation="static"``, its
    ``StaticCache``) in ``_prepare_cache_for_generation``; transformers has no registry for cache classes, so
    this instance's method is wrapped (undone by :func:`unload`) to put a :class:`LatentCache` (a
    :class:`~stiefkv.static_cache.StaticLatentCache` of the same batch and length) in its place. A cache
    passed by the user is left as it is (and checked by the forward). ``tests/test_cache.py`` fails if
    transformers stops calling the method this way."""
    from transformers import DynamicCache, StaticCache

    def prepare(model, *args, **kwargs):
        kwarg_dicts = [obj for obj in list(args) + list(kwargs.values()) if isinstance(obj, dict)]
        # the user's own cache is in the model kwargs before transformers makes one: leave it to the forward
        given = {id(obj.get(key)) for obj in kwarg_dicts for key in ("cache", "past_key_values")}
        for obj in kwarg_dicts:
            for key in ("cache", "past_key_values"):
                if isinstance(obj.get(key), StaticLatentCache):
                    _check_static_room(obj[key], original, model, args, kwargs)
        result = original(model, *args, **kwargs)
        for obj in kwarg_dicts:
            for key in ("cache", "past_key_values"):
                made = obj.get(key)
                if id(made) in given:
                    continue
                if type(made) in (DynamicCache, StaticCache) and getattr(made, "offloading", False):
                    raise ValueError(
                        "cache_implementation='offloaded' (or 'offloaded_static') is not supported on a "
                        "model served by stiefkv.load: its latent cache stays on the model's device (it "
                        "holds the latents, a fraction of the full cache's bytes). Drop "
                        "cache_implementation, or ask for 'static'")
                if type(made) is DynamicCache and made.get_seq_length() == 0:
                    obj[key] = LatentCache()
                elif type(made) is StaticCache and not getattr(made, "_is_user_defined", False):
                    batch = _static_batch(original, model, args, kwargs)
                    obj[key] = StaticLatentCache(model, batch, transformers_static_length(made))
        return result

    return prepare


def _check_static_room(cache: StaticLatentCache, original, model, args, kwargs) -> None:
    """Before generate starts: a clear error when the user's static cache cannot hold what generate will
    write (``max_cache_length``, the prompt plus the new tokens but the last), rather than after the tokens
    that fit were computed. Skipped where transformers' signature does not name it."""
    needed = _prepare_arguments(original, model, args, kwargs).get("max_cache_length")
    if isinstance(needed, int) and needed > cache.max_length:  # the ids given include what the cache holds
        raise CacheOverflowError(
            f"the static cache passed to generate holds {cache.max_length} tokens per row; this generate "
            f"needs {needed} (the ids and max_new_tokens, but the last new token). Allocate it with a larger "
            "max_length (StiefKV's StaticLatentCache(model, batch, max_length)) or ask for fewer new tokens "
            "(max_new_tokens)")


def _prepare_arguments(original, model, args, kwargs) -> dict:
    """``_prepare_cache_for_generation``'s arguments by name, as this transformers version calls it."""
    import inspect

    return inspect.signature(original).bind_partial(model, *args, **kwargs).arguments


def _static_batch(original, model, args, kwargs) -> int:
    """The batch transformers sized its ``StaticCache`` for: ``_prepare_cache_for_generation``'s
    ``batch_size`` times the beams or returned sequences (the cache itself does not know it before its first
    tensor; transformers 5.17's ``max_batch_size`` then answers -1)."""
    bound = _prepare_arguments(original, model, args, kwargs)
    config, batch = bound.get("generation_config"), bound.get("batch_size")
    if batch is None:
        raise ValueError("could not read the batch transformers sized its StaticCache for; pass "
                         "cache=stiefkv.StaticLatentCache(model, batch_size, max_length) to generate instead")
    copies = max(getattr(config, "num_beams", 1) or 1, getattr(config, "num_return_sequences", 1) or 1)
    return int(batch) * copies


def _wrap_save(original):
    """``save_pretrained`` writes the original weights (the state dict is unchanged by :func:`load`); the
    wrapper adds the bases beside them, so that the folder reloads compressed with ``stiefkv.load_model``."""

    def save_pretrained(model, save_directory, *args, **kwargs):
        proj = projections_of(model)
        if proj is not None:
            if kwargs.get("push_to_hub"):  # transformers uploads inside the call, before the bases exist
                raise ValueError("save_pretrained(..., push_to_hub=True) on a model served by stiefkv.load "
                                 "would upload the folder without its bases: save_pretrained(folder) first "
                                 "and upload that folder (stiefkv.load_model serves the bases of a local "
                                 "folder or of a hub id whose config.json names them)")
            folder = Path(save_directory).expanduser()
            if folder.exists() and not folder.is_dir():
                raise ValueError(f"{save_directory} is a file: save_pretrained writes a model folder; name a "
                                 "folder (new or existing)")
        if proj is not None:  # one folder for the weights and the bases (transformers leaves ~ as it is)
            save_directory = os.path.expanduser(save_directory)
            # bases save would refuse are refused before the weights and a config.json naming them exist
            proj.header_text(Path(save_directory) / PROJECTIONS_FILE)
        result = original(model, save_directory, *args, **kwargs)
        if proj is not None:
            proj.save(Path(save_directory) / PROJECTIONS_FILE)
        return result

    return save_pretrained
