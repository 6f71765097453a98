"""scaled_dot_product_attention's fused kernels side by side: flash, memory-efficient and cuDNN, forward
and forward+backward, causal, on the reference Llama step's attention and the anchors' shape.

    python benchmarks/bench_sdpa_backends.py

Each backend is forced with torch.nn.attention.sdpa_kernel; a backend that refuses the inputs is a row
saying so. Errors: ||out - ref|| / ||ref|| (and the same for dq, dk, dv) against the math backend in fp64.
Layouts: "bhsd", q, k, v and the output's gradient contiguous as (batch, heads, length, dim); "bshd", each
a transposed view of a contiguous (batch, length, heads, dim) tensor, as HF's attention hands them over (the
projections' outputs viewed per head; the output's gradient comes back from o_proj's input that way);
"bshd+copy": those made contiguous before the call (the copies timed too).
"""
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from common import bench_ms, env, kernels_ms, save, table

SHAPES = {  # name: (batch, heads, kv heads, length, head dim)
    "llama_ref": (2, 32, 8, 2048, 64),
    "anchor_d128": (4, 16, 16, 2048, 128),
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION}


def randn(b, h, s, d, layout, g):
    if layout == "bhsd":
        return torch.randn(b, h, s, d, device="cuda", generator=g, dtype=torch.bfloat16)
    return torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16).transpose(1, 2)


def inputs(b, h, kv, s, d, gqa: bool, layout: str, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = randn(b, h, s, d, layout, g), randn(b, kv, s, d, layout, g), randn(b, kv, s, d, layout, g)
    if not gqa and kv != h:
        k, v = (t.repeat_interleave(h // kv, dim=1) for t in (k, v))
        if layout != "bhsd":
            k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k, v))
    return [t.detach().requires_grad_() for t in (q, k, v)]


def run(q, k, v, gqa, dout, copy=False):
    qc, kc, vc = (t.contiguous() for t in (q, k, v)) if copy else (q, k, v)
    out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=gqa)
    return out, torch.autograd.grad(out, (q, k, v), dout.contiguous() if copy else dout)


def rel(a, b) -> float:
    return round(((a.float() - b.float()).norm() / b.float().norm()).item(), 5)


def case(name, shape, gqa, layout):
    b, h, kv, s, d = shape
    copy = layout.endswith("+copy")
    q, k, v = inputs(*shape, gqa, layout.removesuffix("+copy"))
    dout = randn(b, h, s, d, layout.removesuffix("+copy"), torch.Generator(device="cuda").manual_seed(1))
    with sdpa_kernel(SDPBackend.MATH):
        ref_out, ref_grads = run(*(t.detach().double().requires_grad_() for t in (q, k, v)), gqa, dout.double())
    flops = 4 * b * h * s * s * d / 2  # causal: half the square
    rows = []
    for label, backend in BACKENDS.items():
        row = dict(shape=name, gqa=gqa, layout=layout, backend=label)
        try:
            with sdpa_kernel(backend):
                out, grads = run(q, k, v, gqa, dout, copy)
                fwd = bench_ms(lambda: F.scaled_dot_product_attention(
                    *((t.contiguous() for t in (q, k, v)) if copy else (q, k, v)), is_causal=True, enable_gqa=gqa))
                both = bench_ms(lambda: run(q, k, v, gqa, dout, copy))
                row["kernels"] = [k for k, _, _ in kernels_ms(lambda: run(q, k, v, gqa, dout, copy), top=3)]
        except RuntimeError as e:
            row["fwd_ms"] = f"refused: {str(e).splitlines()[0][:60]}"
            rows.append(row)
            continue
        row.update(fwd_ms=round(fwd, 3), fwd_bwd_ms=round(both, 3), fwd_TFLOPs=round(flops / fwd / 1e9),
                   fwd_bwd_TFLOPs=round(3.5 * flops / both / 1e9), err_out=rel(out, ref_out),
                   err_dq=rel(grads[0], ref_grads[0]), err_dk=rel(grads[1], ref_grads[1]),
                   err_dv=rel(grads[2], ref_grads[2]))
        rows.append(row)
        print(row, flush=True)
    return rows


def main():
    rows = []
    for name, shape in SHAPES.items():
        for gqa in ((True, False) if shape[1] != shape[2] else (False,)):
            for layout in ("bhsd", "bshd", "bshd+copy"):
                rows += case(name, shape, gqa, layout)
    save(os.environ.get("BENCH_NAME", "sdpa_backends.json"), {"env": env(), "rows": rows})
    print(env())
    for r in rows:
        print(r["shape"], r["gqa"], r["layout"], r["backend"], r.get("kernels"))
    print(table(rows, ["shape", "gqa", "layout", "backend", "fwd_ms", "fwd_bwd_ms", "fwd_TFLOPs", "fwd_bwd_TFLOPs",
                       "err_out", "err_dq", "err_dk", "err_dv"]))


if __name__ == "__main__":
    main()
