"""A value decoder fitted by least squares in place of the value basis itself: does ``v̂ = D Eᵀ v`` (``E`` the
orthonormal encoder a latent cache stores, ``D`` any matrix, folded into ``o_proj`` as ``P_v`` is today) lose
less than ``v̂ = E Eᵀ v`` at the same bytes?

    python benchmarks/experiments/value_decoder.py [--windows 4] [--budgets 0.5] [--arms per-head shared]

Attention is linear in the values, so head ``h``'s output with decoded values is ``D_g z̄_h``, where
``z̄_h = Σ_j p_hj Eᵀ v_j`` is the attention-weighted latent (``g`` the head's KV head). ``D_g`` is fitted
to the head's exact output ``o_h = Σ_j p_hj v_gj`` over the calibration tokens (``D_g = A_g C_g⁻¹``,
``A_g = Σ o_h z̄_hᵀ``, ``C_g = Σ z̄_h z̄_hᵀ``), with the keys already projected, so the fit also absorbs what
the keys' projection moved in the weights ``p``. With ``E`` the values' top eigenvectors, ``D = E`` would
be optimal for the values themselves; it is not for the attention outputs, whose second moment differs.
A basis per KV head restricts ``D_g`` to its own head's latent; shared bases give every head all ``R``.

Not the product's calibration (PCA at uniform ranks, hooks on ``k_proj``/``v_proj``, as
``grouped_heads.py``); a probe of whether the product should store a decoder beside the bases.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import transformers.models.llama.modeling_llama as llama

from benchmarks.experiments.grouped_heads import (
    _collect_covariances,
    _top_eigvecs,
    perplexity,
    projected,
    projectors,
)
from stiefkv.data import calibration_sequences
from stiefkv.evaluate import load_test_windows
from stiefkv.models import decoder_layers, dims_of, load_model


def encoders(cov: torch.Tensor, G: int, d: int, r: int, shared: bool) -> list[torch.Tensor]:
    """Per KV head, the ``[G·d, R_g]`` encoder whose latent that head's output is decoded from: the shared
    ``G·r`` top eigenvectors for every head, or head ``g``'s own ``r`` (zero outside its channels)."""
    if shared:
        E = _top_eigvecs(cov, G * r)
        return [E] * G
    out = []
    for g in range(G):
        s = slice(g * d, (g + 1) * d)
        E = torch.zeros(G * d, r, dtype=cov.dtype)
        E[s] = _top_eigvecs(cov[s, s], r)
        out.append(E)
    return out


def checkpoint_maps(path: str, G: int, d: int):
    """A checkpoint's projectors (as :func:`grouped_heads.projectors` makes them) and value encoders."""
    from stiefkv.projections import Projections

    proj = Projections.load(path)
    if proj.quantized or proj.key_mode != "pre_rope":
        raise SystemExit(f"{path}: this probe takes bf16 latents with keys before RoPE")

    def dense(P):
        P = P.double()
        return (P[0] @ P[0].T).float() if P.shape[0] == 1 else torch.block_diag(*(p @ p.T for p in P)).float()

    def encs_of(P):
        P = P.double()
        if P.shape[0] == 1:
            return [P[0]] * G
        out = []
        for g in range(G):
            E = torch.zeros(G * d, P.shape[-1], dtype=torch.float64)
            E[g * d:(g + 1) * d] = P[g]
            out.append(E)
        return out

    mats = [{"k_proj": dense(k), "v_proj": dense(v)} for k, v in zip(proj.keys, proj.values)]
    return mats, [encs_of(v) for v in proj.values]


@contextlib.contextmanager
def capturing(model, encs: list[list[torch.Tensor]], stats: list[dict], decode: list | None = None,
              exact_keys: dict | None = None):
    """Eager attention that also adds, per layer and KV head, ``A_g`` and ``C_g`` (see the module doc) from
    the layer's exact values; with ``decode``, each layer's output is then the one of its values mapped by
    ``decode[layer]`` (so later layers see the decoded model, and each layer is fitted on top of them).
    With ``exact_keys`` (per layer the exact ``k_proj`` output, filled by a hook), the target outputs ``o_h``
    use the exact keys' weights, so the decoder also answers for the keys' projection."""
    original = llama.eager_attention_forward
    before = model.config._attn_implementation

    def capture(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        out, p = original(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
        B, G, T, d = value.shape
        if decode is not None:
            q_map = decode[module.layer_idx].to(value.device)
            mapped = (value.transpose(1, 2).reshape(B, T, G * d).float() @ q_map).to(value.dtype)
            out, _ = original(module, query, key, mapped.reshape(B, T, G, d).transpose(1, 2), attention_mask,
                              scaling, dropout, **kwargs)
        per = query.shape[1] // G
        p_target = p
        if exact_keys is not None:
            k = exact_keys.pop(module.layer_idx).view(B, T, G, d).transpose(1, 2)
            pos = torch.arange(T, device=k.device)[None].expand(B, T)
            cos, sin = model.model.rotary_emb(value, pos)
            _, k = llama.apply_rotary_pos_emb(k, k, cos, sin)
            _, p_target = original(module, query, k.to(query.dtype), value, attention_mask, scaling, dropout,
                                   **kwargs)
        v_all = value.transpose(1, 2).reshape(B, T, G * d).double()
        slot = stats[module.layer_idx]
        for g, E in enumerate(encs[module.layer_idx]):
            z = v_all @ E.to(v_all.device)  # [B, T, R_g]
            for h in range(g * per, (g + 1) * per):
                ph = p[:, h].double()
                zbar = (ph @ z).flatten(0, 1)
                o = (p_target[:, h].double() @ value[:, g].double()).flatten(0, 1)
                slot.setdefault("A", [0] * G)[g] += o.T @ zbar
                slot.setdefault("C", [0] * G)[g] += zbar.T @ zbar
        return out, p

    llama.eager_attention_forward = capture
    model.config._attn_implementation = "eager"
    try:
        yield
    finally:
        llama.eager_attention_forward = original
        model.config._attn_implementation = before


def fitted_value_maps(stats: list[dict], encs: list[list[torch.Tensor]], G: int, d: int,
                      ridge: float) -> list[torch.Tensor]:
    """Per layer the ``[G·d, G·d]`` map ``v ↦ v̂`` (row vectors, as :func:`projected` applies it): head
    ``g``'s channels ``v E_g D_gᵀ``."""
    maps = []
    for slot, layer_encs in zip(stats, encs):
        Q = torch.zeros(G * d, G * d, dtype=torch.float64)
        for g, E in enumerate(layer_encs):
            C = slot["C"][g]
            lam = ridge * torch.trace(C) / C.shape[0]
            D = torch.linalg.solve(C + lam * torch.eye(C.shape[0], dtype=C.dtype), slot["A"][g].T).T  # [d, R]
            Q[:, g * d:(g + 1) * d] = E @ D.T
        maps.append(Q.float())
    return maps


@torch.no_grad()
def fit_decoders(model, seqs, mats, encs, G: int, d: int, ridge: float, upstream=None,
                 target: str = "projected-keys"):
    """Statistics with keys projected by ``mats`` and values exact (or, with ``upstream``, the layers before
    each one measured decoded by the maps of a previous fit)."""
    L = len(mats)
    stats = [dict() for _ in range(L)]
    fit_mats = [{"k_proj": m["k_proj"], "v_proj": torch.eye(G * d)} for m in mats]
    exact = {} if target == "exact-keys" else None
    hooks = []
    if exact is not None:  # registered first, so it sees k_proj's output before the projection
        for i, layer in enumerate(decoder_layers(model)):
            hooks.append(layer.self_attn.k_proj.register_forward_hook(
                lambda _m, _i, out, i=i: exact.__setitem__(i, out.detach())))
    try:
        with projected(model, fit_mats), capturing(model, encs, stats, upstream, exact):
            for ids in seqs.split(2):
                model(ids.to(model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return fitted_value_maps(stats, encs, G, d, ridge)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--num-sequences", type=int, default=32)
    ap.add_argument("--fit-sequences", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5])
    ap.add_argument("--arms", nargs="+", default=["per-head", "shared"])
    ap.add_argument("--ridge", type=float, default=1e-4)
    ap.add_argument("--target", default="projected-keys", choices=["projected-keys", "exact-keys"],
                    help="what the decoder is fitted to: attention weights of the projected or exact keys")
    ap.add_argument("--projections", help="a checkpoint (bf16 latents, pre_rope): its bases, not PCA")
    args = ap.parse_args()
    model, tok = load_model(args.model, device=args.device)
    dims = dims_of(model.config)
    G, d = dims.G, dims.d
    assert len(decoder_layers(model))
    t0 = time.perf_counter()
    covs = _collect_covariances(model, calibration_sequences(model, tok, num_sequences=args.num_sequences,
                                                             seq_len=args.seq_len))
    fit_seqs = calibration_sequences(model, tok, num_sequences=args.fit_sequences, seq_len=args.seq_len,
                                     seed=1)
    windows = load_test_windows(tok, limit=args.windows or None)
    print(f"G {G}, d {d}; covariances {time.perf_counter() - t0:.0f} s; {len(windows)} windows", flush=True)
    base = perplexity(model, windows)
    print(json.dumps({"arm": "uncompressed", "ppl": round(base, 4)}), flush=True)

    def report(arm, budget, mats, **extra):
        with projected(model, mats):
            ppl = perplexity(model, windows)
        print(json.dumps({"arm": arm, "budget": budget, "ppl": round(ppl, 4),
                          "dppl_pct": round(100 * (ppl / base - 1), 2), **extra}), flush=True)

    if args.projections:
        mats, encs = checkpoint_maps(args.projections, G, d)
        report(args.projections, None, mats)
        maps = fit_decoders(model, fit_seqs, mats, encs, G, d, args.ridge, target=args.target)
        report(f"{args.projections} + value decoder", None,
               [{"k_proj": m["k_proj"], "v_proj": q} for m, q in zip(mats, maps)])
        maps = fit_decoders(model, fit_seqs, mats, encs, G, d, args.ridge, upstream=maps,
                                 target=args.target)
        report(f"{args.projections} + value decoder, refit once", None,
               [{"k_proj": m["k_proj"], "v_proj": q} for m, q in zip(mats, maps)])
        return
    for budget in args.budgets:
        r = round(budget * d)
        for arm in args.arms:
            shared = arm == "shared"
            mats = [{n: projectors(c[n], G, d, r, shared) for n in ("k_proj", "v_proj")} for c in covs]
            report(arm, budget, mats)
            encs = [encoders(c["v_proj"], G, d, r, shared) for c in covs]
            t0 = time.perf_counter()
            maps = fit_decoders(model, fit_seqs, mats, encs, G, d, args.ridge, target=args.target)
            fit_s = time.perf_counter() - t0
            report(f"{arm} + value decoder", budget,
                   [{"k_proj": m["k_proj"], "v_proj": q} for m, q in zip(mats, maps)], fit_s=round(fit_s))
            maps2 = fit_decoders(model, fit_seqs, mats, encs, G, d, args.ridge, upstream=maps,
                                 target=args.target)
            report(f"{arm} + value decoder, refit once", budget,
                   [{"k_proj": m["k_proj"], "v_proj": q} for m, q in zip(mats, maps2)])


if __name__ == "__main__":
    main()
