"""Key bases that commute with RoPE: are they as good as the bases `pre_rope` rebuilds from?

RoPE turns each channel pair ``(i, i + d/2)`` of a key (transformers' ``rotate_half``) by ``pos·θ_i``: as a
complex number ``c_i = k_i + 1j·k_{i+d/2}`` it is multiplied by ``exp(1j·pos·θ_i)``. A basis that is complex-
linear within each frequency, mapping a latent to the ``G`` heads' planes of one frequency ``i`` only,
commutes with that rotation: rotating the latent by ``pos·θ_i`` and then rebuilding the key is the same as
rebuilding and then rotating. Decode could then project each query once (``q' = Pᴴ q``, as `post_rope`
does) and turn the latents (``r/2`` sin/cos a token, shared by every query head) instead of rebuilding
``d`` channels a KV head and turning those: no rebuild matmul at all. The price is the constraint on the
basis. This measures it on the real model, keys only (values exact), ranks only (no quantization):

- ``per-head``: real PCA of each head's keys before RoPE (what `pre_rope` can rebuild), rank ``budget·d``
  a head; ``per-head-alloc``: the same eigenvectors, the layer's ``budget·G·d`` dimensions given to the
  largest eigenvalues across its heads;
- ``shared``: real PCA of the layer's heads side by side (``--share-heads``), rank ``budget·G·d``;
- ``frequency``: complex PCA of each frequency's ``G`` planes (the RoPE-commuting basis shared by the
  heads), the layer's ``budget·G·d/2`` complex dimensions to the largest eigenvalues across frequencies;
- ``frequency-per-head``: the same with ``G = 1`` (each head keeps whole planes: frequency selection).

Calibration keys from WikiText-2 train windows, PPL on test windows (both CPU-sized here).

    python benchmarks/experiments/frequency_bases.py [MODEL] [--budgets 0.5 0.25] [--windows 6]
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from stiefkv.data import load_texts, token_stream, windows
from stiefkv.evaluate import load_test_windows
from stiefkv.models import decoder_layers, dims_of, load_model

KINDS = ("per-head", "per-head-alloc", "shared", "frequency", "frequency-per-head")


def collect_keys(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's keys before RoPE, ``[T, G, d]`` (float64), over the windows ``ids`` ``[W, n]``."""
    dims = dims_of(model.config)
    keys: list[list[torch.Tensor]] = [[] for _ in decoder_layers(model)]
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda m, a, out, i=i: keys[i].append(out.reshape(-1, dims.G, dims.d).double()))
        for i, layer in enumerate(decoder_layers(model))]
    try:
        with torch.no_grad():
            for w in ids:
                model(w[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [torch.cat(k) for k in keys]


def top_by_energy(eigenvalues: list[torch.Tensor], keep: int) -> list[int]:
    """How many eigenvectors each group keeps when ``keep`` go to the largest eigenvalues of all groups."""
    flat = torch.cat(eigenvalues)
    group = torch.cat([torch.full_like(e, j, dtype=torch.long) for j, e in enumerate(eigenvalues)])
    chosen = group[flat.argsort(descending=True)[:keep]]
    return [int((chosen == j).sum()) for j in range(len(eigenvalues))]


def real_projector(cov: torch.Tensor, rank: int) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(cov)
    U = vecs[:, vals.argsort(descending=True)[:rank]]
    return U @ U.T


def projectors(K: torch.Tensor, kind: str, budget: float):
    """A function ``[..., G, d] → [..., G, d]`` projecting keys onto the layer's basis of ``kind``."""
    T, G, d = K.shape
    half = d // 2
    if kind in ("per-head", "per-head-alloc"):
        covs = [K[:, g].T @ K[:, g] for g in range(G)]
        if kind == "per-head":
            ranks = [round(budget * d)] * G
        else:
            ranks = top_by_energy([torch.linalg.eigvalsh(c) for c in covs], round(budget * G * d))
        Ps = torch.stack([real_projector(c, r) for c, r in zip(covs, ranks)])  # [G, d, d]
        return lambda k: torch.einsum("...gd,gde->...ge", k.double(), Ps).to(k.dtype)
    if kind == "shared":
        flat = K.reshape(T, G * d)
        P = real_projector(flat.T @ flat, round(budget * G * d))
        return lambda k: (k.double().reshape(*k.shape[:-2], G * d) @ P).reshape(k.shape).to(k.dtype)
    # complex planes: c[t, g, i] = k[t, g, i] + 1j·k[t, g, i + d/2]
    C = torch.complex(K[..., :half], K[..., half:])  # [T, G, half]
    if kind == "frequency":
        covs = [C[:, :, i].T @ C[:, :, i].conj() for i in range(half)]  # Σ c cᴴ, [G, G] each
    else:
        covs = [C[:, g:g + 1, i].T @ C[:, g:g + 1, i].conj() for g in range(G) for i in range(half)]
    eig = [torch.linalg.eigh(c) for c in covs]
    ranks = top_by_energy([e.eigenvalues for e in eig], round(budget * G * d / 2))
    projs = []
    for (vals, vecs), r in zip(eig, ranks):
        U = vecs[:, vals.argsort(descending=True)[:r]]
        projs.append(U @ U.T.conj())

    def project(k: torch.Tensor) -> torch.Tensor:
        c = torch.complex(k[..., :half].double(), k[..., half:].double())  # [..., G, half]
        out = torch.empty_like(c)
        if kind == "frequency":
            for i, P in enumerate(projs):
                out[..., :, i] = c[..., :, i] @ P.T  # rows are c; (P c)ᵀ = cᵀ Pᵀ
        else:
            for j, P in enumerate(projs):
                g, i = divmod(j, half)
                out[..., g, i] = c[..., g, i] * P[0, 0]
        return torch.cat([out.real, out.imag], -1).to(k.dtype)
    return project


def relative_error(K: torch.Tensor, project) -> float:
    return float((project(K) - K).norm() / K.norm())


@torch.no_grad()
def ppl(model, test: torch.Tensor) -> float:
    nll, n = 0.0, 0
    for w in test:
        logits = model(w[None], use_cache=False).logits[0, :-1].float()
        nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
        n += w.numel() - 1
    return math.exp(nll / n)


def with_keys_projected(model, projs):
    """Hooks that replace each layer's keys before RoPE (``k_proj``'s output) by their projections."""
    dims = dims_of(model.config)

    def hook(m, a, out, project):
        shape = out.shape
        return project(out.reshape(*shape[:-1], dims.G, dims.d)).reshape(shape)
    return [layer.self_attn.k_proj.register_forward_hook(lambda m, a, o, p=p: hook(m, a, o, p))
            for layer, p in zip(decoder_layers(model), projs)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--calibration", type=int, default=16, help="train windows of 512 tokens")
    ap.add_argument("--windows", type=int, default=6, help="test windows of 2048 tokens")
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    args = ap.parse_args()
    model, tok = load_model(args.model)
    t0 = time.time()
    train = windows(token_stream(tok, load_texts("wikitext2", "calibration")), 512)[:args.calibration]
    keys = collect_keys(model, train)
    test = load_test_windows(tok, limit=args.windows)
    print(f"keys of {train.numel()} tokens in {time.time() - t0:.0f} s; uncompressed PPL "
          f"{ppl(model, test):.3f} on {len(test)} test windows", flush=True)
    for budget in args.budgets:
        for kind in args.kinds:
            projs = [projectors(K, kind, budget) for K in keys]
            err = sum(relative_error(K, p) for K, p in zip(keys, projs)) / len(keys)
            hooks = with_keys_projected(model, projs)
            try:
                value = ppl(model, test)
            finally:
                for h in hooks:
                    h.remove()
            print(f"budget {budget:g} {kind:>20}: keys' relative error {err:.4f} (train, mean over layers), "
                  f"PPL {value:.3f}", flush=True)


if __name__ == "__main__":
    main()
