"""Compressed-context perplexity of attention-matching compaction and the eviction baselines, one run.

Each chunk of WikiText-2 test is ``context + score`` tokens: the context is prefilled, its cache compacted
to ``keep`` of its tokens per KV head (``stiefkv.longcontext``), and the next ``score`` tokens are scored in
one forward on top of it, against the same chunk uncompressed. Methods: ``am`` (attention matching, with its
variants by ``--variants``), the eviction ``attention`` (the most-attended keys of the same reference
queries), and kvpress's presses (``stiefkv.presses``). One row per method, with the options it ran with, to
``benchmarks/results/compaction.jsonl`` (``STIEFKV_RESULTS_DIR`` elsewhere).

    python benchmarks/bench_compaction.py smollm2 --context 1024 --chunks 3 --device cpu
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

from stiefkv.compacted import DEFAULT_PIN
from stiefkv.compaction import METHODS as AM_METHODS
from stiefkv.compaction import effective_options
from stiefkv.longcontext import DEFAULT_WINDOW, evaluate_compacted, evaluate_retrieval
from stiefkv.longcontext import METHODS as METHOD_NAMES

DEFAULT_SCORE = 512  # the scored tokens of every committed row: render's tables and claims read only these

# variants of AM's defaults (stiefkv.compaction.AM_DEFAULTS), and of the eviction by the same queries
VARIANTS = {
    "am": {}, "am omp": {"selection": "omp"}, "am no-beta": {"fit_beta": False},
    "am no-refit": {"refit_values": False}, "am global": {"allocation": "global"},
    "am layers": {"allocation": "layers"}, "am uniform": {"allocation": "uniform"},
    "am mean": {"pooling": "mean"}, "am max": {"pooling": "max"}, "am nnls": {"solver": "nnls"},
    "am global max": {"allocation": "global", "pooling": "max"},
    "am block1024": {"block": 1024}, "am block2048": {"block": 2048}, "am block4096": {"block": 4096},
    "am first": {"allocation": "uniform", "pooling": "mean", "solver": "nnls"},  # the first harness's AM
    "am study256": {"self_study": 256}, "am repeat": {"repeat": (8192, 1)},
    "am repeat2": {"repeat": (8192, 2)}, "am repeat4": {"repeat": (8192, 4)},
    # past the positions (C 7680 on SmolLM2) in segments after 256 tokens of lead-in instead of 64
    "am repeat lead256": {"repeat": (8192, 1, 256)},
    # past the positions in one reading at positions beyond the model's (RoPE extrapolated)
    "am repeat past": {"repeat": (8192, 1, 0, True)},
    # the prompt's most surprising tokens held exact (β = 0) in a share of the kept entries (pin0: none, AM's
    # default before the fifteenth session; the default is a tenth, at least 64, at most a quarter, none below
    # 128 kept entries)
    "am pin0": {"pin": 0}, "am pin0.1": {"pin": 0.1}, "am pin0.15": {"pin": 0.15},
    "am pin0.25": {"pin": 0.25}, "am pin0.5": {"pin": 0.5},
    "am repeat pin0.1": {"repeat": (8192, 1), "pin": 0.1},
    "attention study256": {"self_study": 256},
    # self-study after a generic instruction about the text (never the task's question), greedy
    "am facts64": {"self_study": 64, "study_prompt": "\n\nSummarize the key facts of the text above.\n",
                   "study_greedy": True},
    "am recite64": {"self_study": 64, "study_prompt": "\n\nRepeat the text above word for word:\n",
                    "study_greedy": True},
    "attention global rms": {"allocation": "global", "pooling": "rms"},
    "attention layers-max rms": {"allocation": "layers-max", "pooling": "rms"},
}


def main() -> None:
    ap = utils.parser(__doc__.splitlines()[0])
    ap.add_argument("model", help="an alias, a GGUF file or a model folder")
    ap.add_argument("--context", type=utils.at_least(1), default=4096,
                    help="prefilled tokens per chunk, compacted")
    ap.add_argument("--score", type=utils.at_least(1), default=DEFAULT_SCORE,
                    help="tokens scored per chunk after the compacted context")
    ap.add_argument("--keep", type=utils.share, default=0.1, help="share of the context's tokens kept")
    ap.add_argument("--chunks", type=utils.at_least(1), default=None, help="first N chunks (default: all)")
    ap.add_argument("--window", type=utils.at_least(1), default=DEFAULT_WINDOW,
                    help="the compaction's window (stiefkv.longcontext)")
    ap.add_argument("--methods", type=utils.comma_list(str, METHOD_NAMES),
                    default="am,attention,expected_attention,snapkv,streaming_llm,tova,knorm",
                    help=f"comma-separated, of {', '.join(METHOD_NAMES)}")
    ap.add_argument("--variants", default=[],
                    type=utils.comma_list(lambda v: v.replace("_", " "), list(VARIANTS)),
                    help=f"comma-separated variants of {', '.join(VARIANTS)} ('_' for ' ')")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="(default: cuda where available, else cpu)")
    ap.add_argument("--task", choices=["ppl", "retrieval"], default="ppl",
                    help="compressed-context perplexity, or pass-key retrieval (rows to retrieval.jsonl)")
    ap.add_argument("--samples", type=utils.at_least(1), default=20,
                    help="pass-key prompts (--task retrieval)")
    ap.add_argument("--seed", type=int, default=0, help="of the pass-key prompts")
    ap.add_argument("--projections", default=None,
                    help="a checkpoint: compact the served model's latent cache (ranks × tokens)")
    args = ap.parse_args()
    utils.check_results_dir(ap)
    if args.projections and args.task == "retrieval":
        ap.error("--projections compacts a served model's cache for --task ppl; retrieval runs the model as "
                 "loaded: drop one of them")
    if args.projections and not Path(args.projections).is_file():
        ap.error(f"--projections {args.projections}: no such checkpoint file")
    print(utils.header(), flush=True)
    torch.set_grad_enabled(False)
    model, tok = utils.load_model(args.model, device=args.device)
    runs = [(m, {}) for m in args.methods] + [(v, VARIANTS[v]) for v in args.variants]
    for name, options in runs:
        if args.task == "retrieval":
            retrieval_row(model, tok, args, name, options)
            continue
        t0 = time.perf_counter()
        r = evaluate_compacted(model, tok, context=args.context, score=args.score, keep=args.keep,
                               method=name.split()[0], chunks=args.chunks, window=args.window,
                               projections=args.projections, **_tokenized(tok, options))
        # a score other than the default's and a model other than the default are named: a --score 128
        # run wrote the case of the 512-token rows of its context, and render merged them
        row = {"case": f"{name} C{args.context} keep{args.keep:g}"
               + (f" chunks{args.chunks}" if args.chunks else "")
               + (f" score{args.score}" if args.score != DEFAULT_SCORE else "") + _window(args)
               + (f" {Path(args.projections).stem}" if args.projections else "")
               + utils.model_case(args.model) + f" {args.device}",
               **r.as_dict(), "method": name, "model": utils.model_name(args.model),
               "options": _recorded(name.split()[0], options), "window": args.window,
               "seconds": time.perf_counter() - t0}
        utils.write_rows("compaction", row)
        print(f"{row['case']}: PPL {r.ppl:.3f} (uncompressed {r.ppl_full:.3f}, served whole {r.ppl_ranks}, "
              f"bytes {r.bytes_fraction:.4f}), {r.kept_tokens} of "
              f"{args.context} tokens kept ({r.held_tokens:.0f} held), {r.chunks} chunks, "
              f"{row['seconds']:.0f} s", flush=True)


def _recorded(method: str, options: dict) -> dict:
    """A row's options, for AM's methods: the fit's over its defaults and ``pin`` as it was resolved (the
    default's share, floor and cap, so a later default cannot take the row for its own)."""
    if method not in AM_METHODS:
        return {}
    pin = options.get("pin")
    if pin is None:
        pin = DEFAULT_PIN if method == "am" else 0
    return {**effective_options(method, options), "pin": pin}


def _tokenized(tok, options: dict) -> dict:
    """``options`` with a study prompt's text as token ids (rows keep the text)."""
    if isinstance(options.get("study_prompt"), str):
        ids = tok(options["study_prompt"], add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        return {**options, "study_prompt": ids}
    return options


def _window(args) -> str:
    return f" w{args.window}" if args.window != DEFAULT_WINDOW else ""


def retrieval_row(model, tok, args, name: str, options: dict) -> None:
    t0 = time.perf_counter()
    method = name.split()[0]
    r = evaluate_retrieval(model, tok, context=args.context, keep=args.keep, method=method,
                           samples=args.samples, seed=args.seed, window=args.window,
                           **_tokenized(tok, options))
    row = {"case": f"{name} passkey C{args.context} keep{args.keep:g} n{args.samples}{_window(args)}"
                   f"{utils.model_case(args.model)} {args.device}",
           **r.as_dict(), "method": name, "model": utils.model_name(args.model),
           "options": _recorded(method, options),
           "window": args.window, "seconds": time.perf_counter() - t0}
    utils.write_rows("retrieval", row)
    print(f"{row['case']}: accuracy {r.accuracy:.2f} (uncompressed {r.accuracy_full:.2f}), "
          f"{row['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
