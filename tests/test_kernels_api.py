"""``stiefkv.kernels``' public functions: which path they take, and that both paths agree.

The choice follows the inputs' device (``backend="auto"``), never ``TRITON_INTERPRET``, which conftest.py
sets on machines without CUDA: CPU callers must not reach Triton's interpreter. ``backend="triton"``
forces the kernel (interpreted on the CPU), ``"reference"`` the PyTorch reference.
"""

import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import stiefkv.kernels as kernels

from .utils import assert_close

ROOT = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_kernel_on_cpu = pytest.mark.skipif(not INTERPRETED, reason="kernels run on the CPU interpreted only")


def _kl_inputs(device="cpu", grad=False):
    shapes = ((1, 4, 13, 16), (1, 2, 13, 16), (1, 4, 13, 24), (1, 1, 13, 24))
    return [torch.randn(s, device=device).requires_grad_(grad) for s in shapes]


def _attention_inputs(device="cpu", grad=False):
    """Decode over 21 keys, GQA 2, ranks 8 and 24, ``pre_rope``; returns args and keyword arguments."""
    B, H, G, Nk, d = 2, 4, 2, 21, 32
    q = torch.randn(B, H, 1, d, device=device).requires_grad_(grad)
    z_k, z_v = torch.randn(B, G, Nk, 8, device=device), torch.randn(B, G, Nk, 24, device=device)
    P_k = torch.linalg.qr(torch.randn(G, d, 8))[0].to(device)
    P_v = torch.linalg.qr(torch.randn(G, d, 24))[0].to(device)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    kwargs = dict(key_mode="pre_rope", positions=torch.arange(Nk, device=device).expand(B, Nk),
                  rope=kernels.RopeSpec(inv_freq.to(device)), lengths=torch.tensor([Nk, 9], device=device))
    return (q, z_k, z_v, P_k, P_v), kwargs


@pytest.fixture
def kernel_calls(monkeypatch):
    """Count the calls that reach the Triton modules' functions (the kernels still run)."""
    from stiefkv.kernels import lowrank, streamkl

    calls = []
    for module, name in ((lowrank, "lowrank_attention"), (streamkl, "attention_kl")):
        real = getattr(module, name)
        def counted(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)
        monkeypatch.setattr(module, name, counted)
    return calls


def test_public_api():
    assert set(kernels.__all__) == {"BACKENDS", "KEY_MODES", "CodesAndBand", "ExactTail", "QuantizedLatents",
                                    "RopeSpec", "attention_kl", "attention_kl_reference", "kernel_runs",
                                    "lowrank_attention", "lowrank_attention_reference", "rope_latent",
                                    "rope_latent_reference", "triton_available"}


def test_kernel_runs_follows_the_device_and_the_backend():
    """What the served layer asks before taking the fused rotation: never on CPU tensors under ``auto`` nor
    under ``reference``; under ``triton`` wherever Triton imports (the interpreter here)."""
    x = torch.zeros(2)
    assert not kernels.kernel_runs("auto", x) and not kernels.kernel_runs("reference", x)
    assert kernels.kernel_runs("triton", x) == kernels.triton_available()
    with pytest.raises(ValueError, match="backend must be one of"):
        kernels.kernel_runs("cuda", x)
    assert kernels.BACKENDS == ("auto", "triton", "reference")
    assert kernels.KEY_MODES == ("pre_rope", "post_rope")
    pytest.importorskip("triton")
    import stiefkv.kernels.lowrank  # noqa: F401
    import stiefkv.kernels.streamkl  # noqa: F401

    # Importing the kernel modules sets package attributes of their names: none may shadow a function.
    assert inspect.isfunction(kernels.lowrank_attention) and inspect.isfunction(kernels.attention_kl)
    for name in ("lowrank_attention", "attention_kl"):
        assert inspect.signature(getattr(kernels, name)).parameters["backend"].default == "auto"


def test_import_does_not_import_triton():
    """In a fresh interpreter: the package and a CPU call through it never import Triton, even with
    ``TRITON_INTERPRET=1`` in the environment."""
    script = textwrap.dedent("""
        import sys
        import torch
        import stiefkv.kernels as K
        q = torch.randn(1, 2, 5, 16)
        K.attention_kl(q, q, q, q)
        P = torch.linalg.qr(torch.randn(2, 16, 8))[0]
        K.lowrank_attention(q, torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8), P, P, key_mode="post_rope")
        assert "triton" not in sys.modules, "triton was imported"
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_cpu_tensors_take_the_reference(backend, kernel_calls):
    """``auto`` on CPU tensors is the reference, bit for bit, whatever ``TRITON_INTERPRET`` says."""
    kl_in = _kl_inputs(grad=True)
    out = kernels.attention_kl(*kl_in, reduction="none", backend=backend)
    assert torch.equal(out, kernels.attention_kl_reference(*kl_in, reduction="none"))
    args, kwargs = _attention_inputs()
    out = kernels.lowrank_attention(*args, **kwargs, backend=backend)
    assert torch.equal(out, kernels.lowrank_attention_reference(*args, **kwargs))
    assert kernel_calls == []


@needs_kernel_on_cpu
def test_triton_backend_reaches_the_kernels_on_cpu(kernel_calls):
    """``backend="triton"`` runs the kernels on CPU tensors under the interpreter; they match the reference,
    gradients of StreamKL included."""
    kl_in = _kl_inputs(grad=True)
    out = kernels.attention_kl(*kl_in, backend="triton")
    ref = kernels.attention_kl_reference(*kl_in)
    assert_close(out, ref, 2e-4, 1e-4, what="kl")
    for g, r in zip(torch.autograd.grad(out, kl_in), torch.autograd.grad(ref, kl_in)):
        assert_close(g, r, 1e-4, 1e-3, what="kl gradient")
    args, kwargs = _attention_inputs()
    out = kernels.lowrank_attention(*args, **kwargs, backend="triton")
    assert_close(out, kernels.lowrank_attention_reference(*args, **kwargs), what="attention")
    assert kernel_calls == ["attention_kl", "lowrank_attention"]


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_tensors_take_the_kernels(kernel_calls):
    kl_in = _kl_inputs("cuda")
    assert_close(kernels.attention_kl(*kl_in), kernels.attention_kl_reference(*kl_in), 2e-4, 1e-4, what="kl")
    args, kwargs = _attention_inputs("cuda")
    out = kernels.lowrank_attention(*args, **kwargs)
    assert_close(out, kernels.lowrank_attention_reference(*args, **kwargs), what="attention")
    assert kernel_calls == ["attention_kl", "lowrank_attention"]
    # The attention kernel has no backward: `auto` takes the reference when autograd needs one.
    args, kwargs = _attention_inputs("cuda", grad=True)
    out = kernels.lowrank_attention(*args, **kwargs)
    assert out.requires_grad and kernel_calls == ["attention_kl", "lowrank_attention"]
    with pytest.raises(RuntimeError, match="inference-only"):
        kernels.lowrank_attention(*args, **kwargs, backend="triton")


def test_auto_decision():
    """The decision itself, for devices this machine may not have: CUDA → the kernel where Triton imports,
    unless a gradient is needed from the forward-only attention kernel; anything else → the reference."""
    use = kernels._use_kernel
    assert use("auto", torch.device("cuda")) == kernels.triton_available()
    assert not use("auto", torch.device("cuda"), needs_grad=True)
    assert not use("auto", torch.device("cpu"))
    assert not use("auto", torch.device("meta"))
    assert not use("reference", torch.device("cuda"))


def test_bad_backend_is_named():
    kl_in = _kl_inputs()
    with pytest.raises(ValueError, match="'cuda'"):
        kernels.attention_kl(*kl_in, backend="cuda")
    args, kwargs = _attention_inputs()
    with pytest.raises(ValueError, match="'Triton'"):
        kernels.lowrank_attention(*args, **kwargs, backend="Triton")


def test_triton_backend_without_triton(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs triton"):
        kernels.attention_kl(*_kl_inputs(), backend="triton")
    assert torch.isfinite(kernels.attention_kl(*_kl_inputs(), backend="auto"))


@needs_kernel_on_cpu
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_exact_band_splits_between_the_kernel_and_the_reference(key_mode, dtype, monkeypatch):
    """A chunk of 19 queries over 83 keys whose last 30 (the chunk and an exact window) each query reads
    exact from its own index on: the kernel below the band and the reference on the band, merged by their
    log-sum-exp, give the reference's attention over all keys (left padding with rows of pads among the
    queries, GQA 3, ranks 25 and 41, a bias, per-head positions)."""
    from stiefkv.kernels import ExactTail, lowrank_attention_reference

    B, H, G, Nq, Nk, Ne, d, r_k, r_v = 3, 6, 2, 19, 83, 30, 64, 25, 41
    q = torch.randn(B, H, Nq, d).to(dtype)
    exact_k, exact_v = torch.randn(B, G, Ne, r_k), torch.randn(B, G, Ne, r_v)
    z_k, z_v = torch.randn(B, G, Nk, r_k), torch.randn(B, G, Nk, r_v)
    z_k[:, :, Nk - Ne:] = exact_k + 0.05 * torch.randn_like(exact_k)  # the band as stored: quantized
    z_v[:, :, Nk - Ne:] = exact_v + 0.05 * torch.randn_like(exact_v)
    z_k, z_v, exact_k, exact_v = (t.to(dtype) for t in (z_k, z_v, exact_k, exact_v))
    P_k = torch.linalg.qr(torch.randn(G, d, r_k))[0]
    P_v = torch.linalg.qr(torch.randn(G, d, r_v))[0]
    query_index = torch.arange(Nk - Nq, Nk)
    band = ExactTail(exact_k, exact_v, (query_index + 1 - 5).clamp(min=Nk - Ne),
                     (query_index + 1 - 9).clamp(min=Nk - Ne))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    kwargs = dict(key_mode=key_mode, rope=kernels.RopeSpec(inv_freq, 1.1), causal=True,
                  positions=torch.stack([torch.randperm(400)[:Nk].sort().values for _ in range(B * G)]
                                        ).view(B, G, Nk),
                  bias=0.3 * torch.randn(B, G, Nk), lengths=torch.tensor([Nk, 70, 12]))  # row 3: pads among q
    splits = []
    monkeypatch.setattr(kernels, "_below_and_band",
                        lambda *a, _f=kernels._below_and_band, **k: splits.append(1) or _f(*a, **k))
    with torch.no_grad():
        pv = P_v if dtype == torch.bfloat16 else None  # the output through P_v, or in latent space
        out = kernels.lowrank_attention(q, z_k, z_v, P_k, pv, exact=band, backend="triton", **kwargs)
        expected = lowrank_attention_reference(q, z_k, z_v, P_k, pv, exact=band, **kwargs)
    assert splits == [1]
    atol = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}[dtype]
    assert_close(out, expected, atol=atol, rtol=atol, what=f"{key_mode} {dtype}")
    assert torch.equal(out[2, :, : Nq - 12], torch.zeros_like(out[2, :, : Nq - 12]))  # pad queries: 0


@needs_kernel_on_cpu
def test_a_band_shorter_than_the_queries_is_not_split(monkeypatch):
    """Causal queries older than the band's first key do not see every key below it: such a call stays whole
    in the reference (Ne 3 < Nq 8)."""
    from stiefkv.kernels import ExactTail, lowrank_attention_reference

    B, H, G, Nq, Nk, Ne, r = 1, 2, 1, 8, 20, 3, 16
    q = torch.randn(B, H, Nq, 32)
    z_k, z_v = torch.randn(B, G, Nk, r), torch.randn(B, G, Nk, r)
    band = ExactTail(torch.randn(B, G, Ne, r), torch.randn(B, G, Ne, r), torch.full((Nq,), Nk - Ne),
                     torch.full((Nq,), Nk - 1))
    P_k = torch.linalg.qr(torch.randn(G, 32, r))[0]
    splits = []
    monkeypatch.setattr(kernels, "_below_and_band", lambda *a, **k: splits.append(1))
    with torch.no_grad():
        out = kernels.lowrank_attention(q, z_k, z_v, P_k, None, key_mode="post_rope", exact=band,
                                        backend="triton")
        expected = lowrank_attention_reference(q, z_k, z_v, P_k, None, key_mode="post_rope", exact=band)
    assert not splits
    assert_close(out, expected, atol=1e-5, rtol=1e-5, what="band shorter than the queries")


def _rope_inputs(B, N, H, G, d, r, dtype, device="cpu"):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    q = torch.randn(B, N, H, d, device=device, dtype=dtype)
    k = torch.randn(B, N, G, d, device=device, dtype=dtype)
    P = torch.linalg.qr(torch.randn(G, d, r))[0].to(device)
    cfg = LlamaConfig(hidden_size=H * d, num_attention_heads=H, num_key_value_heads=G, head_dim=d)
    positions = torch.randint(0, 20000, (B, N), device=device)
    cos, sin = LlamaRotaryEmbedding(cfg).to(device)(q, positions)
    return q, k, cos, sin, P


ROPE_TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}  # bf16: one rounding of each output


@pytest.mark.skipif(not (INTERPRETED or CUDA), reason="the kernel runs on CUDA or interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(2, 3, 12, 4, 64, 29), (1, 5, 10, 2, 32, 17), (3, 1, 8, 8, 128, 56)],
                         ids=lambda s: "B{}N{}H{}G{}d{}r{}".format(*s))
def test_rope_latent_kernel_matches_the_reference_and_the_pytorch_path(shape, dtype):
    """The fused rotation (queries) and rotation and projection (``post_rope`` keys) against the reference,
    and against the served layer's PyTorch path (``rotate_with``, ``to_latent``: the model's dtype between
    them); GQA 3, 5 and 1, ranks that are not powers of two; queries alone as well."""
    from stiefkv.layers import rotate_with, to_latent

    B, N, H, G, d, r = shape
    q, k, cos, sin, P = _rope_inputs(B, N, H, G, d, r, dtype, "cuda" if CUDA else "cpu")
    q_ref, z_ref = kernels.rope_latent_reference(q, k, cos, sin, P)
    q_out, z = kernels.rope_latent(q, k, cos, sin, P, backend="triton")
    atol, rtol = ROPE_TOL[dtype]
    assert q_out.shape == (B, H, N, d) and z.shape == (B, G, N, r) and z.dtype == dtype
    assert_close(q_out, q_ref, atol=atol, rtol=rtol, what="rotated queries")
    assert_close(z, z_ref, atol=atol, rtol=rtol, what="post_rope key latents")
    old_q = rotate_with(q.transpose(1, 2), cos, sin)
    old_z = to_latent(rotate_with(k.transpose(1, 2), cos, sin), P)
    assert_close(q_out, old_q, atol=atol, rtol=rtol, what="rotated queries against rotate_with")
    assert_close(z, old_z, atol=2 * atol, rtol=2 * rtol, what="key latents against to_latent(rotate_with)")
    q_only, none = kernels.rope_latent(q, None, cos, sin, None, backend="triton")
    assert none is None  # one program a token on its own: the compiler may contract differently (H200)
    assert_close(q_only, q_out, atol=atol, rtol=rtol, what="queries alone against queries with keys")
    shared = kernels.rope_latent(q, k, cos[:1], sin[:1], P, backend="triton")  # positions shared by rows
    expected = kernels.rope_latent_reference(q, k, cos[:1].expand_as(cos), sin[:1].expand_as(sin), P)
    for got, want in zip(shared, expected):
        assert_close(got, want, atol=atol, rtol=rtol, what="cos, sin of one row for every row")


def test_rope_latent_refuses_mismatched_shapes():
    q, k, cos, sin, P = _rope_inputs(1, 2, 4, 2, 32, 8, torch.float32)
    with pytest.raises(ValueError, match="k and P together"):
        kernels.rope_latent(q, k, cos, sin, None)
    with pytest.raises(ValueError, match="cos, sin"):
        kernels.rope_latent(q, k, cos[:, :1], sin, P)
    with pytest.raises(ValueError, match="G dividing H"):
        kernels.rope_latent(q, k[:, :, :1].expand(1, 2, 3, 32), cos, sin, P)


def _small(B=2, H=4, G=2, Nq=3, Nk=5, d=8, r=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, z_k, z_v = (torch.randn(*s, generator=g) for s in ((B, H, Nq, d), (B, G, Nk, r), (B, G, Nk, r)))
    P_k, P_v = (torch.linalg.qr(torch.randn(G, d, r, generator=g))[0] for _ in range(2))
    rope = kernels.RopeSpec(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
    return q, z_k, z_v, P_k, P_v, dict(positions=torch.arange(Nk)[None].expand(B, Nk), rope=rope,
                                       backend="reference")


def test_the_reference_keeps_nan_and_zeros_only_rows_without_keys():
    """The reference turned every NaN of its output into 0 (a NaN value latent gave a finite answer, the
    kernel NaN), and merging by log-sum-exp dropped a NaN side. Rows that see no key are still 0."""
    from stiefkv.kernels._common import merge_by_lse

    q, z_k, z_v, P_k, P_v, kw = _small()
    z_v[0, 0, 1, 0] = float("nan")
    out = kernels.lowrank_attention(q, z_k, z_v, P_k, P_v, **kw)
    assert out[0, :2].isnan().all() and not out[1].isnan().any()  # the NaN's KV head, not the other row
    q, z_k, z_v, P_k, P_v, kw = _small()
    out = kernels.lowrank_attention(q, z_k, z_v, P_k, P_v, lengths=torch.tensor([0, 3]), **kw)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()
    bias = torch.zeros(2, 2, 5)
    bias[1, 0] = float("-inf")  # every key of one KV head hidden
    out = kernels.lowrank_attention(q, z_k, z_v, P_k, P_v, bias=bias, **kw)
    assert torch.equal(out[1, :2], torch.zeros_like(out[1, :2])) and not out.isnan().any()
    nan, inf = float("nan"), float("inf")
    one, zero = torch.ones(1, 2), torch.zeros(1, 2)
    assert merge_by_lse(one, torch.tensor([nan]), zero, torch.tensor([0.0]), torch.float32).isnan().all()
    none = torch.tensor([-inf])
    assert torch.equal(merge_by_lse(one, none, zero, none, torch.float32), zero)
    empty = kernels.lowrank_attention(*_small(B=0)[:5], **_small(B=0)[5])
    assert empty.shape == (0, 4, 3, 8)


@pytest.mark.parametrize("bad, message", [
    ({"z_v": lambda t: t[:, :1]}, "must be \\[B=2, G, Nk, r\\] with the same B, G and Nk"),
    ({"P_k": lambda t: t[:1]}, "P_k must be \\[G=2, d=8, r_k=4\\]"),
    ({"P_v": lambda t: torch.cat([t, t], 1)}, "P_v must be \\[G=2, d=8, r_v=4\\]"),
    ({"q": lambda t: t.long()}, "q must be a floating-point"),
    ({"positions": lambda t: t[:, None]}, "positions must be integers"),
    ({"positions": lambda t: t.float()}, "positions must be integers"),
    ({"lengths": torch.tensor([2.5, 3.0])}, "lengths must be an integer tensor"),
    ({"n_valid": torch.tensor([-1])}, "n_valid must lie in 0..Nk=5"),
    ({"bias": torch.zeros(2, 5)}, "bias must be \\[B=2, G=2, Nk=5\\]"),
])
def test_the_reference_refuses_what_the_kernel_refuses(bad, message):
    """The reference broadcast mismatched latents, bases and positions silently (or failed inside torch),
    where the kernel refused them: code tested on the CPU then broke on the GPU."""
    q, z_k, z_v, P_k, P_v, kw = _small()
    args = {"q": q, "z_k": z_k, "z_v": z_v, "P_k": P_k, "P_v": P_v}
    for name, change in bad.items():
        if name in args:
            args[name] = change(args[name])
        elif name == "positions":
            kw["positions"] = change(kw["positions"])
        else:
            kw[name] = change
    with pytest.raises(ValueError, match=message):
        kernels.lowrank_attention(*args.values(), **kw)
