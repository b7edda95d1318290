"""Riemannian refinement of a layer's key and value bases on the Stiefel manifold.

``P_k`` ``[G, d, r_k]`` and ``P_v`` ``[G, d, r_v]`` are ``geoopt.ManifoldParameter``s on
``geoopt.EuclideanStiefel`` (QR retraction; the canonical ``Stiefel()`` would build ``d×d`` Cayley
systems), optimised jointly by ``geoopt.optim.RiemannianAdam`` from their PCA start to minimise the
relative squared error of the decoder-layer output (:mod:`stiefkv.calibrate.objective`). Minibatches are
drawn from the calibration sequences, a held-out slice decides early stopping (on the output error), and
the best held-out bases are returned — never worse on the held-out slice than the start. With
``kl_weight > 0`` the loss adds the KL divergence between the original and the compressed attention rows
(``--loss output+kl``), streamed by StreamKL on CUDA.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from stiefkv.calibrate.collect import LayerBatch
from stiefkv.calibrate.distributed import SINGLE, Shard
from stiefkv.calibrate.objective import compressed_layer_output, layer_attention_kl
from stiefkv.kernels import RopeSpec
from stiefkv.layers import NO_QUANT


def geoopt_module():
    """geoopt, imported where a basis is optimised on the manifold, not when the pipeline is: reading
    checkpoints, evaluating and serving do not need it."""
    try:
        import geoopt
    except ImportError as exc:
        raise ImportError("Riemannian refinement needs geoopt: pip install geoopt (or calibrate with "
                          "--method pca)") from exc
    return geoopt


@dataclass
class RefineSettings:
    """How one layer is refined; the pipeline fills it from :class:`CalibrationConfig` (the defaults live
    there)."""

    steps: int
    lr: float
    batch_size: int = 4
    holdout_fraction: float = 0.125
    eval_every: int = 25
    patience: int = 4
    kl_weight: float = 0.0  # > 0 adds kl_weight · attention KL (StreamKL) to the output error
    # the latents' storage (key, value): the loss sees them quantized as the cache will hold them, and the
    # gradient passes the quantizer straight through
    quant: tuple = NO_QUANT


@dataclass
class RefineResult:
    P_k: torch.Tensor
    P_v: torch.Tensor
    holdout_start: float
    holdout_best: float
    steps_run: int


@contextmanager
def frozen(module: nn.Module):
    """No gradients for ``module``'s own weights inside the block (they are restored afterwards)."""
    flags = [(p, p.requires_grad) for p in module.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def relative_sq_error(layer, batch: LayerBatch, P_k, P_v, key_mode: str, rope: RopeSpec,
                      kl_weight: float = 0.0, quant: tuple = NO_QUANT, *, reference: float | None = None,
                      share: float = 1.0) -> torch.Tensor:
    """``‖ŷ − y‖² / ‖y‖²`` over the batch, plus ``kl_weight`` × the mean attention-row KL between the original
    and the compressed attention when positive (a scalar with grad to the bases). Latents stored as
    ``quant`` are quantized in the forward and passed straight through in the backward.

    In a distributed step the batch is one process's part of the minibatch: ``reference`` is ``‖y‖²`` of the
    whole minibatch and ``share`` this part's fraction of its sequences, so the parts' losses add up to the
    whole minibatch's."""
    y_hat = compressed_layer_output(layer, batch, P_k, P_v, key_mode=key_mode, rope=rope, quant=quant,
                                    straight_through=True).float()
    y = batch.output.float()
    loss = (y_hat - y).pow(2).sum() / (y.pow(2).sum() if reference is None else reference)
    if kl_weight > 0:
        loss = loss + kl_weight * share * layer_attention_kl(layer, batch, P_k, key_mode=key_mode)
    return loss


def holdout_error(layer, batches: list[LayerBatch], P_k, P_v, key_mode, rope, quant=NO_QUANT,
                  shard: Shard = SINGLE) -> float:
    """``Σ‖ŷ − y‖² / Σ‖y‖²`` over ``batches`` (this process's part of the held-out sequences) and the other
    processes' parts."""
    with torch.no_grad():
        num = den = 0.0
        for b in batches:
            y_hat = compressed_layer_output(layer, b, P_k, P_v, key_mode=key_mode, rope=rope,
                                            quant=quant).double()
            num += float((y_hat - b.output.double()).pow(2).sum())
            den += float(b.output.double().pow(2).sum())
    num, den = shard.sum(num, den)
    return num / den


def split(batch_all: LayerBatch, rows: torch.Tensor) -> LayerBatch:
    return LayerBatch(batch_all.layer_idx, batch_all.hidden[rows], batch_all.output[rows],
                      batch_all.position_embeddings, batch_all.attention_mask, batch_all.position_ids)


def refine_layer(layer: nn.Module, data: LayerBatch, P_k: torch.Tensor, P_v: torch.Tensor, *, key_mode: str,
                 rope: RopeSpec, settings: RefineSettings, seed: int,
                 shard: Shard | None = None) -> RefineResult:
    """Refine one layer's bases.

    Parameters
    ----------
    layer : the decoder layer (its weights are not trained).
    data : the calibration sequences at this layer this process holds (all of them in a single process):
        inputs ``hidden`` ``[S, N, D]`` and targets ``output``.
    P_k, P_v : starting bases (PCA), float32, orthonormal columns.
    seed : seeds the minibatch order (use a per-layer seed so that layers are reproducible one by one).
    shard : which of the run's sequences ``data`` holds (:mod:`~stiefkv.calibrate.distributed`). Minibatches
        and the held-out slice are drawn over all of them, each process computes the part it holds, and
        the gradients are added before every step, so every process takes the same steps.
    """
    shard = Shard(0, 1, data.hidden.shape[0]) if shard is None else shard
    S = shard.total
    n_hold = max(1, round(S * settings.holdout_fraction)) if S > 1 else 0
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(S, generator=g)
    hold_rows, train_rows = order[:n_hold], order[n_hold:] if S > 1 else order
    hold = [shard.local(hold_rows[i:i + settings.batch_size]) for i in range(0, n_hold, settings.batch_size)]
    hold = hold or [shard.local(train_rows)]
    hold = [split(data, rows) for rows in hold if len(rows)]

    geoopt = geoopt_module()
    manifold = geoopt.EuclideanStiefel()
    pk = geoopt.ManifoldParameter(P_k.detach().float().clone(), manifold=manifold)
    pv = geoopt.ManifoldParameter(P_v.detach().float().clone(), manifold=manifold)
    opt = geoopt.optim.RiemannianAdam([pk, pv], lr=settings.lr)
    start = best = holdout_error(layer, hold, pk, pv, key_mode, rope, settings.quant, shard)
    best_bases = (plain(pk), plain(pv))
    stale, step = 0, 0
    with frozen(layer), torch.enable_grad():
        for step in range(1, settings.steps + 1):
            n = min(settings.batch_size, len(train_rows))
            rows = shard.local(train_rows[torch.randint(len(train_rows), (n,), generator=g)])
            opt.zero_grad(set_to_none=True)
            part = split(data, rows)
            reference, = shard.sum(float(part.output.double().pow(2).sum()) if len(rows) else 0.0)
            if len(rows):
                relative_sq_error(layer, part, pk, pv, key_mode, rope, settings.kl_weight, settings.quant,
                                  reference=reference, share=len(rows) / n).backward()
            shard.sum_grads((pk, pv))
            opt.step()
            if step % settings.eval_every == 0 or step == settings.steps:
                err = holdout_error(layer, hold, pk, pv, key_mode, rope, settings.quant, shard)
                if err < best:
                    best, stale = err, 0
                    best_bases = (plain(pk), plain(pv))
                else:
                    stale += 1
                    if stale >= settings.patience:
                        break
    return RefineResult(best_bases[0], best_bases[1], holdout_start=start, holdout_best=best, steps_run=step)


def plain(p: torch.Tensor) -> torch.Tensor:
    """A detached copy as an ordinary tensor (not a geoopt ManifoldTensor, whose ops dispatch differently)."""
    return p.detach().as_subclass(torch.Tensor).clone()


def orthonormality_error(P: torch.Tensor) -> float:
    """``max |PᵀP − I|`` over all heads."""
    eye = torch.eye(P.shape[-1], dtype=P.dtype, device=P.device)
    return float((P.transpose(-1, -2) @ P - eye).abs().max())
