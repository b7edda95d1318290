"""Quality table: WikiText-2 test perplexity of a model, uncompressed and with calibrated bases.

For every key mode and budget it calibrates (``stiefkv.calibrate``), then evaluates on the whole test set
(or ``--windows N``), and prints one markdown row per setting with the calibration wall time. Each row
also goes to ``benchmarks/results/quality.jsonl``.

A plain run is the whole table: 10 calibrations (5 budgets × 2 key modes, 64 × 512 tokens each) and 11
evaluations on the whole WikiText-2 test set (147 windows of 2048 tokens): hours on a 2-core CPU. A
quick CPU run takes one budget and key mode, a few windows and a small calibration set (a few minutes):

    python benchmarks/bench_quality.py smollm2 --budgets 0.5 --key-modes pre_rope --windows 2 \
        --num-sequences 8 --seq-len 256 --device cpu
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

import stiefkv
from stiefkv.attention import BACKENDS
from stiefkv.evaluate import evaluate


def main() -> None:
    ap = utils.parser(__doc__.splitlines()[0], epilog=(
        "A plain run calibrates 10 times (5 budgets x 2 key modes) and evaluates 11 times on the whole "
        "test set: hours on a 2-core CPU. A quick CPU run: --budgets 0.5 --key-modes pre_rope --windows 2 "
        "--num-sequences 8 --seq-len 256 --device cpu."))
    ap.add_argument("model", nargs="?", default="smollm2", help="an alias, a GGUF file or a model folder")
    ap.add_argument("--budgets", type=utils.comma_list(utils.share), default="1,0.75,0.5,0.375,0.25",
                    help="comma-separated KV budgets, each calibrated and evaluated")
    ap.add_argument("--key-modes", type=utils.comma_list(str), default="pre_rope,post_rope",
                    help="comma-separated key modes, each at every budget")
    ap.add_argument("--method", default="pca", help="calibration method")
    ap.add_argument("--allocation", default="uniform", help="rank allocation across layers")
    ap.add_argument("--num-sequences", type=utils.at_least(1), default=64,
                    help="calibration sequences of WikiText-2 validation")
    ap.add_argument("--seq-len", type=utils.at_least(1), default=512,
                    help="tokens per calibration sequence")
    ap.add_argument("--windows", type=utils.at_least(1), default=None,
                    help="first N test windows (default: all 147, the whole test set)")
    ap.add_argument("--window", type=utils.at_least(1), default=2048, help="tokens per test window")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="(default: cuda where available, else cpu)")
    ap.add_argument("--backend", default="reference", choices=BACKENDS,
                    help="attention backend of the compressed evaluations")
    ap.add_argument("--extra", type=utils.calibration_json, default="{}",
                    help="JSON of further calibration keywords")
    ap.add_argument("--json", default=None, help="write all results to this file")
    ap.add_argument("--tag", default="", help="appended to each row's case (a variant set by --extra)")
    args = ap.parse_args()
    utils.check_results_dir(ap)
    settings = dict(method=args.method, allocation=args.allocation, num_sequences=args.num_sequences,
                    seq_len=args.seq_len, **args.extra)
    # every row's settings, before the model loads and the uncompressed pass runs
    utils.check_calibration(ap, *(dict(settings, budget=budget, key_mode=key_mode)
                                  for key_mode in args.key_modes for budget in args.budgets))
    if args.json and not Path(args.json).expanduser().parent.is_dir():
        ap.error(f"--json {args.json}: its folder does not exist")
    if args.json and Path(args.json).expanduser().is_dir():  # it failed after every row had run
        ap.error(f"--json {args.json}: a folder, not a file")
    # the window size where it is not the default's: two runs of other window sizes wrote one case
    scored = f"w{args.windows or 'all'}" + (f" window{args.window}" if args.window != 2048 else "")

    model, tok = utils.load_model(args.model, device=args.device)
    print(utils.header())
    print(f"# {args.model} · WikiText-2 test · window {args.window}")
    print(
        f"# calibration: {args.method}, allocation {args.allocation}, {args.num_sequences} × {args.seq_len} "
        f"tokens of WikiText-2 validation, extra {args.extra}"
    )
    base = evaluate(model, tok, None, window=args.window, limit=args.windows, model_name=args.model)
    print(f"\n{base.windows} windows, {base.tokens_scored} tokens scored\n")
    print(
        "| key mode | budget | method | allocation | PPL | ΔPPL | layer rel. err | next-token KL "
        "| KV B/token | calib. s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| – | 100 % | uncompressed | – | {base.ppl_original:.4f} | – | – | – | "
        f"{base.kv_bytes_per_token_original:.0f} | – |",
        flush=True,
    )
    common = {
        "model": args.model,
        "window": args.window,
        "windows": base.windows,
        "device": args.device,
        "num_sequences": args.num_sequences,
        "seq_len": args.seq_len,
    }
    rows = [base.as_dict()]
    tag = f" {args.tag}" if args.tag else ""
    # the uncompressed row names --tag as the run's other rows do (two tagged runs wrote one case), and no
    # backend: the uncompressed pass runs the model as loaded, whatever --backend says
    utils.write_rows(
        "quality",
        {
            "case": f"{args.model} uncompressed {scored}{tag}",
            **common,
            "ppl": base.ppl_original,
            "kv_bytes_per_token": base.kv_bytes_per_token_original,
        },
    )
    for key_mode in args.key_modes:
        for budget in args.budgets:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            proj = stiefkv.calibrate(
                model,
                tok,
                budget=budget,
                method=args.method,
                key_mode=key_mode,
                allocation=args.allocation,
                num_sequences=args.num_sequences,
                seq_len=args.seq_len,
                **args.extra,
            )
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            r = evaluate(
                model,
                tok,
                proj,
                window=args.window,
                limit=args.windows,
                backend=args.backend,
                model_name=args.model,
            )
            print(
                f"| {key_mode} | {100 * budget:g} % | {args.method} | {args.allocation} | {r.ppl:.4f} | "
                f"{100 * (r.ppl / r.ppl_original - 1):+.1f} % | {r.layer_rel_error:.4f} | "
                f"{r.next_token_kl:.4f} | {r.kv_bytes_per_token:.0f} | {seconds:.1f} |",
                flush=True,
            )
            rows.append(r.as_dict() | {"calibration_seconds": seconds, "ranks": proj.ranks})
            utils.write_rows(
                "quality",
                {
                    "case": f"{args.model} {key_mode} {budget:g} {args.method} {args.allocation} "
                    f"{scored}{tag}",
                    **common,
                    "backend": args.backend,
                    "key_mode": key_mode,
                    "budget": budget,
                    "method": args.method,
                    "allocation": args.allocation,
                    "extra": args.extra,
                    **r.as_dict(),
                    "calibration_seconds": seconds,
                    "ranks": proj.ranks,
                },
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
