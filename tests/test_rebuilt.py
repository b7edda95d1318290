"""Keys rebuilt once at full width (``stiefkv/kernels/rebuilt.py``) and a prefill's keys below its queries
attended through them, against the reference, under the Triton interpreter on the CPU (FlashAttention's
CPU counterpart) and compiled where CUDA is present.

Tolerances: the rebuilt keys in float32 1e-4 (the CPU's dots are IEEE float32, the GPU's tf32: 2e-3
there), in bfloat16 one rounding of a key of magnitude ~3 (3e-2); the prefill's output and log-sum-exp
in bfloat16 1.6e-2 and 2e-2 (keys and probabilities rounded to bf16 where the reference is float32), as
the band kernel's tests state.
"""

import pytest
import torch

from stiefkv.kernels import QuantizedLatents, RopeSpec, lowrank_attention_reference
from stiefkv.quant import QuantSpec, quantize

from .utils import assert_close, compiles_for_the_gpu

pytest.importorskip("triton")
from stiefkv.kernels import lowrank, rebuilt  # noqa: E402
from stiefkv.kernels.reference import rebuild_keys as reference_keys  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KEY_TOL = {torch.float32: 1e-4 if DEVICE == "cpu" else 2e-3, torch.bfloat16: 3e-2}
TOL, LSE_TOL = 1.6e-2, 2e-2


def basis(G, d, r, gen):
    return torch.linalg.qr(torch.randn(G, d, r, generator=gen))[0]


def rope(d):
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    return RopeSpec(inv_freq.to(DEVICE), 1.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("shape", [(2, 3, 77, 64, 23), (1, 2, 130, 128, 56), (3, 1, 5, 32, 9)],
                         ids=lambda s: "x".join(map(str, s)))
def test_rebuilt_keys_match_the_reference(shape, key_mode, dtype):
    """Odd key counts and ranks, per-row positions and per-head ones ([B, G, N]), a strided view."""
    B, G, N, d, r = shape
    gen = torch.Generator().manual_seed(N)
    z = torch.randn(B, G, N + 3, r, generator=gen).to(dtype)[:, :, 3:]  # a view, as a slice is
    P = basis(G, d, r, gen)
    positions = [torch.randint(0, 9000, size, generator=gen) for size in ((B, N), (B, G, N))]
    for pos in positions if key_mode == "pre_rope" else [None]:
        args = (z.to(DEVICE), P.to(DEVICE))
        kw = dict(key_mode=key_mode, positions=None if pos is None else pos.to(DEVICE), rope=rope(d))
        keys = rebuilt.rebuild_keys(*args, **kw)
        assert keys.dtype == dtype and keys.shape == (B, G, N, d)
        tol = KEY_TOL[dtype]
        assert_close(keys, reference_keys(*args, **kw), atol=tol, rtol=tol,
                     what=f"{shape} {key_mode} positions {None if pos is None else tuple(pos.shape)}")


def codes(z, bits):
    q = quantize(z, QuantSpec(bits, "token"))
    return QuantizedLatents(q.codes, q.scale, q.low, bits, q.rank)


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("bits", [16, 4, 2])
def test_a_prefill_behind_its_keys_matches_the_reference(bits, key_mode):
    """A chunk of queries behind more keys than a slice: the slices below it go through rebuilt keys, its
    own (causal) part through the kernel; with a row's left padding the slices holding padding go
    through the kernel too. The same call with PREFILL_REBUILT empty is the kernel's path."""
    B, H, G, Nq, Nk, d, r_k, r_v = 2, 9, 3, 20, 333, 64, 24, 40
    gen = torch.Generator().manual_seed(bits)
    q = torch.randn(B, H, Nq, d, generator=gen).bfloat16().to(DEVICE)
    z_k = torch.randn(B, G, Nk, r_k, generator=gen).bfloat16().to(DEVICE)
    z_v = torch.randn(B, G, Nk, r_v, generator=gen).bfloat16().to(DEVICE)
    P_k = basis(G, d, r_k, gen).to(DEVICE)
    K, V = (z_k, z_v) if bits == 16 else (codes(z_k, bits), codes(z_v, bits))
    seen = [(K if bits == 16 else K.dequantize(torch.bfloat16)).float(),
            (V if bits == 16 else V.dequantize(torch.bfloat16)).float()]
    positions = (torch.arange(Nk)[None].expand(B, Nk) + 11).to(DEVICE)
    for lengths in (None, torch.tensor([Nk, Nk - 150], device=DEVICE)):
        kw = dict(key_mode=key_mode, positions=positions, rope=rope(d), causal=True, return_lse=True,
                  lengths=lengths)
        ref, ref_lse = lowrank_attention_reference(q.float(), *seen, P_k, None, **kw)
        for on in (True, False):
            default, lowrank.PREFILL_REBUILT = lowrank.PREFILL_REBUILT, (key_mode,) if on else ()
            try:
                out, lse = lowrank.lowrank_attention(q, K, V, P_k, None, code_slice=128, **kw)
            finally:
                lowrank.PREFILL_REBUILT = default
            what = f"int{bits} {key_mode} lengths {lengths} rebuilt {on}"
            assert_close(out, ref, atol=TOL, rtol=TOL, what=f"{what}: output")
            assert_close(lse, ref_lse, atol=LSE_TOL, rtol=LSE_TOL, what=f"{what}: log-sum-exp")


def test_the_rebuilt_path_is_taken_where_it_applies(monkeypatch):
    """Slices below the queries, whole in every row and without a bias, go through rebuilt keys; the
    queries' own keys, a slice holding a row's padding, any call with a bias and a key mode not in
    PREFILL_REBUILT do not."""
    monkeypatch.setattr(lowrank, "PREFILL_REBUILT", ("pre_rope", "post_rope"))
    calls = []
    real = rebuilt.attend_rebuilt
    monkeypatch.setattr(rebuilt, "attend_rebuilt",
                        lambda *a, **k: calls.append(a[1].shape[2]) or real(*a, **k))
    B, H, G, Nq, Nk, d, r = 1, 4, 2, 17, 300, 32, 16
    q = torch.randn(B, H, Nq, d).bfloat16().to(DEVICE)
    z = codes(torch.randn(B, G, Nk, r).bfloat16().to(DEVICE), 4)
    P = basis(G, d, r, torch.Generator().manual_seed(0)).to(DEVICE)
    kw = dict(key_mode="post_rope", causal=True, code_slice=64)
    lowrank.lowrank_attention(q, z, z, P, None, **kw)
    assert calls == [64, 64, 64, 64], calls  # 256 keys below the queries' 64-aligned own part
    calls.clear()
    lowrank.lowrank_attention(q, z, z, P, None, lengths=torch.tensor([200], device=DEVICE), **kw)
    assert calls == [64, 64], calls  # the first two slices hold the row's padding
    calls.clear()
    lowrank.lowrank_attention(q, z, z, P, None, bias=torch.zeros(B, G, Nk, device=DEVICE), **kw)
    assert calls == []
    monkeypatch.setattr(lowrank, "PREFILL_REBUILT", ("pre_rope",))
    lowrank.lowrank_attention(q, z, z, P, None, **kw)
    assert calls == []  # post_rope: the kernel


def test_the_rebuilt_path_takes_only_what_it_serves():
    """Not taken: a key basis too wide for the rebuild's shared memory (shared bases' ranks above d), float
    latents wider than the queries' dtype (float32 keeps the kernel's float32 products), value ranks above
    d, float32 queries; taken over codes and latents in the queries' dtype."""
    q = torch.randn(1, 4, 3, 128).bfloat16().to(DEVICE)
    z = {r: torch.randn(1, 2, 5, r).bfloat16().to(DEVICE) for r in (56, 128, 129, 512)}
    int4 = codes(torch.randn(1, 2, 64, 56), 4)
    for k, v in ((z[56], z[56]), (z[128], z[128]), (int4, int4)):
        assert rebuilt.takes(q, k, v)
    assert not rebuilt.takes(q, z[512], z[56])  # 4 · 512 · 128 bytes: 256 KiB
    assert not rebuilt.takes(q, z[129], z[56])  # padded to 256: 128 KiB
    assert not rebuilt.takes(q, z[56], z[129])
    assert not rebuilt.takes(q, z[56].float(), z[56]) and not rebuilt.takes(q, z[56], z[56].float())
    assert not rebuilt.takes(q.float(), z[56].float(), z[56].float())


def test_no_keys_and_a_prior_leave_the_prior(monkeypatch):
    """``n_valid`` 0 without the causal part: the one empty slice goes to the kernel (FlashAttention over no
    keys gives a log-sum-exp of +inf on CUDA and stops the CPU's), so the result is the prior's attention
    and log-sum-exp. A prior beside a value basis is refused on the sliced path as on the kernel's."""
    monkeypatch.setattr(lowrank, "PREFILL_REBUILT", ("pre_rope",))
    gen = torch.Generator().manual_seed(5)
    B, H, G, Nq, Nk, d, r = 1, 4, 2, 40, 300, 64, 24
    q = torch.randn(B, H, Nq, d, generator=gen).bfloat16().to(DEVICE)
    z = torch.randn(B, G, Nk, r, generator=gen).bfloat16().to(DEVICE)
    P = basis(G, d, r, gen).to(DEVICE)
    prior = (torch.randn(B, H, Nq, r, generator=gen).bfloat16().to(DEVICE),
             torch.randn(B, H, Nq, generator=gen).to(DEVICE))
    kw = dict(key_mode="pre_rope", positions=torch.arange(Nk)[None].to(DEVICE), rope=rope(d), causal=False,
              code_slice=64)
    none = torch.tensor([0], dtype=torch.int32, device=DEVICE)
    out, lse = lowrank.lowrank_attention(q, z, z, P, None, n_valid=none, prior=prior, return_lse=True, **kw)
    assert_close(out, prior[0], atol=TOL, rtol=TOL, what="output over no keys")
    assert_close(lse, prior[1], atol=1e-6, rtol=1e-6, what="log-sum-exp over no keys")
    with pytest.raises(ValueError, match="pass P_v=None"):
        lowrank.lowrank_attention(q, z, z, P, P, prior=prior, **kw)


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stiefkv.kernels import rebuilt

def case(dtype, pre, d, r):
    types = dict(Z=dtype, P="*fp32", POS="*i64", INV_FREQ="*fp32", OUT=dtype, scaling="fp32")
    consts = dict(R=r, R_P2=max(16, triton.next_power_of_2(r)), HALF=d // 2, BLOCK=rebuilt.BLOCK_N,
                  PRE_ROPE=pre, DOT_PREC="tf32")
    names = rebuilt._rebuild_keys_fwd.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=rebuilt._rebuild_keys_fwd, signature=sig,
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"], "no cubin"

case("*bf16", True, 128, 56)
case("*bf16", False, 64, 24)
case("*fp16", True, 64, 9)
case("*fp32", True, 32, 16)
print("compiled")
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA compiles and runs the kernel in the tests above")
def test_the_rebuild_kernel_compiles_for_the_gpu():
    """Without a GPU, the rebuild kernel compiled to an sm_90 cubin by Triton's own compiler and ptxas
    (both key modes, bf16/fp16/fp32 latents, tf32 products as on the device): the interpreter runs neither
    the compiler's type checks nor its dot shape rules. A fresh cache directory, so it really compiles."""
    compiles_for_the_gpu(COMPILE)
