"""Bases per KV head against one basis shared by a layer's KV heads (Palu's grouped-head decomposition),
at the same bytes: PCA of the keys before RoPE and of the values, rank ``r`` per head against rank ``G·r``
over the layer's ``G·d`` key (value) channels, and the PPL of the model whose ``k_proj``/``v_proj`` outputs
are projected onto those subspaces (what a latent cache of that rank reproduces in the ``pre_rope`` mode).

    python benchmarks/experiments/grouped_heads.py [--model smollm2] [--windows 4] [--budgets 0.5 0.25]

Not the product's calibration (no Stiefel refinement, no allocation): both arms are plain PCA at uniform
ranks, so the comparison isolates the sharing. The per-head arm is the ``pca uniform`` row of
BENCHMARKS.md §1 (the first 4 CPU windows gave 59.86 there at 50 %), which checks the projection hooks
against the product's path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import time

import torch

from stiefkv.data import calibration_sequences
from stiefkv.evaluate import load_test_windows
from stiefkv.models import decoder_layers, dims_of, load_model


def _collect_covariances(model, seqs: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Per layer, the second-moment matrices ``[G·d, G·d]`` (float64) of the ``k_proj`` and ``v_proj``
    outputs over all calibration tokens."""
    covs: list[dict[str, torch.Tensor]] = []
    hooks = []
    for layer in decoder_layers(model):
        slot: dict[str, torch.Tensor] = {}
        covs.append(slot)
        for name in ("k_proj", "v_proj"):
            def hook(_m, _inp, out, slot=slot, name=name):
                x = out.reshape(-1, out.shape[-1]).double()
                slot[name] = slot.get(name, 0) + x.T @ x
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(hook))
    try:
        with torch.no_grad():
            for ids in seqs.split(4):
                model(ids.to(model.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return covs


def _top_eigvecs(cov: torch.Tensor, r: int) -> torch.Tensor:
    vals, vecs = torch.linalg.eigh(cov)
    return vecs[:, -r:].flip(-1)


def projectors(cov: torch.Tensor, G: int, d: int, r: int, shared: bool) -> torch.Tensor:
    """The ``[G·d, G·d]`` orthogonal projector onto rank ``r`` per head (block diagonal) or ``G·r`` shared."""
    if r >= d:
        return torch.eye(G * d)
    if shared:
        P = _top_eigvecs(cov, G * r)
        return (P @ P.T).float()
    out = torch.zeros_like(cov)
    for g in range(G):
        s = slice(g * d, (g + 1) * d)
        P = _top_eigvecs(cov[s, s], r)
        out[s, s] = P @ P.T
    return out.float()


def residual_energy(cov: torch.Tensor, proj: torch.Tensor) -> float:
    """Share of the second moment the projector leaves out: ``1 − tr(Π C) / tr(C)``."""
    c = cov.float()
    return float(1 - torch.trace(proj @ c) / torch.trace(c))


@contextlib.contextmanager
def projected(model, mats: list[dict[str, torch.Tensor]]):
    """``k_proj``/``v_proj`` outputs replaced by their projection (keys before RoPE: ``pre_rope``)."""
    hooks = []
    for layer, m in zip(decoder_layers(model), mats):
        for name in ("k_proj", "v_proj"):
            proj = m[name].to(model.device)
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                lambda _m, _i, out, proj=proj: (out.float() @ proj).to(out.dtype)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def _shared(arm: str, name: str) -> bool:
    return arm == "shared" or arm == "shared-v" and name == "v_proj"


@torch.no_grad()
def kl_profiles(model, seqs: torch.Tensor, covs, G: int, d: int, arm: str, step: int = 8) -> torch.Tensor:
    """``[L, 2, d / step]``: next-token KL(p ‖ p') on ``seqs`` with one layer's keys (0) or values (1) cut to
    rank ``j · step`` per head (``j = 1 … d / step``; the same bytes shared: ``G · j · step``), all else
    exact: the profile a DP allocation spends the budget on (additive, as the product's ``kl`` profiles)."""
    seqs = seqs.to(model.device)
    ref = torch.log_softmax(model(seqs, use_cache=False).logits.float(), -1)
    n = d // step
    out = torch.zeros(len(covs), 2, n)
    L = len(covs)
    for layer in range(L):
        for i, name in enumerate(("k_proj", "v_proj")):
            for j in range(1, n):
                mats = [{"k_proj": torch.eye(G * d), "v_proj": torch.eye(G * d)} for _ in range(L)]
                mats[layer][name] = projectors(covs[layer][name], G, d, j * step, _shared(arm, name))
                with projected(model, mats):
                    logp = torch.log_softmax(model(seqs, use_cache=False).logits.float(), -1)
                out[layer, i, j - 1] = (ref.exp() * (ref - logp)).sum(-1).mean()
    return out


def dp_ranks(profile: torch.Tensor, budget: float, step: int = 8) -> list[tuple[int, int]]:
    """Per layer ``(r_k, r_v)`` per head, multiples of ``step``, at most ``budget`` of the bytes in all,
    minimising the summed profile KL."""
    L, _, n = profile.shape
    items = profile.reshape(L * 2, n).tolist()
    cap = int(budget * n * L * 2 + 1e-6)
    inf = float("inf")
    best = [0.0] + [inf] * cap  # best[c]: least KL with c units spent over the items so far
    choice = []
    for kl in items:
        nxt, pick = [inf] * (cap + 1), [0] * (cap + 1)
        for c, v in enumerate(best):
            if v == inf:
                continue
            for j in range(1, n + 1):
                if c + j > cap:
                    break
                cost = v + kl[j - 1]
                if cost < nxt[c + j]:
                    nxt[c + j], pick[c + j] = cost, j
        best = nxt
        choice.append(pick)
    c = min(range(cap + 1), key=lambda k: best[k])
    js = []
    for pick in reversed(choice):
        j = pick[c]
        js.append(j)
        c -= j
    js = js[::-1]
    return [(js[2 * i] * step, js[2 * i + 1] * step) for i in range(L)]


def refined_projectors(model, tok, covs, ranks, arm: str, G: int, d: int, args) -> list[dict]:
    """The product's second pass (``stiefel``, ``sequential``, its defaults) from PCA bases at ``ranks`` (per
    head; shared: ``G`` times that jointly), through :mod:`stiefkv.layers`' shared bases for ``shared``."""
    from stiefkv.calibrate.pca import top_eigenvectors
    from stiefkv.calibrate.pipeline import CalibrationConfig, second_pass
    from stiefkv.calibrate.state import CalibrationState

    shared = arm == "shared"
    state = CalibrationState(settings={}, fingerprint={})
    for c in covs:
        for name, eigs in (("k_proj", state.eig_k), ("v_proj", state.eig_v)):
            m = c[name]
            eigs.append(top_eigenvectors(m[None], G * d) if shared else
                        top_eigenvectors(torch.stack([m[g * d:(g + 1) * d, g * d:(g + 1) * d]
                                                      for g in range(G)]), d))
    state.ranks = [(G * rk, G * rv) if shared else (rk, rv) for rk, rv in ranks]
    cfg = CalibrationConfig(budget=0.5, bits="16", rotation=False, num_sequences=args.num_sequences,
                            seq_len=args.seq_len).validate()
    seqs = calibration_sequences(model, tok, num_sequences=args.num_sequences, seq_len=args.seq_len)
    t0 = time.perf_counter()
    second_pass(model, seqs, cfg, state, None)
    print(f"{arm}: second pass {time.perf_counter() - t0:.0f} s", flush=True)

    def dense(P):
        P = P.double()
        if P.shape[0] == 1:
            return (P[0] @ P[0].T).float()
        return torch.block_diag(*(p @ p.T for p in P)).float()

    return [{"k_proj": dense(k), "v_proj": dense(v)} for k, v in zip(state.keys, state.values)]


@torch.no_grad()
def perplexity(model, windows: torch.Tensor) -> float:
    nll, n = 0.0, 0
    for ids in windows:
        ids = ids[None].to(model.device)
        logits = model(ids, use_cache=False).logits[:, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum").item()
        n += ids.shape[1] - 1
    return math.exp(nll / n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--windows", type=int, default=4, help="first test windows of 2048 tokens (0: all)")
    ap.add_argument("--num-sequences", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--arms", nargs="+", default=["per-head", "shared"],
                    help="per-head, shared (keys and values), shared-v (values shared, keys per head)")
    ap.add_argument("--dp", action="store_true",
                    help="also each arm with ranks allocated by DP on next-token KL profiles")
    ap.add_argument("--profile-seqs", type=int, default=8)
    ap.add_argument("--refine", action="store_true",
                    help="with --dp: also the DP ranks refined by the product's Stiefel second pass")
    ap.add_argument("--compact-chunks", type=int, default=0,
                    help="also compact C 4096 contexts to keep 0.1 (AM defaults) under each arm's "
                         "projection, on this many chunks, with the uncompressed model's AM and "
                         "expected_attention beside")
    args = ap.parse_args()
    model, tok = load_model(args.model, device=args.device)
    dims = dims_of(model.config)
    G, d = dims.G, dims.d
    t0 = time.perf_counter()
    covs = _collect_covariances(model, calibration_sequences(model, tok, num_sequences=args.num_sequences,
                                                             seq_len=args.seq_len))
    windows = load_test_windows(tok, limit=args.windows or None)
    print(f"G {G}, d {d}, {len(covs)} layers; covariances {time.perf_counter() - t0:.0f} s; "
          f"{len(windows)} windows", flush=True)
    base = perplexity(model, windows)
    print(json.dumps({"arm": "uncompressed", "ppl": round(base, 4)}), flush=True)
    if args.compact_chunks:
        for method in ("am", "expected_attention"):
            _compacted(model, tok, method, "uncompressed", None, args.compact_chunks)
    profiles = {}
    if args.dp:
        seqs = calibration_sequences(model, tok, num_sequences=args.profile_seqs, seq_len=args.seq_len,
                                     seed=1)
        for arm in args.arms:
            t0 = time.perf_counter()
            profiles[arm] = kl_profiles(model, seqs, covs, G, d, arm)
            print(f"{arm}: KL profiles {time.perf_counter() - t0:.0f} s", flush=True)
    for budget in args.budgets:
        r = round(budget * d)
        for arm in args.arms:
            if arm in profiles:
                ranks = dp_ranks(profiles[arm], budget)
                mats = [{"k_proj": projectors(c["k_proj"], G, d, rk, _shared(arm, "k_proj")),
                         "v_proj": projectors(c["v_proj"], G, d, rv, _shared(arm, "v_proj"))}
                        for c, (rk, rv) in zip(covs, ranks)]
                with projected(model, mats):
                    ppl = perplexity(model, windows)
                print(json.dumps({"arm": f"{arm} dp", "budget": budget, "ppl": round(ppl, 4),
                                  "dppl_pct": round(100 * (ppl / base - 1), 1),
                                  "ranks_k": [rk for rk, _ in ranks], "ranks_v": [rv for _, rv in ranks]}),
                      flush=True)
                if args.compact_chunks:
                    _compacted(model, tok, "am", f"{arm} dp {budget:g}", mats, args.compact_chunks)
                if args.refine and arm in ("per-head", "shared"):
                    mats = refined_projectors(model, tok, covs, ranks, arm, G, d, args)
                    with projected(model, mats):
                        ppl = perplexity(model, windows)
                    print(json.dumps({"arm": f"{arm} dp stiefel", "budget": budget, "ppl": round(ppl, 4),
                                      "dppl_pct": round(100 * (ppl / base - 1), 1)}), flush=True)
                    if args.compact_chunks:
                        _compacted(model, tok, "am", f"{arm} dp stiefel {budget:g}", mats,
                                   args.compact_chunks)
            mats = [{n: projectors(c[n], G, d, r, _shared(arm, n))
                     for n in ("k_proj", "v_proj")} for c in covs]
            res = {n: sum(residual_energy(c[n], m[n]) for c, m in zip(covs, mats)) / len(covs)
                   for n in ("k_proj", "v_proj")}
            with projected(model, mats):
                ppl = perplexity(model, windows)
            print(json.dumps({"arm": arm, "budget": budget, "rank_per_head": r, "ppl": round(ppl, 4),
                              "dppl_pct": round(100 * (ppl / base - 1), 1),
                              "resid_k": round(res["k_proj"], 4), "resid_v": round(res["v_proj"], 4)}),
                  flush=True)
            if args.compact_chunks:
                _compacted(model, tok, "am", f"{arm} {budget:g}", mats, args.compact_chunks)


def _compacted(model, tok, method: str, arm: str, mats, chunks: int) -> None:
    """Compressed-context PPL at C 4096, keep 0.1, under ``mats``' projections (the uncompressed cache
    compacted: its keys and values already lie in the subspaces, and so do AM's fitted values, which are
    combinations of attention outputs over them). ``ppl_full`` is the projected model's whole context."""
    from stiefkv.longcontext import evaluate_compacted

    with projected(model, mats) if mats is not None else contextlib.nullcontext():
        r = evaluate_compacted(model, tok, context=4096, keep=0.1, method=method, chunks=chunks)
    print(json.dumps({"arm": arm, "compact": method, "chunks": r.chunks, "ppl": round(r.ppl, 4),
                      "ppl_full_context": round(r.ppl_full, 4)}), flush=True)


if __name__ == "__main__":
    main()
