"""Error–rank profiles: each layer's error with only its keys, or only its values, at each rank.

Cheap by default: PCA bases at every candidate rank (multiples of ``rank_step``), forward passes only.
A profile keeps raw sums — ``‖ŷ − y‖²`` per candidate, ``‖y‖²`` and ``‖y − x‖²`` — so the allocation
can weight a layer's error relative to its output (``output``) or to its own update (``update``). The
``kl`` profile measures instead what the model's prediction loses: the next-token KL of the whole model
when only this layer's keys (or values) are compressed — the layer's error carried through every later
layer to the logits, which a layer's own output error does not see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from stiefkv.calibrate.collect import Context, module_device
from stiefkv.calibrate.distributed import SINGLE, Shard
from stiefkv.kernels import RopeSpec
from stiefkv.layers import LayerBatch, compressed_layer_output, project_qkv, rotate_with, to_latent
from stiefkv.quant import FLOAT, LAYOUTS, QUANT_BITS, QuantSpec, fake_quant

WEIGHTINGS = ("output", "update", "kl")
# the kl profile holds the uncompressed log-probabilities (and probabilities) of this many sequences
KL_SEQUENCES = 4


@dataclass
class LayerProfile:
    """``k[r]``/``v[r]``: summed ``‖ŷ − y‖²`` with only keys/values at rank ``r`` (PCA); norms for
    weighting."""

    ranks: list[int]
    k: list[float] = field(default_factory=list)
    v: list[float] = field(default_factory=list)
    sq_output: float = 0.0
    sq_update: float = 0.0
    metric: str = "sq_error"  # or "kl": k and v are next-token KLs of the whole model
    # storage name → per-rank errors of the latent stored so (same metric as k/v), for "k" and "v"
    quant: dict = field(default_factory=dict)

    def relative(self, which: str, weighting: str = "output") -> list[float]:
        """Squared error relative to ``‖y‖²`` (``output``) or ``‖y − x‖²`` (``update``), or the KL, per
        rank."""
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        if (weighting == "kl") != (self.metric == "kl"):
            raise ValueError(f"a {self.metric} profile cannot be weighted by {weighting!r}")
        if weighting == "kl":
            return list(getattr(self, which))
        den = self.sq_output if weighting == "output" else self.sq_update
        return [e / den for e in getattr(self, which)]

    def options(self, which: str, weighting: str,
                specs: list[QuantSpec]) -> list[tuple[int, QuantSpec, float]]:
        """``(rank, storage, error)`` for every rank and every storage in ``specs`` (bf16 among them or
        not), errors weighted as :meth:`relative` weights them."""
        bf16 = self.relative(which, weighting)
        den = 1.0 if weighting == "kl" else (self.sq_output if weighting == "output" else self.sq_update)
        out = []
        for spec in specs:
            if not spec.quantized:
                out += [(r, spec, e) for r, e in zip(self.ranks, bf16)]
                continue
            errs = self.quant.get(which, {}).get(str(spec))
            if errs is None:
                raise ValueError(f"the profile has no {spec} storage: profile again with these bits")
            out += [(r, spec, e / den) for r, e in zip(self.ranks, errs)]
        return out

    def as_dict(self) -> dict:
        return {"ranks": self.ranks, "k": self.k, "v": self.v, "sq_output": self.sq_output,
                "sq_update": self.sq_update, "metric": self.metric, "quant": self.quant}


MSE_CHOICES = ("none", "values", "all")  # which latents encode on the least-squared-error range
MSE_BITS = 4  # at 8 bits the min–max range is as good (the search gains nothing measurable)


def mse_for(mse: str, which: str) -> bool:
    """Whether latent ``which`` (``k`` or ``v``) is encoded on its least-squared-error range under ``mse``."""
    return mse == "all" or (mse == "values" and which == "v")


def storage_candidates(bits, mse: bool = False, recent: int = 0, log8: bool = False,
                       window8: bool = False) -> list[QuantSpec]:
    """The quantized storages a ``bits`` setting profiles: every bit width and layout for ``auto``, both
    layouts of one width for a number, none for 16; with ``mse``, those of :data:`MSE_BITS` bits and fewer
    encode each group on its least-squared-error range; each keeps its ``recent`` newest tokens exact. With
    ``log8``, each per-token storage not searching its range comes with log8 scales too; with ``window8``
    every storage holds its exact tokens in int8."""
    widths = QUANT_BITS if bits == "auto" else tuple(b for b in (int(bits),) if b < 16)
    specs = [QuantSpec(b, layout, mse=mse and b <= MSE_BITS, recent=recent, window8=window8)
             for b in widths for layout in LAYOUTS]
    return specs + [QuantSpec(s.bits, s.layout, recent=recent, log8=True, window8=window8) for s in specs
                    if log8 and s.layout == "token" and not s.mse]


def spreading_rotation(r: int) -> torch.Tensor:
    """An ``r × r`` orthogonal matrix whose entries are all small (about ``1/√r``): a Walsh–Hadamard matrix
    where ``r`` is a power of two, else the orthonormal DCT-II. Turning a latent basis by it spreads a
    channel that dominates the range (PCA's first) over all channels, which per-token groups need: one
    scale per token then fits every channel."""
    if r & (r - 1) == 0:
        H = torch.ones(1, 1, dtype=torch.float64)
        while H.shape[0] < r:
            H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
        return (H / r ** 0.5).float()
    n = torch.arange(r, dtype=torch.float64)
    C = torch.cos(torch.pi / r * (n[None] + 0.5) * n[:, None]) * (2 / r) ** 0.5
    C[0] /= 2 ** 0.5
    return C.T.contiguous().float()


def storage_basis(P: torch.Tensor, spec: QuantSpec, rotation: bool = True) -> torch.Tensor:
    """The basis a latent stored as ``spec`` uses: ``P`` turned by :func:`spreading_rotation` for per-token
    groups (with ``rotation``), ``P`` itself otherwise (per-channel scales already fit each channel)."""
    if rotation and spec.quantized and spec.layout == "token":
        return P @ spreading_rotation(P.shape[-1]).to(P.device)
    return P


@torch.no_grad()
def layer_latent_input(layer, batch: LayerBatch, which: str, *, key_mode: str) -> torch.Tensor:
    """The layer's keys (as its key mode compresses them) or values on ``batch``: ``[B, G, N, d]`` float32."""
    _, k, v = project_qkv(layer.self_attn, layer.input_layernorm(batch.hidden), keys=which == "k",
                          values=which == "v")
    x = k if which == "k" else v
    if which == "k" and key_mode == "post_rope":
        x = rotate_with(x, *batch.position_embeddings)
    return x.float()


@torch.no_grad()
def latent_noise(x: torch.Tensor | None, P: torch.Tensor, spec: QuantSpec, rotation: bool = True) -> float:
    """``Σ ‖ẑ − z‖²``: the quantization error of the latents ``z`` of ``x`` ``[B, G, N, d]`` through ``P``
    (0 for no ``x``)."""
    if x is None:  # a process of a distributed run that holds none of these sequences
        return 0.0
    z = to_latent(x, storage_basis(P, spec, rotation))  # a shared basis reads the heads side by side
    return float((fake_quant(z, spec) - z).double().pow(2).sum())


NOISE_ELEMENTS = 1 << 25  # latents quantized at once by latent_noises (its temporaries: a few times this)


@torch.no_grad()
def latent_noises(x: torch.Tensor | None, bases: list[torch.Tensor], spec: QuantSpec,
                  rotation: bool = True) -> list[float]:
    """:func:`latent_noise` of every basis in ``bases`` (one per rank), in one quantization: each rank's
    latents are padded to the widest with copies of their last channel (as a short per-token group is padded,
    so every group's range is its own) and stacked, and the padding is left out of the sums. The same
    numbers as one call per rank (but for the order of the summation) in a ``1/len(bases)`` of the calls,
    which on a GPU are bound by their launches. Encoders that search the range (``mse``) see the padding:
    one call per rank for them."""
    if x is None:
        return [0.0] * len(bases)
    if spec.mse:
        return [latent_noise(x, P, spec, rotation) for P in bases]
    width = max(P.shape[-1] for P in bases)
    per_chunk = max(1, NOISE_ELEMENTS // (x[..., :1].numel() * width))  # ranks quantized together
    out = []
    for first in range(0, len(bases), per_chunk):
        latents = [to_latent(x, storage_basis(P, spec, rotation)) for P in bases[first:first + per_chunk]]
        ranks = torch.tensor([z.shape[-1] for z in latents], device=x.device)
        z = torch.stack([torch.cat([z, z[..., -1:].expand(*z.shape[:-1], width - z.shape[-1])], -1)
                         for z in latents])
        real = torch.arange(width, device=x.device) < ranks[:, None]  # [R, width]
        err = (fake_quant(z, spec) - z).pow_(2).mul_(real[:, None, None, None, :])
        out += err.sum((1, 2, 3, 4), dtype=torch.float64).tolist()
    return out


# With profile_storages="anchors" the kl profile measures the model's KL for these widths of each layout only
# (model tails: most of what `auto` adds to a calibration) and predicts the others from their quantization
# noise (:func:`predict_storage_kl`).
ANCHOR_BITS = (2, 4)
PROFILE_STORAGES = ("all", "anchors")


def predict_storage_kl(noise: float, anchors: list[tuple[float, float]]) -> float:
    """The KL of a storage whose latents have quantization noise ``noise``, from ``anchors``, the measured
    ``(noise, KL)`` of two other widths of the same layout: a power law through them between and above the
    noisier one (log KL linear in log noise), and proportional to the noise below the quieter one, where a
    small perturbation's KL is second order in it (KL ∝ ‖ẑ − z‖²)."""
    (n_lo, k_lo), (n_hi, k_hi) = sorted(anchors)
    if noise <= 0 or n_hi <= 0:
        return 0.0
    if k_lo <= 0 or n_lo <= 0:  # the quieter anchor says nothing: proportional to the noisier one
        return k_hi * noise / n_hi
    if noise <= n_lo or k_hi <= k_lo or n_hi <= n_lo:
        return k_lo * noise / n_lo
    slope = math.log(k_hi / k_lo) / math.log(n_hi / n_lo)
    return k_lo * (noise / n_lo) ** slope


def _family(spec: QuantSpec) -> tuple:
    """What storages share but their width: their KLs are predicted from each other's."""
    return spec.layout, spec.mse, spec.recent, spec.window8


@torch.no_grad()
def add_quant_profile(prof: LayerProfile, layer, batch: LayerBatch, bases_k, bases_v,
                      specs: dict[str, list[QuantSpec]],
                      measure, *, key_mode: str, rotation: bool = True,
                      anchor_bits: tuple[int, ...] = (), shard: Shard = SINGLE) -> LayerProfile:
    """Extend ``prof`` to every storage in ``specs[which]`` at every rank, for keys (``k``) and values (``v``)
    (see the module's docstring).

    ``measure(P_k, P_v, quant)`` is the profile's error with those bases and storage. For a ``kl`` profile
    only full rank is measured — with ``anchor_bits`` (two widths), only for those widths of each layout where
    both are candidates, the other widths predicted from their latent noise (:func:`predict_storage_kl`) —
    and lower ranks are predicted from the latent noise on ``batch``, summed over ``shard``'s processes.
    Otherwise every rank of every storage is measured.
    """
    G, d, _ = bases_k(prof.ranks[-1]).shape
    full = torch.eye(d, device=batch.hidden.device).expand(G, d, d)
    for which, basis in (("k", bases_k), ("v", bases_v)):
        table = prof.quant.setdefault(which, {})

        def error_at(r, spec):
            P = storage_basis(basis(r), spec, rotation)
            quant = (spec, FLOAT) if which == "k" else (FLOAT, spec)
            return measure(P, full, quant) if which == "k" else measure(full, P, quant)

        if prof.metric != "kl":
            for spec in specs[which]:
                table[str(spec)] = [error_at(r, spec) for r in prof.ranks]
            continue
        x = layer_latent_input(layer, batch, which, key_mode=key_mode) if batch.hidden.shape[0] else None
        local = torch.tensor([latent_noises(x, [basis(r) for r in prof.ranks], spec, rotation)
                              for spec in specs[which]], dtype=torch.float64)
        noise = dict(zip(specs[which], shard.sum_(local).tolist()))
        # log8 storages are never anchors: their KL comes from the float-scaled per-token anchors'
        anchors = {spec: [s for s in specs[which]
                          if s.bits in anchor_bits and _family(s) == _family(spec) and not s.log8]
                   for spec in specs[which]}
        at_full = {spec: error_at(d, spec) for spec in specs[which]
                   if spec in anchors[spec] or len(anchors[spec]) < 2}
        for spec in specs[which]:
            if spec not in at_full:
                at_full[spec] = predict_storage_kl(noise[spec][-1],
                                                   [(noise[s][-1], at_full[s]) for s in anchors[spec]])
            rank_err, n = getattr(prof, which), noise[spec]
            table[str(spec)] = [e + (at_full[spec] * m / n[-1] if n[-1] > 0 else 0.0)
                                for e, m in zip(rank_err, n)]
            table[str(spec)][-1] = at_full[spec]
    return prof


def candidate_ranks(head_dim: int, rank_step: int) -> list[int]:
    return list(range(rank_step, head_dim + 1, rank_step))


@torch.no_grad()
def profile_layer(layer, batches: list[LayerBatch], bases_k, bases_v, *, key_mode: str, rope: RopeSpec,
                  ranks: list[int]) -> LayerProfile:
    """Profile one layer. ``bases_k(r)``/``bases_v(r)`` give the ``[G, d, r]`` basis at rank ``r``."""
    G, d, _ = bases_k(ranks[0]).shape
    full = torch.eye(d, device=bases_k(ranks[0]).device).expand(G, d, d)
    prof = LayerProfile(ranks=list(ranks), k=[0.0] * len(ranks), v=[0.0] * len(ranks))
    for b in batches:
        y = b.output.double()
        prof.sq_output += float(y.pow(2).sum())
        prof.sq_update += float((y - b.hidden.double()).pow(2).sum())
        for i, r in enumerate(ranks):
            if r == d:
                continue  # full rank reproduces the layer exactly
            for which, P_k, P_v in (("k", bases_k(r), full), ("v", full, bases_v(r))):
                y_hat = compressed_layer_output(layer, b, P_k, P_v, key_mode=key_mode, rope=rope).double()
                getattr(prof, which)[i] += float((y_hat - y).pow(2).sum())
    return prof


class OutputKL:
    """Next-token KL of the model, uncompressed vs one layer replaced, on a few held calibration sequences.

    Runs only the tail of the model — from the replaced layer's held input through the later layers, the
    final norm and the LM head — against log-probabilities of the uncompressed model computed once.
    """

    def __init__(self, model, hidden: torch.Tensor, context: Context, shard: Shard = SINGLE):
        base = getattr(model, "model", model)
        self.layers, self.norm, self.head = base.layers, base.norm, model.lm_head
        self.context, self.shard = context, shard
        # a process of a distributed run may hold none of the held sequences: it adds nothing
        self.base = self.log_probs(0, hidden, None) if hidden.shape[0] else None
        # the uncompressed probabilities, once: every call weighs by them (an exp over the vocabulary each
        # call was ~3 % of a 2-core CPU's first pass). Held beside `base` for the whole first pass: twice the
        # held tokens × vocabulary floats (4 × 512 × 49152 × 4 B = 0.4 GB each for SmolLM2 on CUDA)
        self.probs = self.base.exp() if self.base is not None else None

    @torch.no_grad()
    def log_probs(self, start: int, hidden: torch.Tensor, replace) -> torch.Tensor:
        h = hidden
        for j in range(start, len(self.layers)):
            device = module_device(self.layers[j])
            pe, mask, ids = self.context.on(device)
            h = h.to(device)
            if j == start and replace is not None:
                h = replace(LayerBatch(j, h, h, pe, mask, ids))
            else:
                out = self.layers[j](h, attention_mask=mask, position_ids=ids, position_embeddings=pe)
                h = out[0] if isinstance(out, tuple) else out
        h = self.norm(h.to(module_device(self.norm)))
        logits = self.head(h.to(module_device(self.head))).float()
        # on the CPU in place (the same values, half the time: no second vocabulary-wide tensor); on CUDA
        # into a new tensor, as before: log_softmax over its own input was checked on the CPU only (the
        # element-wise KL below runs in place on both)
        return torch.log_softmax(logits, dim=-1, out=logits if logits.device.type == "cpu" else None)

    def __call__(self, start: int, hidden: torch.Tensor, replace) -> float:
        """The mean next-token KL over the held tokens of every process."""
        total = count = 0.0
        if self.base is not None:
            logp = self.log_probs(start, hidden, replace)
            kl = torch.sub(self.base, logp, out=logp).mul_(self.probs).sum(-1)  # in place: no new V floats
            total, count = float(kl.double().sum()), kl.numel()
        total, count = self.shard.sum(total, count)
        return total / count


@torch.no_grad()
def profile_layer_kl(layer, output_kl: OutputKL, layer_idx: int, hidden: torch.Tensor, bases_k, bases_v, *,
                     key_mode: str, rope: RopeSpec, ranks: list[int]) -> LayerProfile:
    """The ``kl`` profile of one layer from its held input ``hidden`` (the sequences ``output_kl`` uses)."""
    G, d, _ = bases_k(ranks[0]).shape
    full = torch.eye(d, device=hidden.device).expand(G, d, d)
    prof = LayerProfile(ranks=list(ranks), k=[0.0] * len(ranks), v=[0.0] * len(ranks), metric="kl")
    for i, r in enumerate(ranks):
        if r == d:
            continue
        for which, P_k, P_v in (("k", bases_k(r), full), ("v", full, bases_v(r))):
            replace = lambda b, P_k=P_k, P_v=P_v: compressed_layer_output(  # noqa: E731
                layer, b, P_k, P_v, key_mode=key_mode, rope=rope)
            getattr(prof, which)[i] = max(0.0, output_kl(layer_idx, hidden, replace))
    return prof
