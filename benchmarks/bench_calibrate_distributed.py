"""Wall time of `stiefkv.calibrate` across processes, per phase, on a model of given shapes, random weights.

Launch it the way a user launches calibration, once per process count, and compare the rows:

    torchrun --standalone --nproc-per-node 1 benchmarks/bench_calibrate_distributed.py --layers 8
    torchrun --standalone --nproc-per-node 2 benchmarks/bench_calibrate_distributed.py --layers 8

Default shapes are Llama-3-8B's (hidden 4096, 32 query heads, 8 KV heads, d = 128, MLP 14336; ``--layers`` of
its 32) with 128 random sequences × 2048 tokens and the calibration defaults. Rank 0 draws the weights and
broadcasts them, so every process holds the same model. The phases are timed around the pipeline's own
functions (CUDA synchronised, all processes waiting for each other): the first pass (PCA and the ``kl``
profiles), the allocation, the second pass (Stiefel refinement). Random weights say nothing about quality.
Rank 0 appends one row to ``benchmarks/results/calibrate_distributed.jsonl`` (``STIEFKV_RESULTS_DIR``
elsewhere).
"""

from __future__ import annotations

import time

import torch
import utils  # benchmarks/utils.py: the script's folder is first on sys.path

import stiefkv
import stiefkv.calibrate.pipeline as pipeline
from stiefkv.calibrate import distributed


def synced(everyone: bool = True) -> float:
    """The time once this process's GPU work is done (and, with ``everyone``, every process's)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if everyone and torch.distributed.is_initialized():
        torch.distributed.barrier()
    return time.perf_counter()


def timed(seconds: dict, name: str, fn, everyone: bool = True):
    def wrapper(*args, **kwargs):
        t0 = synced(everyone)
        out = fn(*args, **kwargs)  # an error propagates: no barrier the other processes never reach
        seconds[name] = seconds.get(name, 0.0) + synced(everyone) - t0
        return out
    return wrapper


def main() -> None:
    ap = utils.parser(__doc__.splitlines()[0])
    utils.add_llama_shape_args(ap)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--extra", default="", help="calibration keywords, e.g. steps=20,bits=16")
    args = ap.parse_args()
    utils.check_results_dir(ap)
    extra = utils.calibration_keywords(args.extra)  # a bad setting stops here, before any model is built
    device = distributed.init_from_env(args.device)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    leader = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if leader:
        print(utils.header(), flush=True)
    model = utils.random_llama(args, device, getattr(torch, args.dtype))
    if world > 1:
        for p in model.parameters():  # rank 0's weights everywhere
            torch.distributed.broadcast(p.data, src=0)
    seqs = torch.randint(0, model.config.vocab_size, (args.sequences, args.seq_len),
                         generator=torch.Generator().manual_seed(0))
    seconds: dict[str, float] = {}
    for name in ("first_pass", "second_pass"):
        setattr(pipeline, name, timed(seconds, name, getattr(pipeline, name)))
    # rank 0 alone allocates (the others wait for its broadcast): no barrier inside it
    pipeline.choose_allocation = timed(seconds, "choose_allocation", pipeline.choose_allocation,
                                       everyone=False)
    peak = None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = synced()
    proj = stiefkv.calibrate(model, None, sequences=seqs, **extra)
    total = synced() - t0
    if torch.cuda.is_available():
        peak = torch.cuda.max_memory_allocated() / 2**30
    distributed.wait_for_all()
    if not leader:
        return
    row = {
        "case": f"L{args.layers} D{args.hidden} H{args.heads} G{args.kv_heads} "
                f"{args.sequences}x{args.seq_len} {args.dtype} {args.extra}".strip() + f" world{world}",
        "world": world, "layers": args.layers, "sequences": args.sequences, "seq_len": args.seq_len,
        "dtype": args.dtype, "extra": extra, "seconds": total,
        "phases": {k: round(v, 2) for k, v in seconds.items()}, "peak_gib_rank0": peak,
        "ranks": [list(r) for r in proj.ranks], "storage": [[str(q) for q in p] for p in proj.specs],
    }
    utils.write_rows("calibrate_distributed", row)
    print(f"{row['case']}: {total:.1f} s; phases {row['phases']}; peak {peak} GiB", flush=True)


if __name__ == "__main__":
    main()
    distributed.leave()
