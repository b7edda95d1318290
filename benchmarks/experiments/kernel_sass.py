"""Static cost of the decode kernel, without a GPU: compile ``_lowrank_attn_fwd`` for sm_90 (H100/H200) with
Triton's bundled ptxas, then report registers, stack (spills) and the SASS instruction mix of each key loop.

    python benchmarks/experiments/kernel_sass.py [--r 64] [--block-n 64] [--warps 4] [--stages 3]

Integer strides that are 1 at run time are compiled as the constant 1 and the others as multiples of 16, as
Triton's JIT specialises them, so loads vectorise as they do on the device. A loop's count is instructions
per thread for one iteration (the key loops are shown first: unmasked tiles, then the masked tail;
then the loops of the split merge the last program of a tile runs). On an SM with two
programs of 4 warps, one tile per program costs ``count`` issue cycles per scheduler, against
``tile bytes / (bandwidth per SM)`` cycles of memory: the ratio says whether a variant is issue-bound.
This is a model, not a timing: benchmarks/bench_attention.py on the GPU decides. The device image runs
triton 3.6, whose counts differ: ``pip install --no-deps --target DIR triton==3.6.0`` and run this with
``PYTHONPATH=DIR`` to compile as it does.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile

os.environ.setdefault(
    "TRITON_DEFAULT_FP_FUSION", "1"
)  # the JIT's default; set here only to silence its warning
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from stiefkv.kernels import lowrank as lk

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
UNIT_STRIDES = (
    "stride_qd",
    "stride_kr",
    "stride_vr",
    "stride_pkr",
    "stride_pvr",
    "stride_posn",
    "stride_bn",
    "stride_od",
)
POINTERS = {
    "Q": "bf16",
    "ZK": "bf16",
    "ZV": "bf16",
    "PK": "fp32",
    "PV": "fp32",
    "POS": "i64",
    "INV_FREQ": "fp32",
    "BIAS": "bf16",
    "LENS": "i32",
    "OUT": "bf16",
    "PART_O": "fp32",
    "PART_ML": "fp32",
    "LOCKS": "i32",
    "NVALID": "i32",
    "SK": "fp16",
    "LK": "fp16",
    "SV": "fp16",
    "LV": "fp16",
    "LSE": "fp32",
    "PRIOR_O": "bf16",
    "PRIOR_LSE": "fp32",
}


def compile_decode(
    key_mode: str,
    r: int,
    block_n: int,
    warps: int,
    stages: int,
    fast_sincos: bool,
    d: int = 128,
    group: int = 4,
    fn=None,
    bits: int = 16,
    prefetch: bool = False,
    fold: bool = False,
    nibbles: bool = False,
    nibble_rebuild: bool = False,
    nibble_fold: bool = False,
    log8: bool = False,
    keys_left: bool = False,
    late_v: bool = False,
    k_channel: bool = False,
    v_bits: int | None = None,
    v_log8: bool | None = None,
    channel_rows: bool = False,
    planes: bool = False,
    v_planes: bool | None = None,
    nibble_words: bool = False,
    sincos_fadd: bool = False,
    max_registers: int | None = None,
    ahead: bool = False,
):
    """The split-decode variant of the kernel (latent output, no bias, no padding) as the device compiles it;
    ``fn`` another build of ``_lowrank_attn_fwd`` (benchmarks/experiments/ablate_decode.py's variants);
    ``k_channel``: key codes in the channel layout (a scale and low per channel and 64 tokens); ``v_bits``,
    ``v_log8``: the values' codes where they differ from the keys'; ``channel_rows``: the channel layout's
    scales read as a row a token group (the launcher's ``channel_rows``); ``planes``: int2 codes read as words
    and met as bit planes (the launcher's ``planes``, and for int3 its ``int3_planes``; ``v_planes``: the
    values' where it differs);
    ``nibble_words``: int4 nibbles read as 32-bit words (the launcher's ``nibble_words``); ``sincos_fadd``:
    the angles' whole turns rounded on the FMA pipe (the launcher's ``sincos_fadd``; with ``fast_sincos``);
    ``max_registers``: a ceiling on registers a thread (the launcher's ``max_registers``, ptxas's maxnreg);
    ``ahead``: ``pre_rope`` logits one tile ahead (the launcher's ``ahead``; float latents, no prefetch)."""
    if sincos_fadd and not fast_sincos:
        raise ValueError("sincos_fadd changes the hardware sin/cos's reduction: it needs fast_sincos")
    fn = fn or lk._lowrank_attn_fwd
    v_bits = bits if v_bits is None else v_bits
    v_log8 = log8 if v_log8 is None else v_log8
    const = {
        "GROUP": group,
        "HEAD_DIM": d,
        "R_K": r,
        "R_V": r,
        "R_K_P2": r,
        "R_V_P2": r,
        "BLOCK_M": lk.DECODE_BLOCK_M,
        "BLOCK_N": block_n,
        "KEY_MODE": 0 if key_mode == "pre_rope" else 1,
        "CAUSAL": True,
        "HAS_BIAS": False,
        "HAS_LENS": False,
        "HAS_PV": False,
        "SPLIT": True,
        "FAST_SINCOS": lk.sincos_mode(fast_sincos, sincos_fadd),
        "DOT_PREC": "tf32",
        "UPCAST": False,
        "HAS_NVALID": False,
        "K_BITS": bits,
        "V_BITS": v_bits,
        "DTYPE": lk.tl.float16 if bits < 16 else lk.tl.bfloat16,  # as _launch picks it
        "FOLD_K": fold and key_mode == "post_rope",
        "FOLD_V": fold,
        "PREFETCH": prefetch,
        "HAS_LSE": False,
        "K_CH": (2 if channel_rows or planes else 1) if k_channel else 0,  # planes take the rows (launcher)
        "V_CH": False,
        "NIB_K": nibbles and not k_channel and (key_mode == "post_rope" or nibble_rebuild),
        "FOLD_NIB": nibble_fold and nibbles and prefetch and key_mode == "post_rope",
        "K_LOG8": log8,
        "V_LOG8": v_log8,
        "NIB_V": nibbles and v_bits in (4, 8),
        "KEYS_LEFT": keys_left and key_mode == "pre_rope",
        # constexprs with defaults the launch sets too: left out, they compiled as run-time integers (and
        # a branch on LATE_V then read a name only its other branch defines)
        "K_UNIT": 1,
        "V_UNIT": 1,
        "HAS_PRIOR": False,
        "LATE_V": late_v and prefetch,
        "K_PLANES": planes and bits in (2, 3),  # int3: the launcher's int3_planes
        "V_PLANES": (planes if v_planes is None else v_planes) and v_bits in (2, 3),
        "K_NIBW": nibble_words and nibbles and bits == 4 and not k_channel and prefetch
        and (key_mode == "post_rope" or nibble_rebuild),
        "V_NIBW": nibble_words and nibbles and v_bits == 4 and prefetch,
        "AHEAD": ahead and key_mode == "pre_rope" and bits == 16 and not prefetch,
    }
    const = {k: v for k, v in const.items() if k in fn.arg_names}  # older builds (ablate_decode.py)
    const.update({name: 1 for name in UNIT_STRIDES + ("stride_skgr", "stride_svgr")})
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name == "ZK" and bits < 16 or name == "ZV" and v_bits < 16 or \
                name in ("SK", "LK") and log8 or name in ("SV", "LV") and v_log8:
            sig[name] = "*u8"
        elif name in POINTERS:
            sig[name] = "*" + POINTERS[name]
        else:
            sig[name] = "fp32" if name in ("qk_scale", "rope_scaling") else "i32"
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if sig[name] != "constexpr" and (name in POINTERS or name.startswith("stride") or name == "rows_pad")
    }
    src = ASTSource(
        fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in const.items()}, attrs=attrs
    )
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages,
                 **({"maxnreg": max_registers} if max_registers else {})},
    )


def _opcode(line: str) -> str | None:
    m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9]+)", line)
    return m.group(1) if m else None


def loop_mixes(sass: str) -> list[collections.Counter]:
    """Instruction mix of the body of every backward branch (a loop), in program order."""
    lines = sass.splitlines()
    labels, loops = {}, []
    for i, line in enumerate(lines):
        label = re.match(r"^\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = i
        branch = re.search(r"BRA\s+`?\(?(\.L_x_\d+)", line)
        if branch and labels.get(branch.group(1), i) < i:
            loops.append(
                collections.Counter(op for op in map(_opcode, lines[labels[branch.group(1)] : i + 1]) if op)
            )
    return loops


def report(kernel) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run(
            [f"{BIN}/cuobjdump", "--dump-resource-usage", path], capture_output=True, text=True, check=True
        ).stdout
        sass = subprocess.run(
            [f"{BIN}/nvdisasm", "-c", path], capture_output=True, text=True, check=True
        ).stdout
    reg, stack = (re.search(rf"{key}:(\d+)", usage).group(1) for key in ("REG", "STACK"))
    total = sum(1 for line in sass.splitlines() if _opcode(line))
    loops = [mix for mix in loop_mixes(sass) if sum(mix.values()) > 50]
    counts = " / ".join(str(sum(mix.values())) for mix in loops)
    top = ", ".join(f"{op} {n}" for op, n in loops[0].most_common(8)) if loops else ""
    return f"| {reg} | {stack} | {total} | {counts} | {top} |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--r", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--max-registers", type=int, default=None, metavar="N",
                    help="a ceiling on registers a thread (the launcher's max_registers)")
    ap.add_argument("--codes", action="store_true",
                    help="post_rope over bf16 latents, int8 and int4 codes: plain, prefetched, folded, "
                         "int4 as even and odd channels (nibbles), int8 words as channel pairs (pairs)")
    ap.add_argument("--channel", type=int, nargs="*", metavar="BITS",
                    help="keys in the channel layout at these widths (default 2 3 4), values int2 per token "
                         "on log8 scales (--bits auto's low budgets, a125), both key modes; per-element "
                         "scales, channel_rows, and at 2 and 3 bits planes (int3_planes at 3); then int3 "
                         "keys in the token layout, byte-wise and as planes")
    args = ap.parse_args()
    if args.max_registers is not None and not 24 <= args.max_registers <= 255:
        ap.error(f"--max-registers {args.max_registers}: ptxas takes a ceiling of 24 to 255 a thread")
    print(
        f"sm_90, triton {triton.__version__}; decode, d = 128, GQA 4, r_k = r_v = {args.r}, "
        f"block_n {args.block_n}, "
        f"{args.warps} warps, {args.stages} stages\n"
    )
    print(
        "| variant | registers | stack bytes | instructions in the kernel "
        "| instructions per loop iteration (key "
        "tiles unmasked / masked, then the split merge) | top of the unmasked loop |"
    )
    print("|---|---|---|---|---|---|")
    if args.channel is not None:
        for bits in args.channel or (2, 3, 4):
            for key_mode in ("post_rope", "pre_rope"):
                for rows, planes in ((False, False), (True, False), (True, True)):
                    if planes and bits not in (2, 3):
                        continue
                    kernel = compile_decode(key_mode, args.r, args.block_n, args.warps, args.stages,
                                            key_mode == "pre_rope", bits=bits, prefetch=True, k_channel=True,
                                            v_bits=2, v_log8=True, channel_rows=rows, planes=planes)
                    name = f"{key_mode} int{bits}-channel keys" + (" (channel_rows)" if rows else "") \
                        + (" planes" if planes else "")
                    print(f"| {name}, int2-log8 values, prefetch " + report(kernel), flush=True)
        if 3 in (args.channel or (2, 3, 4)):  # a125's int3 token-layout keys, its values int2 planes
            for key_mode in ("post_rope", "pre_rope"):
                for planes in (False, True):
                    kernel = compile_decode(key_mode, args.r, args.block_n, args.warps, args.stages,
                                            key_mode == "pre_rope", bits=3, prefetch=True, v_bits=2,
                                            v_log8=True, planes=planes, v_planes=True)
                    name = f"{key_mode} int3-token keys" + (" planes" if planes else "")
                    print(f"| {name}, int2-log8 values (planes), prefetch " + report(kernel), flush=True)
        return
    if args.codes:
        for bits in (16, 8, 4):
            for prefetch, fold, nib, nib_fold in ((False, False, False, False), (True, False, False, False),
                                                  (False, True, False, False), (False, False, True, False),
                                                  (True, False, True, False), (True, False, True, True)):
                # int8 with nibbles: the kernel's pairs loop (int8 read as words, NIB_K/NIB_V at 8 bits),
                # which the launcher takes with prefetch only
                if (fold and bits == 16) or (nib and (bits == 16 or bits == 8 and not prefetch)) or (
                        nib_fold and (bits != 4 or args.r > lk.QUANT_GROUP)):  # the fold: one scale group
                    continue
                kernel = compile_decode("post_rope", args.r, args.block_n, args.warps, args.stages, False,
                                        bits=bits, prefetch=prefetch, fold=fold, nibbles=nib,
                                        nibble_fold=nib_fold)
                name = f"post_rope {'bf16' if bits == 16 else f'int{bits}'}" \
                    + (" prefetch" if prefetch else "") + (" fold" if fold else "") \
                    + ((" pairs" if bits == 8 else " nibbles") if nib else "") \
                    + (" nibble_fold" if nib_fold else "")
                print(f"| {name} " + report(kernel), flush=True)
        for nib, rebuild in ((False, False), (True, False), (True, True)):  # pre_rope (fast sin/cos)
            kernel = compile_decode("pre_rope", args.r, args.block_n, args.warps, args.stages, True, bits=4,
                                    prefetch=True, nibbles=nib, nibble_rebuild=rebuild)
            name = "pre_rope int4 prefetch" + (" nibbles" if nib else "") + (" rebuild" if rebuild else "")
            print(f"| {name} " + report(kernel), flush=True)
        for key_mode in ("post_rope", "pre_rope"):  # int4 nibbles read as 32-bit words
            kernel = compile_decode(key_mode, args.r, args.block_n, args.warps, args.stages,
                                    key_mode == "pre_rope", bits=4, prefetch=True, nibbles=True,
                                    nibble_rebuild=True, nibble_words=True)
            print(f"| {key_mode} int4 prefetch nibbles words " + report(kernel), flush=True)
        for key_mode in ("post_rope", "pre_rope"):  # the defaults over int4 codes with log8 scales
            kernel = compile_decode(key_mode, args.r, args.block_n, args.warps, args.stages,
                                    key_mode == "pre_rope", bits=4, prefetch=True, nibbles=True, log8=True)
            print(f"| {key_mode} int4 log8 prefetch nibbles " + report(kernel), flush=True)
        return
    for key_mode, fast, left, fadd, ahead in (
            ("post_rope", False, False, False, False), ("pre_rope", False, False, False, False),
            ("pre_rope", True, False, False, False), ("pre_rope", True, True, False, False),
            ("pre_rope", True, True, True, False), ("pre_rope", True, True, True, True),
            ("pre_rope", True, False, True, True)):
        kernel = compile_decode(key_mode, args.r, args.block_n, args.warps, args.stages, fast, keys_left=left,
                                sincos_fadd=fadd, max_registers=args.max_registers, ahead=ahead)
        name = key_mode + (" fast_sincos" if fast else "") + (" keys_left" if left else "") \
            + (" sincos_fadd" if fadd else "") + (" ahead" if ahead else "")
        print(f"| {name} " + report(kernel), flush=True)


if __name__ == "__main__":
    main()
