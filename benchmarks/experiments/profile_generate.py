"""Where a host-bound ``generate`` step goes (Llama-3.2-1B shapes, random weights, 32k context, 50 %
``pre_rope``): decode ms/token of each of three repeats (the first shows the uncompressed model's allocator
warm-up), then a cProfile of one 17-token ``generate`` for StiefKV and for the uncompressed model.

    python benchmarks/experiments/profile_generate.py
"""

from __future__ import annotations

import cProfile
import io
import pathlib
import pstats
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import stiefkv

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench_generate import LLAMA_1B, random_projections, timed_generate


def ms_per_token(model, ids, device, repeats: int = 3, new: int = 32) -> list[float]:
    timed_generate(model, ids, 2, device)
    out = []
    for _ in range(repeats):
        prefill, _ = timed_generate(model, ids, 1, device)
        total, _ = timed_generate(model, ids, 1 + new, device)
        out.append((total - prefill) / new * 1e3)
    return out


def profile(model, ids, top: int) -> str:
    prof = cProfile.Profile()
    prof.enable()
    model.generate(ids, max_new_tokens=17, min_new_tokens=17, do_sample=False)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    config = LlamaConfig(**LLAMA_1B)
    model = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    ids = torch.randint(0, config.vocab_size, (1, 32768), device=device)
    with torch.no_grad():
        print("full ms/token per repeat:", [f"{x:.1f}" for x in ms_per_token(model, ids, device)], flush=True)
        with stiefkv.compressed(model, random_projections(model, 0.5, "pre_rope")):
            print(
                "StiefKV pre_rope ms/token per repeat:",
                [f"{x:.1f}" for x in ms_per_token(model, ids, device)],
                flush=True,
            )
            print(profile(model, ids, 25))
        print("FULL\n" + profile(model, ids, 15))


if __name__ == "__main__":
    main()
