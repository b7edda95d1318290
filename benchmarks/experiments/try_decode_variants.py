"""Decode-kernel variants tried against the kernel in the tree (docs/notes/kernel-tries.md): each is checked
against the reference on CUDA (twice in a row, so a buffer reused across calls must come back clean), then
timed by CUDA-graph replay at the issue's shapes, and the host time of one call is measured for two.

    python3 benchmarks/experiments/try_decode_variants.py

Like ``ablate_decode.py``, the variants are edits of ``stiefkv/kernels/lowrank.py`` (applied to the kernel
in the tree, refused when a line they edit is gone):
- ``merge x4``: the split merge loads four splits per iteration (more loads in flight); measured in run 7
  and kept, so it is the kernel in the tree now and no longer a variant here;
- ``no merge (wrong)``: the last program merges only split 0 — what the merge costs (output wrong by design);
- ``persistent locks``: the split tickets live in one buffer allocated once and reset by the last program,
  instead of a ``torch.zeros`` (allocation and memset) per call;
- ``transposed scores`` (``pre_rope``): ``sᵀ = k qᵀ``, so the rebuilt keys are the A operand of the score dot
  (kept in registers) instead of the B operand (through shared memory).
Beside them, the tree's kernel with ``num_warps=8`` and with ``block_n=32`` (``pre_rope``).
"""

from __future__ import annotations

import functools
import math
import pathlib
import sys
import tempfile
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # ablate_decode beside this file; utils, bench_attention one up
import ablate_decode  # noqa: E402  (after the path insert)

SCORE = (
    "            s = _dot(q1, tl.trans(k1), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), "
    "DOT_PREC, UPCAST)\n"
    "            s = _dot(q2, tl.trans(k2), s, DOT_PREC, UPCAST)\n"
)
SCORE_T = (
    "            st = _dot(k1, tl.trans(q1), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), "
    "DOT_PREC, UPCAST)\n"
    "            st = _dot(k2, tl.trans(q2), st, DOT_PREC, UPCAST)\n"
    "            s = tl.trans(st)\n"
)
LOCKS = [
    (
        "        locks = torch.zeros(B * G * m_blocks, device=q.device, dtype=torch.int32)\n",
        "        locks = _lock_buffer(q.device, B * G * m_blocks)\n",
    ),
    (
        "        if ticket == n_splits - 1:\n",
        "        if ticket == n_splits - 1:\n"
        "            tl.atomic_xchg(LOCKS + pid_bg * tl.num_programs(0) + pid_m, 0)\n",
    ),
    (
        "def _launch(q, z_k",
        (
            "_LOCKS = {}\n\n\ndef _lock_buffer(device, n):\n    buf = _LOCKS.get(device)\n"
            "    if buf is None or buf.numel() < n:\n"
            "        buf = _LOCKS[device] = torch.zeros(max(n, 4096), device=device, dtype=torch.int32)\n"
            "    return buf\n\n\ndef _launch(q, z_k"
        ),
    ),
]
VARIANTS = {
    "tree": [],
    "no merge (wrong)": [
        (
            "    for first_split in range(0, n_splits, MERGE_UNROLL):\n",
            "    for first_split in range(0, 1):\n",
        ),
        ("        for u in tl.static_range(MERGE_UNROLL):\n", "        for u in tl.static_range(1):\n"),
    ],
    "persistent locks": LOCKS,
    "transposed scores": [(SCORE, SCORE_T)],
}
SHAPES = [(1, 32768), (8, 8192), (16, 16384), (4, 131072)]
ROWS = [("post_rope", 64), ("post_rope", 32), ("pre_rope", 64)]


def check(module, name: str, device) -> None:
    from stiefkv.kernels.reference import RopeSpec
    from stiefkv.kernels.reference import lowrank_attention as reference

    worst = 0.0
    for key_mode in ("pre_rope", "post_rope"):
        for B, H, G, Nk, d, r_k, r_v, splits in [
            (3, 32, 8, 5003, 128, 64, 40, None),
            (2, 24, 3, 777, 64, 24, 56, 7),
            (1, 32, 8, 32768, 128, 64, 64, None),
        ]:
            q = torch.randn(B, H, 1, d, device=device, dtype=torch.bfloat16)
            z_k = torch.randn(B, G, Nk, r_k, device=device, dtype=torch.bfloat16)
            z_v = torch.randn(B, G, Nk, r_v, device=device, dtype=torch.bfloat16)
            P_k = torch.linalg.qr(torch.randn(G, d, r_k, device=device))[0]
            P_v = torch.linalg.qr(torch.randn(G, d, r_v, device=device))[0]
            lengths = torch.randint(1, Nk + 1, (B,), device=device)
            lengths[0] = Nk
            pos = (torch.arange(Nk, device=device)[None] - (Nk - lengths)[:, None]).clamp(min=0) + 100
            rope = RopeSpec(1.0 / (10000.0 ** (torch.arange(0, d, 2, device=device).float() / d)), 1.15)
            kw = {
                "key_mode": key_mode,
                "positions": pos,
                "rope": rope,
                "bias": 0.5 * torch.randn(B, G, Nk, device=device),
                "lengths": lengths,
            }
            expected = reference(q, z_k, z_v, P_k, P_v, **kw).float()
            for _ in range(2):
                out = module.lowrank_attention(q, z_k, z_v, P_k, P_v, num_splits=splits, **kw).float()
                err = (out - expected).abs().max().item()
                worst = max(worst, err if not math.isnan(err) else float("inf"))  # NaN never passes
    print(f"check {name}: max abs err {worst:.4f} {'OK' if worst < 0.05 else 'FAIL'}", flush=True)


def timed_table(modules, device) -> None:
    import utils
    from bench_attention import D_HEAD, G, H, latent_inputs

    def ms_of(fn, *args, **kw) -> float:
        return utils.graph_ms(functools.partial(fn, *args, **kw))["p50"]

    cols = [*modules, "tree, 8 warps", "tree, block_n 32"]
    print("\n| B×ctx | mode | r | SDPA ms | " + " | ".join(f"{c} ms" for c in cols) + " |")
    print("|---|---|---|---|" + "---|" * len(cols))
    for B, N in SHAPES:
        q = torch.randn(B, H, 1, D_HEAD, device=device, dtype=torch.bfloat16)
        k = torch.randn(B, G, N, D_HEAD, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        sdpa = ms_of(torch.nn.functional.scaled_dot_product_attention, q, k, v, enable_gqa=True)
        del k, v
        for mode, r in ROWS:
            x = latent_inputs(B, 1, N, r)
            pre = mode == "pre_rope"
            args = (x["q"], x["z_k"], x["z_v"], x["P_k"], None)
            kw = {
                "key_mode": mode,
                "positions": x["positions"] if pre else None,
                "rope": x["rope"] if pre else None,
            }
            cells = []
            with torch.no_grad():
                for name, module in modules.items():
                    if name == "transposed scores" and not pre:
                        cells.append("–")
                        continue
                    cells.append(f"{ms_of(module.lowrank_attention, *args, **kw):.4f}")
                for tuning in ({"num_warps": 8}, {"block_n": 32}):
                    cells.append(
                        f"{ms_of(modules['tree'].lowrank_attention, *args, **kw, **tuning):.4f}"
                        if pre
                        else "–"
                    )
            print(f"| {B}×{N // 1024}k | {mode} | {r} | {sdpa:.4f} | " + " | ".join(cells) + " |", flush=True)
            del x
            torch.cuda.empty_cache()


def host_table(modules, device, calls=300) -> None:
    """Host µs per call at the 1B model's shapes (B = 1, 32k keys, d = 64, r = 32), two rounds."""
    from bench_attention import G, H

    from stiefkv.kernels.reference import RopeSpec

    n, d, r = 32768, 64, 32
    q = torch.randn(1, H, 1, d, device=device, dtype=torch.bfloat16)
    z = torch.randn(1, G, n, r, device=device, dtype=torch.bfloat16)
    P = torch.linalg.qr(torch.randn(G, d, r, device=device))[0].to(torch.bfloat16)
    pos = torch.arange(n, device=device, dtype=torch.int32)[None]
    rope = RopeSpec(1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device).float() / d)))
    print("\n| variant | mode | host µs per call | host + device µs per call |\n|---|---|---|---|")
    with torch.no_grad():
        for round_ in range(2):
            for name in ("tree", "persistent locks"):
                module = modules[name]
                for mode in ("pre_rope", "post_rope"):
                    kw = {"key_mode": mode}
                    if mode == "pre_rope":
                        kw |= {"positions": pos, "rope": rope}
                    for _ in range(10):
                        module.lowrank_attention(q, z, z, P, None, **kw)
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    for _ in range(calls):
                        module.lowrank_attention(q, z, z, P, None, **kw)
                    host = time.perf_counter() - start
                    torch.cuda.synchronize()
                    total = time.perf_counter() - start
                    print(
                        f"| {name} (round {round_}) | {mode} | {host / calls * 1e6:.0f} "
                        f"| {total / calls * 1e6:.0f} |",
                        flush=True,
                    )


def main() -> None:
    import utils

    device = torch.device("cuda")
    torch.manual_seed(0)
    print(utils.header())
    with tempfile.TemporaryDirectory() as tmp:
        modules = {
            name: ablate_decode.build(name, edits, pathlib.Path(tmp)) for name, edits in VARIANTS.items()
        }
        for name, module in modules.items():
            if "wrong" not in name:
                check(module, name, device)
        timed_table(modules, device)
        host_table(modules, device)


if __name__ == "__main__":
    main()
