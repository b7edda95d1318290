"""The calibration-quality table of one key mode: every method × allocation × order at every budget.

Rows share what does not depend on them: the model is loaded once, the first pass (PCA eigenvectors and
the ``kl`` error–rank profiles, which do not depend on the budget) runs once and is saved to
``OUTDIR/first_pass_{key_mode}.safetensors``; each row then allocates ranks and runs its own second pass
(PCA at the ranks, or Stiefel refinement in its order) exactly as ``stiefkv.calibrate`` does, and is
evaluated on the WikiText-2 test windows. Rows (with the run's provenance, ``utils.provenance``) go to
``OUTDIR/{key_mode}.jsonl`` and ``.md`` as they finish; a row already in the jsonl is skipped, so a run
stopped by a time limit continues where it was. The committed rows are
``benchmarks/results/issue3-table-{pre,post}_rope.jsonl``; ``render.py`` makes BENCHMARKS.md's table of them.

    python benchmarks/quality_table.py smollm2 OUTDIR --key-mode pre_rope --budgets 0.5,0.75,0.375,0.25

A row's calibration time is reported as two numbers: the shared first pass (PCA and the ``kl`` profiles;
a ``uniform`` row run alone would need only the PCA part) and the row's own second pass. Layer error is the
mean relative error of the decoder-layer outputs on the calibration sequences, every layer fed
the uncompressed inputs.
"""

from __future__ import annotations

import datetime
import functools
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

from stiefkv.calibrate.pipeline import CalibrationConfig, choose_ranks, first_pass, second_pass
from stiefkv.calibrate.state import CalibrationState
from stiefkv.data import calibration_sequences
from stiefkv.evaluate import evaluate
from stiefkv.models import dims_of, fingerprint, fingerprint_like
from stiefkv.projections import Projections

# name → (method, allocation, order)
ROWS = {
    "pca-uniform": ("pca", "uniform", "sequential"),
    "pca-dp": ("pca", "dp", "sequential"),
    "stiefel-dp-seq": ("stiefel", "dp", "sequential"),
    "stiefel-dp-indep": ("stiefel", "dp", "independent"),
    "stiefel-uniform-seq": ("stiefel", "uniform", "sequential"),
    "stiefel-uniform-indep": ("stiefel", "uniform", "independent"),
}


def synced_time(device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter()


def load_or_run_first_pass(
    model, seqs, cfg: CalibrationConfig, path: Path, device: str
) -> tuple[CalibrationState, float]:
    fp = fingerprint(model)
    settings = {
        "key_mode": cfg.key_mode,
        "weighting": cfg.weighting,
        "seed": cfg.seed,
        "tokens": list(seqs.shape),
        "profile_sequences": cfg.profile_sequences,
    }
    if path.is_file():
        state = CalibrationState.load(path, settings, fp, functools.partial(fingerprint_like, model))
        return state, state.refine[0]["first_pass_seconds"]
    state = CalibrationState(settings=settings, fingerprint=fp)
    t0 = synced_time(device)
    first_pass(model, seqs, cfg, state)
    seconds = synced_time(device) - t0
    state.refine = [
        {"first_pass_seconds": seconds}
    ]  # the state file's free-form list, so a rerun can report it
    state.save(path)
    return state, seconds


def run_row(
    model, tok, seqs, first: CalibrationState, cfg: CalibrationConfig, device: str, windows: int | None
):
    dims = dims_of(model.config)
    state = CalibrationState(
        settings=asdict(cfg),
        fingerprint=first.fingerprint,
        eig_k=first.eig_k,
        eig_v=first.eig_v,
        profiles=first.profiles,
    )
    state.ranks = choose_ranks(cfg, state, dims)
    t0 = synced_time(device)
    second_pass(model, seqs, cfg, state, None)
    seconds = synced_time(device) - t0
    proj = Projections(
        keys=state.keys,
        values=state.values,
        key_mode=cfg.key_mode,
        fingerprint=first.fingerprint,
        budget=cfg.budget,
        method=cfg.method,
        settings=asdict(cfg),
        errors=state.errors,
    )
    result = evaluate(model, tok, proj, window=2048, limit=windows, backend="reference", layer_errors=False)
    return proj, result, seconds, state


def case_of(row: dict) -> str:
    """A row's case; the rows before the harness have none: made from them as ``render.py`` makes it."""
    if "case" in row:
        return row["case"]
    return f"{row['key_mode']} {row['budget']:g} {row['row']}" + (f" {row['tag']}" if row.get("tag") else "")


def main() -> None:
    ap = utils.parser(__doc__.splitlines()[0])
    ap.add_argument("model", help="an alias, a GGUF file or a model folder")
    ap.add_argument("outdir", type=Path, help="folder of the rows (KEY_MODE.jsonl, .md) and the first pass")
    ap.add_argument("--key-mode", default="pre_rope", help="the key mode of every row")
    ap.add_argument("--budgets", type=utils.comma_list(utils.share), default="0.5,0.75,0.375,0.25",
                    help="comma-separated budgets")
    ap.add_argument("--rows", type=utils.comma_list(str, list(ROWS)), default=",".join(ROWS),
                    help=f"comma-separated, of {', '.join(ROWS)}")
    ap.add_argument("--windows", type=utils.at_least(1), default=None,
                    help="first N test windows (default: all)")
    ap.add_argument("--extra", type=utils.calibration_json, default="{}",
                    help="JSON of calibration settings for every row (steps, lr, …)")
    ap.add_argument("--tag", default="", help="label of the row variant in the table (with --extra)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="(default: cuda where available, else cpu)")
    args = ap.parse_args()
    utils.check_calibration(ap, dict(args.extra, key_mode=args.key_mode))
    args.outdir.mkdir(parents=True, exist_ok=True)
    jsonl, md = args.outdir / f"{args.key_mode}.jsonl", args.outdir / f"{args.key_mode}.md"
    # a row already there is skipped by its case, which names a --windows subset (`` w2 cpu``): a run on the
    # whole test set skipped the rows of a run on its first windows (and the reverse), and render could take
    # a subset's row for the whole set's; a row of another model is not this one's (rows without a model
    # predate the field: the committed rows, which run_table_gpu.sh copies in to resume from)
    subset = f" w{args.windows} {args.device}" if args.windows else ""
    recorded = utils.model_name(args.model)  # the default model by its alias or a copy of its file: one name
    done = {case_of(r) for r in utils.read_rows(jsonl)
            if utils.model_name(r.get("model", recorded)) == recorded}

    model, tok = utils.load_model(args.model, device=args.device)
    extra = args.extra
    base_cfg = CalibrationConfig.from_kwargs(device=args.device, key_mode=args.key_mode, **extra)
    seqs = calibration_sequences(
        model,
        tok,
        data=base_cfg.data,
        num_sequences=base_cfg.num_sequences,
        seq_len=base_cfg.seq_len,
        seed=base_cfg.seed,
    )
    first, first_seconds = load_or_run_first_pass(
        model, seqs, base_cfg, args.outdir / f"first_pass_{args.key_mode}.safetensors", args.device
    )
    if not md.is_file():
        name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
        md.write_text(
            f"# {args.model} · {args.key_mode} · {name} · torch {torch.__version__} · "
            f"{datetime.date.today()}\n"
            f"# calibration {base_cfg.num_sequences} × {base_cfg.seq_len}, first pass (PCA + kl profiles) "
            f"{first_seconds:.1f} s\n\n"
            "| key mode | budget | method | allocation | order | variant | PPL | ΔPPL "
            "| layer rel. err (calib.) | "
            "next-token KL | achieved budget | 2nd pass s | ranks |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
        )
    for budget in args.budgets:
        for row in args.rows:
            case = f"{args.key_mode} {budget:g} {row}" + (f" {args.tag}" if args.tag else "") + subset
            if case in done:
                print(f"{case}: already in {jsonl}, skipped", flush=True)
                continue
            method, allocation, order = ROWS[row]
            cfg = CalibrationConfig.from_kwargs(
                **(
                    asdict(base_cfg)
                    | extra
                    | {"budget": budget, "method": method, "allocation": allocation, "order": order}
                )
            )
            proj, r, seconds, state = run_row(model, tok, seqs, first, cfg, args.device, args.windows)
            layer_err = sum(e["rel_error"] for e in state.errors) / len(state.errors)
            record = {
                "case": case,
                "model": recorded,
                "windows_limit": args.windows,
                "row": row,
                "budget": budget,
                "tag": args.tag,
                "key_mode": args.key_mode,
                "ppl": r.ppl,
                "ppl_original": r.ppl_original,
                "windows": r.windows,
                "tokens": r.tokens_scored,
                "next_token_kl": r.next_token_kl,
                "layer_rel_error_calib": layer_err,
                "achieved_budget": proj.achieved_budget,
                "second_pass_seconds": seconds,
                "first_pass_seconds": first_seconds,
                "ranks": proj.ranks,
                "settings": asdict(cfg),
                "refine": state.refine,
                "errors": state.errors,
                "provenance": utils.provenance(),
            }
            with jsonl.open("a") as f:
                f.write(json.dumps(record) + "\n")
            ranks = " ".join(f"{k}/{v}" for k, v in proj.ranks)
            with md.open("a") as f:
                f.write(
                    f"| {args.key_mode} | {100 * budget:g} % | {method} | {allocation} | "
                    f"{order if method == 'stiefel' else '–'} | {args.tag or 'default'} | {r.ppl:.4f} | "
                    f"{100 * (r.ppl / r.ppl_original - 1):+.1f} % | {layer_err:.4f} "
                    f"| {r.next_token_kl:.4f} | "
                    f"{100 * proj.achieved_budget:.2f} % | {seconds:.1f} | {ranks} |\n"
                )
            print(f"{args.key_mode} {budget} {row} {args.tag}: PPL {r.ppl:.4f} ({seconds:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
