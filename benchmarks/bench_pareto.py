"""Quality per byte: PPL against KV bytes per token for StiefKV and the quantization-only caches, one run.

Rows, all on the same WikiText-2 test windows and the same bytes accounting
(``Projections.kv_bytes_per_token``: codes, float16 scales and lows, the float window, the int32 positions,
for a 2048-token cache):

- ``auto``: ``stiefkv.calibrate`` defaults with ``bits="auto"`` at each budget;
- ``ranks``: the defaults with ``bits=16`` (bf16 latents, ranks only: earlier versions' checkpoints);
- ``int{b}``/``kivi{b}``: the quantization-only baselines of ``stiefkv eval --baseline`` (b = 8, 4, 3, 2),
  min–max as KIVI defines them, each with its 16 newest tokens exact (KIVI's residual; ``DEFAULT_RECENT``);
  ``-r0`` beside them without (the window's gain alone), ``-mse`` with StiefKV's least-squared-error encoder
  (the encoder's);
- ``pca-uniform-int4``: PCA bases at rank d/2 in every layer, latents int4 per token (no rotation, no exact
  tokens: the issue's reference row, kept as it was measured);
- ``through-cache``: transformers' own ``QuantizedCache`` (optimum-quanto, its defaults: per-token groups of
  64, the last 128 tokens in full precision; ``hf-quanto4``/``hf-quanto2``), and beside them the same
  windows through StiefKV's cache at int4/KIVI-4/KIVI-2 (``… chunk64``): both scored 64 tokens per forward
  through the cache, the way a cache is read in serving, with bytes counted in the filled cache;

The two first passes (PCA and profiles; ``auto``'s extends the ``kl`` profile to bits and layouts) are run
once each and timed; each calibrated row then allocates and runs its own second pass exactly as
``stiefkv.calibrate`` does. A row's calibration time is its first pass plus its second pass. Rows go to
``OUTDIR/pareto.jsonl`` as they finish (a row already there is skipped, so a run stopped by a time limit
continues), and ``--plot`` draws ``pareto.png`` from the rows.

    python benchmarks/bench_pareto.py smollm2 OUTDIR --device cuda
    python benchmarks/bench_pareto.py --plot benchmarks/results/pareto.jsonl benchmarks/results/pareto.png
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

BUDGETS = (0.5, 0.25, 0.1875, 0.125, 0.09375, 0.0625)
ROW_KINDS = ("baselines", "pca-uniform-int4", "ranks", "auto", "through-cache")
THROUGH_CACHE = ("hf-quanto4", "hf-quanto2", "int4", "kivi4", "kivi2")
# How one forward scores a quantized cache. Rows without it (before 2026-12-01, third session) read every
# key as the cache holds it after the forward; since then each query reads exact the keys that decoding it
# would have found exact (a filling per-channel group, the recent window): render compares like with like.
SCORING = "band"
# calibration settings of --extra that a bf16 (ranks-only) calibration takes too
BF16_SETTINGS = ("share_heads", "method", "key_mode", "allocation", "weighting", "profile", "order", "data",
                 "num_sequences", "seq_len", "profile_sequences", "steps", "lr", "step_sequences", "loss",
                 "kl_weight", "rank_step", "seed")


def synced(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def first_pass_state(model, seqs, cfg, path: Path, device: str):
    """The first pass of ``cfg`` (loaded from ``path`` when an earlier run saved it) and its seconds."""
    from stiefkv.calibrate.pipeline import first_pass, profiled_config
    from stiefkv.calibrate.state import CalibrationState
    from stiefkv.models import fingerprint, fingerprint_like

    fp = fingerprint(model)
    settings = asdict(cfg) | {"budget": None}
    if path.is_file():
        state = CalibrationState.load(path, settings, fp, functools.partial(fingerprint_like, model))
        return state, state.refine[0]["first_pass_seconds"]
    state = CalibrationState(settings=settings, fingerprint=fp)
    t0 = synced(device)
    first_pass(model, seqs, profiled_config(cfg), state)
    seconds = synced(device) - t0
    state.refine = [{"first_pass_seconds": seconds}]
    state.save(path)
    return state, seconds


def calibrated(model, seqs, first, cfg, device: str):
    """Allocation and second pass of ``cfg`` on a shared first pass: (Projections, second-pass seconds).
    Key mode ``auto`` is resolved as ``stiefkv calibrate`` resolves it (``served_key_modes``)."""
    from stiefkv.calibrate.pipeline import choose_allocation, profiled_config, second_pass, served_key_modes
    from stiefkv.calibrate.state import CalibrationState
    from stiefkv.models import dims_of
    from stiefkv.projections import Projections

    state = CalibrationState(settings=asdict(cfg), fingerprint=first.fingerprint, eig_k=first.eig_k,
                             eig_v=first.eig_v, profiles=first.profiles)
    t0 = synced(device)
    state.ranks, quant = choose_allocation(cfg, state, dims_of(model.config))
    state.quant = [[str(q) for q in pair] for pair in quant] if quant else []
    key_modes = served_key_modes(cfg, state.ranks, dims_of(model.config))
    second_pass(model, seqs, cfg, state, None, key_modes=key_modes,
                profiled_key_mode=profiled_config(cfg).key_mode)
    seconds = synced(device) - t0
    proj = Projections(keys=state.keys, values=state.values, key_mode=key_modes[0], layer_key_modes=key_modes,
                       fingerprint=first.fingerprint, budget=cfg.budget, method=cfg.method,
                       settings=asdict(cfg), errors=state.errors, quant=quant)
    return proj, seconds


def pca_uniform_int4(model, first, rank: int):
    from stiefkv.projections import Projections
    from stiefkv.quant import QuantSpec

    spec = QuantSpec(4, "token")
    L = len(first.eig_k)
    return Projections(keys=[e[..., :rank].contiguous() for e in first.eig_k],
                       values=[e[..., :rank].contiguous() for e in first.eig_v], key_mode="pre_rope",
                       fingerprint=first.fingerprint, budget=0.125, method="pca-uniform",
                       quant=[(spec, spec)] * L)


def case_of(name: str, budget: float | None, tag: str = "", subset: str = "") -> str:
    """A row's case: ``subset`` (`` w2 cpu``) names a run on the first windows only, so that its rows
    neither stand in for the whole test set's (render, the plot) nor count as them when a run resumes."""
    return (f"{name} {budget}" if budget is not None else name) + (f" {tag}" if tag else "") + subset


def row_of(name: str, budget: float | None, proj, result, calib_s: float | None, extra: dict,
           subset: str = "", windows_limit: int | None = None) -> dict:
    case = case_of(name, budget, extra.get("tag", ""), subset)
    full_bytes = 2 * 2 * proj.keys[0].shape[1] * proj.keys[0].shape[0] * len(proj.keys)  # L·G·2d·2
    return {
        "bench": "pareto", "case": case, "row": name, "budget": budget, "ppl": result.ppl,
        "ppl_original": result.ppl_original, "next_token_kl": result.next_token_kl, "windows": result.windows,
        "tokens": result.tokens_scored, "kv_bytes_per_token": proj.kv_bytes_per_token(),
        "bytes_fraction": proj.kv_bytes_per_token() / full_bytes, "achieved_budget": proj.achieved_budget,
        "calibration_s": calib_s, "ranks": [list(r) for r in proj.ranks],
        "storage": [[str(q) for q in pair] for pair in proj.specs], "key_mode": proj.key_mode_summary,
        "scoring": SCORING, "windows_limit": windows_limit, "remeasured": True,
    } | extra | {"provenance": utils.provenance()}


def through_cache_row(name: str, result, full_bytes: int) -> dict:
    """A row of a cache scored through itself (``evaluate_through_cache``): bytes as the filled cache held,
    over ``full_bytes``, the bf16 cache's bytes per token."""
    return {
        "bench": "pareto", "case": name, "row": name, "budget": None, "ppl": result.ppl,
        "ppl_original": result.ppl_original, "next_token_kl": result.next_token_kl, "windows": result.windows,
        "tokens": result.tokens_scored, "kv_bytes_per_token": result.kv_bytes_per_token,
        "bytes_fraction": result.kv_bytes_per_token / full_bytes, "calibration_s": None,
        "protocol": "through the cache, 64 tokens per forward", "remeasured": True,
        "provenance": utils.provenance(),
    }


def exact_window(r: dict) -> int | None:
    """The exact recent tokens of a calibrated row's quantized latents, from its storages (None: none
    recorded)."""
    found = re.findall(r"-r(\d+)", str(r.get("storage") or ""))
    return int(found[0]) if found else None


def is_default_auto(r: dict) -> bool:
    """Whether ``r`` is an ``auto`` row of today's defaults: untagged with the default's exact window at its
    budget (:func:`~stiefkv.calibrate.pipeline.default_recent`), or the variant measured with exactly that
    window and nothing else changed (``w8-recent8``: the default below 10 % since it was measured)."""
    from stiefkv.calibrate.pipeline import default_recent
    from stiefkv.quant import DEFAULT_RECENT

    if r.get("row") != "auto" or not isinstance(r.get("budget"), float):
        return False
    want, window = default_recent(r["budget"]), exact_window(r)
    if not r.get("tag"):  # None: no window recorded (older rows, measured when 16 was the only default)
        return window == want or (window is None and want == DEFAULT_RECENT)
    return r["tag"] == f"w8-recent{want}" and r.get("extra") == {"recent": want} and window == want


def whole_set(rows: list[dict]) -> list[dict]:
    """The rows of the plot: scored on one set of windows. Rows of a ``--windows N`` run (``windows_limit``)
    are left out beside the whole test set's; where every row is such a run's, those of the most rows'
    window count."""
    rows = [r for r in rows if "ppl" in r and not r.get("protocol")]
    whole = [r for r in rows if not r.get("windows_limit")]
    if whole:
        return whole
    counts = [r.get("windows") for r in rows]
    most = max(set(counts), key=counts.count) if counts else None
    return [r for r in rows if r.get("windows") == most]


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shared = lambda r: r.get("tag") == "share-heads"  # noqa: E731  (--extra '{"share_heads":true}')
    latest = {(r["row"], r["budget"], shared(r)): r for r in whole_set(rows)  # a case measured again: newest
              if shared(r) or (is_default_auto(r) if r.get("row") == "auto" else not r.get("tag"))}
    rows = list(latest.values())
    if not rows:
        raise ValueError("no calibrated or baseline row to plot (through-cache rows are not plotted)")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    named = lambda pattern: lambda r: re.fullmatch(pattern, r["row"]) is not None  # noqa: E731
    groups = {"StiefKV auto": lambda r: r["row"] == "auto" and not shared(r),
              "StiefKV auto, --share-heads": lambda r: r["row"] == "auto" and shared(r),
              "StiefKV ranks only (bf16)": lambda r: r["row"] == "ranks" and not shared(r),
              "StiefKV ranks only (bf16), --share-heads": lambda r: r["row"] == "ranks" and shared(r),
              "int-k per token": named(r"int\d"),  # the baselines as named, not their variants
              "KIVI-k": named(r"kivi\d"),
              "KIVI-k, no exact recent tokens": named(r"kivi\d-r0"),
              "PCA-uniform + int4": lambda r: r["row"] == "pca-uniform-int4"}
    for label, pick in groups.items():
        pts = sorted((r["bytes_fraction"], r["ppl"]) for r in rows if pick(r))
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label)
    base = rows[0]["ppl_original"]
    ax.axhline(base, color="gray", ls=":", label=f"uncompressed ({base:.2f})")
    ax.set_xlabel("KV bytes per token / uncompressed bf16 cache")
    windows = sorted({r.get("windows") for r in rows}, key=str)  # it said 147 whatever the rows held
    ax.set_ylabel(f"PPL (WikiText-2 test, {'/'.join(map(str, windows))} × 2048)")
    ax.set_yscale("log")
    ax.set_ylim(base * 0.95, min(200, max(r["ppl"] for r in rows) * 1.1))
    ax.set_title("SmolLM2-135M: quality per byte")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    ap = utils.parser(__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", help="an alias, a GGUF file or a model folder")
    ap.add_argument("outdir", type=Path, nargs="?", help="folder of pareto.jsonl and the first passes")
    ap.add_argument("--budgets", type=utils.comma_list(utils.share), default=",".join(map(str, BUDGETS)),
                    help="comma-separated budgets of the calibrated rows")
    ap.add_argument("--rows", type=utils.comma_list(str, list(ROW_KINDS)), default=",".join(ROW_KINDS),
                    help=f"comma-separated, of {', '.join(ROW_KINDS)}")
    ap.add_argument("--baselines", default=None, help="comma-separated baseline names (default: all of "
                    "stiefkv.evaluate.BASELINES, and all of THROUGH_CACHE for the through-cache rows)")
    ap.add_argument("--windows", type=utils.at_least(1), default=None,
                    help="first N test windows (default: all)")
    ap.add_argument("--extra", type=utils.calibration_json, default="{}",
                    help="JSON of calibration settings for the auto rows, and for the ranks rows those of "
                    "BF16_SETTINGS (e.g. share_heads)")
    ap.add_argument("--tag", default="", help="label of a variant's rows (with --extra)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="(default: cuda where available, else cpu)")
    ap.add_argument("--plot", nargs=2, type=Path, metavar=("JSONL", "PNG"), help="only draw the plot")
    args = ap.parse_args()
    if args.plot:
        if not args.plot[0].is_file():
            ap.error(f"--plot {args.plot[0]}: no such file")
        if not args.plot[1].parent.is_dir():
            ap.error(f"--plot {args.plot[1]}: its folder does not exist")
        try:
            print(plot(utils.read_rows(args.plot[0]), args.plot[1]))
        except ValueError as err:
            ap.error(f"--plot {args.plot[0]}: {err}")
        return

    import stiefkv
    from stiefkv.calibrate.pipeline import CalibrationConfig
    from stiefkv.data import calibration_sequences
    from stiefkv.evaluate import (
        BASELINES,
        CHUNK,
        baseline_projections,
        evaluate,
        evaluate_through_cache,
        transformers_quantized_cache,
    )
    from stiefkv.models import dims_of

    if args.model is None or args.outdir is None:
        ap.error("give MODEL and OUTDIR (or --plot JSONL PNG)")
    names = args.baselines.split(",") if args.baselines else list(BASELINES)
    unknown = [n for n in names if n not in BASELINES and n not in THROUGH_CACHE]
    if unknown:
        ap.error(f"--baselines {', '.join(unknown)}: choose among "
                 f"{', '.join(dict.fromkeys([*BASELINES, *THROUGH_CACHE]))}")
    extra = args.extra
    extra16 = {k: v for k, v in extra.items() if k in BF16_SETTINGS}
    # every row's settings, before the model loads and the baselines' passes run
    utils.check_calibration(ap, *(dict(extra16, device=args.device, bits=16, budget=b) for b in args.budgets),
                            *(dict(extra, device=args.device, bits="auto", budget=b) for b in args.budgets))
    args.outdir.mkdir(parents=True, exist_ok=True)
    jsonl = args.outdir / "pareto.jsonl"
    # a row already there, by its case, is not run again: the case names a --windows subset (`` w2 cpu``),
    # so a run on the whole test set no longer skips the rows of a run on its first windows, nor the reverse
    done = {r["case"] for r in utils.read_rows(jsonl)}
    subset = f" w{args.windows} {args.device}" if args.windows else ""

    def todo(case: str) -> bool:
        if case in done:
            print(f"{case}: already in {jsonl}, skipped", flush=True)
        return case not in done
    kinds, budgets = args.rows, args.budgets
    model, tok = utils.load_model(args.model, device=args.device)

    def run_eval(proj):
        return evaluate(model, tok, proj, window=2048, limit=args.windows, backend="reference",
                        layer_errors=False)

    def emit(row):
        with jsonl.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{row['row']:>18} {row.get('tag', ''):>12} budget {row['budget']} "
              f"bytes {row['bytes_fraction']:.4f} "
              f"ppl {row['ppl']:.3f} kl {row['next_token_kl']:.4f} calib {row['calibration_s']}", flush=True)

    if "baselines" in kinds:
        for name in [n for n in names if n in BASELINES]:
            if todo(case_of(name, None, "", subset)):
                proj = baseline_projections(model, name)
                emit(row_of(name, None, proj, run_eval(proj), None, {}, subset, args.windows))
    if "through-cache" in kinds:
        dims = dims_of(model.config)
        for name in [n for n in THROUGH_CACHE if not args.baselines or n in args.baselines.split(",")]:
            row = name if name.startswith("hf-") else f"{name} chunk{CHUNK}"
            row += subset  # a subset: its own rows
            if not todo(row):
                continue
            if name.startswith("hf-"):
                res = evaluate_through_cache(model, tok, lambda: transformers_quantized_cache(model, name),
                                             name=name, window=2048, limit=args.windows)
            else:
                proj = baseline_projections(model, name)
                res = evaluate_through_cache(model, tok, stiefkv.LatentCache, name=name, window=2048,
                                             limit=args.windows, projections=proj)
            emit(through_cache_row(row, res, dims.L * dims.G * 2 * dims.d * 2))
    suffix = "" if not args.tag else "_" + "".join(c if c.isalnum() else "-" for c in args.tag)
    # --extra's settings that also mean something at bf16 (e.g. share_heads) make the ranks rows a variant
    # too, under the tag; settings of quantized latents only (recent, …) leave them the plain rows
    tag16, suffix16 = (args.tag, suffix) if extra16 else ("", "")
    cfg16 = CalibrationConfig.from_kwargs(device=args.device, bits=16, **extra16)
    # built only where a row calibrates (--rows baselines built them for nothing)
    seqs = calibration_sequences(model, tok, data=cfg16.data, num_sequences=cfg16.num_sequences,
                                 seq_len=cfg16.seq_len, seed=cfg16.seed) \
        if {"ranks", "pca-uniform-int4", "auto"} & set(kinds) else None
    if {"ranks", "pca-uniform-int4"} & set(kinds):
        path16 = args.outdir / f"first_pass_bits16{suffix16}.safetensors"
        first16, fp16_s = first_pass_state(model, seqs, cfg16, path16, args.device)
        pca_case = case_of("pca-uniform-int4", 0.125, "", subset)
        if "pca-uniform-int4" in kinds and not extra16 and todo(pca_case):
            proj = pca_uniform_int4(model, first16, first16.eig_k[0].shape[1] // 2)
            emit(row_of("pca-uniform-int4", 0.125, proj, run_eval(proj), fp16_s, {}, subset, args.windows))
        # bf16 latents cannot go below one rank step per latent (rank 8 of 64: 12.5 %)
        floor16 = cfg16.rank_step / first16.eig_k[0].shape[1]
        for b in budgets if "ranks" in kinds else ():
            if b < floor16:  # skipped silently before
                print(f"{case_of('ranks', b, tag16, subset)}: below bf16 latents' floor {floor16:g} (one "
                      f"rank step of {cfg16.rank_step} per latent), skipped", flush=True)
            elif todo(case_of("ranks", b, tag16, subset)):
                cfg = CalibrationConfig.from_kwargs(device=args.device, bits=16, budget=b, **extra16)
                proj, s = calibrated(model, seqs, first16, cfg, args.device)
                emit(row_of("ranks", b, proj, run_eval(proj), fp16_s + s,
                            {"first_pass_s": fp16_s, "second_pass_s": s, "tag": tag16, "extra": extra16},
                            subset, args.windows))
    if "auto" in kinds:
        firsts = {}  # one first pass per exact window the budgets resolve to: the profiles measure it
        for b in budgets:
            if todo(case_of("auto", b, args.tag, subset)):
                cfg = CalibrationConfig.from_kwargs(device=args.device, bits="auto", budget=b, **extra)
                if cfg.recent not in firsts:
                    cfga = CalibrationConfig.from_kwargs(device=args.device, bits="auto",
                                                         **(extra | {"recent": cfg.recent}))
                    path = args.outdir / f"first_pass_auto{suffix}_r{cfg.recent}.safetensors"
                    firsts[cfg.recent] = first_pass_state(model, seqs, cfga, path, args.device)
                firsta, fpa_s = firsts[cfg.recent]
                proj, s = calibrated(model, seqs, firsta, cfg, args.device)
                emit(row_of("auto", b, proj, run_eval(proj), fpa_s + s,
                            {"first_pass_s": fpa_s, "second_pass_s": s, "tag": args.tag, "extra": extra,
                             "profile_storages": cfg.profile_storages}, subset, args.windows))


if __name__ == "__main__":
    main()
