"""The ``heads_per_program`` option of the ``pre_rope`` decode kernel (several KV heads per program share each
key tile's sin/cos and softmax step), checked against the reference on CUDA, then timed by CUDA-graph replay
beside the kernel without it (BENCHMARKS.md §2, run 7; measured slower, the option was reverted after).

    git show afcda05:kernels/lowrank_attention.py > /tmp/base.py    # the kernel before the option
    python3 benchmarks/try_heads_per_program.py /tmp/base.py
"""
import datetime, importlib.util, pathlib, sys, tempfile
sys.path.insert(0, str(pathlib.Path(__file__).parent))
import torch
from bench_attention import graph_ms, rope_spec, latent_inputs, H, G, D_HEAD
from stiefkv.kernels.reference import lowrank_attention as reference, RopeSpec
from stiefkv.kernels import lowrank_attention as lk

src = pathlib.Path(sys.argv[1]).read_text().replace("from .reference import", "from stiefkv.kernels.reference import")
path = pathlib.Path(tempfile.mkdtemp()) / "_head_copy.py"; path.write_text(src)
spec = importlib.util.spec_from_file_location("_head_copy", path); base = importlib.util.module_from_spec(spec)
sys.modules["_head_copy"] = base; spec.loader.exec_module(base)

dev = torch.device("cuda")
torch.manual_seed(0)
print(f"{torch.cuda.get_device_name(dev)}; {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; torch {torch.__version__}", flush=True)

# correctness at realistic sizes, bf16 and fp16, with bias/padding/P_v
for dtype in (torch.bfloat16, torch.float16):
    for heads in (1, 2, 4):
        worst = 0.0
        for (B, Hh, Gg, Nk, d, rk, rv, splits, pv) in [(3, 32, 8, 5003, 128, 64, 40, None, True), (2, 24, 8, 777, 64, 24, 56, 7, False),
                                                      (1, 32, 8, 32768, 128, 64, 64, None, True), (2, 64, 8, 4000, 128, 56, 32, None, False)]:
            if (Hh // Gg) * heads > 16: continue
            q = torch.randn(B, Hh, 1, d, device=dev, dtype=dtype)
            zk = torch.randn(B, Gg, Nk, rk, device=dev, dtype=dtype); zv = torch.randn(B, Gg, Nk, rv, device=dev, dtype=dtype)
            Pk = torch.linalg.qr(torch.randn(Gg, d, rk, device=dev))[0]
            Pv = torch.linalg.qr(torch.randn(Gg, d, rv, device=dev))[0] if pv else None
            lengths = torch.randint(1, Nk + 1, (B,), device=dev); lengths[0] = Nk
            pos = (torch.arange(Nk, device=dev)[None] - (Nk - lengths)[:, None]).clamp(min=0) + 100
            rope = RopeSpec(1.0 / (500000.0 ** (torch.arange(0, d, 2, device=dev).float() / d)), 1.15)
            bias = 0.5 * torch.randn(B, Gg, Nk, device=dev)
            kw = dict(key_mode="pre_rope", positions=pos, rope=rope, bias=bias, lengths=lengths)
            ref = reference(q, zk, zv, Pk, Pv, **kw).float()
            try:
                with torch.no_grad():
                    out = lk.lowrank_attention(q, zk, zv, Pk, Pv, num_splits=splits, heads_per_program=heads, **kw).float()
                err = (out - ref).abs().max().item()
            except Exception as e:
                print("  case", (B, Hh, Gg, Nk, d, rk, rv), type(e).__name__, str(e)[:120]); continue
            worst = max(worst, err if err == err else float("inf"))
        print(f"check {dtype} heads {heads}: max abs err {worst:.4f} {'OK' if worst < 0.05 else 'FAIL'}", flush=True)

SHAPES = [(1, 32768), (8, 8192), (16, 16384), (4, 131072)]
CFGS = [("HEAD copy", None), ("tree h1", dict(heads_per_program=1)),
        ("h2", dict(heads_per_program=2)), ("h2 bn32", dict(heads_per_program=2, block_n=32)),
        ("h2 st2", dict(heads_per_program=2, num_stages=2)),
        ("h4", dict(heads_per_program=4)), ("h4 bn32", dict(heads_per_program=4, block_n=32)),
        ("h4 bn32 st2", dict(heads_per_program=4, block_n=32, num_stages=2)),
        ("h2 S×2", dict(heads_per_program=2, splits_x=2)), ("h4 S×2", dict(heads_per_program=4, splits_x=2))]
print("\n| B×ctx | r | SDPA ms | " + " | ".join(n for n, _ in CFGS) + " |")
print("|---|---|---|" + "---|" * len(CFGS))
rope = rope_spec(dev)
for B, N in SHAPES:
    q = torch.randn(B, H, 1, D_HEAD, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, G, N, D_HEAD, device=dev, dtype=torch.bfloat16); v = torch.randn_like(k)
    sdpa = graph_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    del k, v
    for r in (64, 32):
        q, zk, zv, Pk, Pv, pos = latent_inputs(B, 1, N, r, dev)
        kw = dict(key_mode="pre_rope", positions=pos, rope=rope)
        cells = []
        with torch.no_grad():
            for name, cfg in CFGS:
                try:
                    if cfg is None:
                        ms = graph_ms(lambda: base.lowrank_attention(q, zk, zv, Pk, None, **kw))
                    else:
                        cfg = dict(cfg)
                        if "splits_x" in cfg:
                            x = cfg.pop("splits_x")
                            c = lk._default_config(cfg["heads_per_program"], N, "pre_rope", B * G // cfg["heads_per_program"], lk._num_sms(dev), r)
                            cfg["num_splits"] = c["num_splits"] * x
                        ms = graph_ms(lambda: lk.lowrank_attention(q, zk, zv, Pk, None, **kw, **cfg))
                    cells.append(f"{ms:.4f}")
                except Exception as e:
                    cells.append("ERR " + type(e).__name__)
        print(f"| {B}×{N // 1024}k | {r} | {sdpa:.4f} | " + " | ".join(cells) + " |", flush=True)
        del zk, zv
        torch.cuda.empty_cache()
