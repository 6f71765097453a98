"""Norm / elementwise kernels: fwd and fwd+bwd time and achieved GB/s, ours vs eager, Inductor, Liger.

    python benchmarks/bench_norm_elementwise.py [--hidden 2048 4096 8192] [--tokens 32768]

Bytes counted (the fused minimum): fwd = inputs + outputs; fwd+bwd adds output grads + inputs re-read
+ input grads. Every implementation is checked against eager before it is timed. GPU times are the
profiler's summed kernel durations (no CPU overhead); wall_fwdbwd_us is the plain loop, CPU dispatch included.
"""
import argparse

import torch
import torch.nn.functional as F

import fusion_compiler  # noqa: F401  (registers torch.ops.fusion)
from common import bench_gpu_ms, bench_ms, env, save, table

DT = torch.bfloat16


def _liger():
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction  # noqa: F401
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.layer_norm import LigerLayerNorm
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        return dict(rms=LigerRMSNorm, ln=LigerLayerNorm, rope=liger_rotary_pos_emb, swiglu=LigerSiLUMulFunction)
    except ImportError:
        return None


def hf_rms(x, w, eps=1e-6):
    dt = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dt)


def add_rms(x, r, w, eps=1e-6):
    h = x + r
    return hf_rms(h, w, eps), h


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def hf_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def fusion_rope(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.ops.fusion.rope(q, cos, sin, False), torch.ops.fusion.rope(k, cos, sin, False)


def swiglu(g, u):
    return F.silu(g) * u


def swiglu_packed(x):
    g, u = x.chunk(2, -1)
    return F.silu(g) * u


def cases(tokens, hidden, lib):
    """(kernel, inputs, grad-requiring inputs, {impl: fn}, bytes fwd, bytes fwd+bwd)."""
    dev = "cuda"
    x = torch.randn(tokens, hidden, device=dev, dtype=DT, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True)
    w = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, device=dev, dtype=DT))
    b = torch.nn.Parameter(0.1 * torch.randn(hidden, device=dev, dtype=DT))
    nb = x.numel() * x.element_size()
    out = []
    impl = {"eager": hf_rms, "fusion": lambda x, w: torch.ops.fusion.rms_norm(x, w, 1e-6)[0]}
    if lib:
        m = lib["rms"](hidden, eps=1e-6).to(dev, DT)
        m.weight = w
        impl["liger"] = lambda x, w: m(x)
    out.append(("rms_norm", (x, w), impl, 2 * nb, 5 * nb))
    impl = {"eager": add_rms, "fusion": lambda x, r, w: torch.ops.fusion.add_rms_norm(x, r, w, 1e-6)[:2]}
    out.append(("add_rms_norm", (x, r, w), impl, 4 * nb, 8 * nb))
    impl = {"eager": lambda x, w, b: F.layer_norm(x, (hidden,), w, b, 1e-5),
            "fusion": lambda x, w, b: torch.ops.fusion.layer_norm(x, w, b, 1e-5)[0]}
    if lib:
        ln = lib["ln"](hidden, eps=1e-5).to(dev, DT)
        ln.weight, ln.bias = w, b
        impl["liger"] = lambda x, w, b: ln(x)
    out.append(("layer_norm", (x, w, b), impl, 2 * nb, 5 * nb))
    heads, kv, d = hidden // 128, max(1, hidden // 512), 128
    bsz, seq = max(1, tokens // 2048), min(tokens, 2048)
    q = torch.randn(bsz, seq, heads, d, device=dev, dtype=DT).transpose(1, 2).requires_grad_()
    k = torch.randn(bsz, seq, kv, d, device=dev, dtype=DT).transpose(1, 2).requires_grad_()
    pos = torch.arange(seq, device=dev, dtype=torch.float32)
    freqs = pos[:, None] / (10000 ** (torch.arange(0, d, 2, device=dev) / d))[None]
    emb = torch.cat((freqs, freqs), -1)[None].expand(bsz, seq, d)
    cos, sin = emb.cos().to(DT), emb.sin().to(DT)
    qk = (q.numel() + k.numel()) * 2
    impl = {"eager": hf_rope, "fusion": fusion_rope}
    if lib:
        impl["liger"] = lambda q, k, cos, sin: lib["rope"](q, k, cos, sin)
    out.append(("rope", (q, k, cos, sin), impl, 2 * qk, 4 * qk))
    g = torch.randn(tokens, hidden, device=dev, dtype=DT, requires_grad=True)
    u = torch.randn_like(g, requires_grad=True)
    impl = {"eager": swiglu, "fusion": lambda g, u: torch.ops.fusion.glu(g, u, "silu")}
    if lib:
        impl["liger"] = lambda g, u: lib["swiglu"].apply(g, u)
    out.append(("glu_silu", (g, u), impl, 3 * nb, 8 * nb))
    gu = torch.randn(tokens, 2 * hidden, device=dev, dtype=DT, requires_grad=True)
    impl = {"eager": swiglu_packed, "fusion": lambda x: torch.ops.fusion.glu_packed(x, "silu", True)}
    out.append(("glu_silu_packed", (gu,), impl, 3 * nb, 8 * nb))
    return out


def _flat(o):
    return list(o) if isinstance(o, (tuple, list)) else [o]


def copy_bandwidth() -> float:
    """The card's ceiling for these kernels: a 2 GiB device-to-device copy, bytes read + written."""
    src = torch.randn(2**29, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_gpu_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / ms / 1e6


def run(tokens, hiddens, only=None):
    import fusion_compiler as fc
    lib = _liger()
    rows = [dict(kernel="copy", impl="torch", fwd_GBps=round(copy_bandwidth()))]
    print(rows[0], flush=True)
    for hidden in hiddens:
        for kernel, inputs, impls, b_fwd, b_fb in cases(tokens, hidden, lib):
            if only and kernel not in only:
                continue
            liger = impls.pop("liger", None)
            impls["inductor"] = torch.compile(impls["eager"], dynamic=False)
            impls["fusion(backend)"] = torch.compile(impls["eager"], backend=fc.backend(cost_model="always"),
                                                     dynamic=False)
            if liger is not None:  # last, on its own copies: Liger's RoPE/SwiGLU write into their inputs
                impls["liger"] = liger
            ref = [o.float() for o in _flat(impls["eager"](*inputs))]
            gouts = [torch.randn_like(o).to(DT) for o in ref]
            for name, fn in impls.items():
                args = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs] \
                    if name == "liger" else inputs
                grads_in = [t for t in args if t.requires_grad]
                outs = _flat(fn(*args))
                err = max(((o.float() - r).norm() / r.norm()).item() for o, r in zip(outs, ref))

                def step():
                    o = _flat(fn(*args))
                    torch.autograd.grad(o, grads_in, gouts, allow_unused=True)
                step()
                fwd, fb = bench_gpu_ms(lambda: fn(*args)), bench_gpu_ms(step)
                wall = bench_ms(step)
                rows.append(dict(kernel=kernel, hidden=hidden, impl=name,
                                 fwd_us=round(fwd * 1e3, 1), fwd_GBps=round(b_fwd / fwd / 1e6),
                                 fwdbwd_us=round(fb * 1e3, 1), fwdbwd_GBps=round(b_fb / fb / 1e6),
                                 wall_fwdbwd_us=round(wall * 1e3, 1), rel_err=f"{err:.1e}"))
                print(rows[-1], flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--kernels", nargs="+", default=None, help="only these (default: all)")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = run(a.tokens, a.hidden, a.kernels)
    save("norm_elementwise.json", {"env": env(), "tokens": a.tokens, "kernels": a.kernels, "rows": rows})
    print(env())
    print(table(rows, ["kernel", "hidden", "impl", "fwd_us", "fwd_GBps", "fwdbwd_us", "fwdbwd_GBps",
                       "wall_fwdbwd_us", "rel_err"]))


if __name__ == "__main__":
    main()
