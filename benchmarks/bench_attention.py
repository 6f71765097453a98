"""Hand-written attention, fwd+bwd: eager vs Inductor vs fusion, with SDPA as the reference.

    python benchmarks/bench_attention.py [--seq 512 2048 8192] [--spellings ...]
B4 H16 D128 bf16 (the anchors' shape at S=2048). GPU time (profiler kernel sum) and peak memory of
one fwd+bwd; each implementation is checked against SDPA first.
"""
import argparse
import math

import torch
import torch.nn.functional as F

import fusion_compiler as fc
from common import bench_gpu_ms, env, save, table


def causal_triu(q, k, v):
    n = q.size(-2)
    masked = torch.triu(torch.ones(n, n, dtype=torch.bool, device=q.device), diagonal=1)
    return torch.softmax((q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))).masked_fill(masked, float("-inf")), -1) @ v


def hf_eager_mask(q, k, v, mask):
    w = torch.matmul(q, k.transpose(2, 3)) * q.size(-1) ** -0.5 + mask
    return torch.matmul(torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def no_mask(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * q.size(-1) ** -0.5, -1) @ v


DEV = "cuda"

SPELLINGS = {"causal_triu": (causal_triu, True, False), "hf_additive_mask": (hf_eager_mask, True, True),
             "no_mask": (no_mask, False, False)}


def run(seqs, names):
    rows = []
    for s in seqs:
        b = max(1, 8192 // s) if s > 2048 else 4
        q, k, v = (torch.randn(b, 16, s, 128, device=DEV, dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = torch.randn_like(q)
        for name in names:
            fn, causal, masked = SPELLINGS[name]
            args = [q, k, v]
            if masked:
                args.append(torch.zeros(s, s, device=DEV, dtype=torch.bfloat16).masked_fill(
                    torch.ones(s, s, device=DEV, dtype=torch.bool).triu(1), float("-inf"))[None, None])
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            impls = {"sdpa": lambda *a: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                     "eager": fn, "inductor": torch.compile(fn, dynamic=False),
                     "fusion": torch.compile(fn, backend=fc.backend(), dynamic=False)}
            for impl, f in impls.items():
                if impl == "eager" and s > 4096:
                    continue  # the S x S scores of eager at 8192 take minutes to time
                out = f(*args)
                err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()

                def step():
                    torch.autograd.grad(f(*args), (q, k, v), g)
                step()
                if DEV == "cpu":
                    rows.append(dict(spelling=name, seq=s, impl=impl, rel_err=f"{err:.1e}"))
                    continue
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step()
                peak = (torch.cuda.max_memory_allocated() - base) / 2**30
                ms = bench_gpu_ms(step, iters=10)
                flops = 4 * b * 16 * s * s * 128 * 3.5 * (0.5 if causal else 1)
                rows.append(dict(spelling=name, seq=s, batch=b, impl=impl, fwdbwd_ms=round(ms, 3),
                                 TFLOPs=round(flops / ms / 1e9), extra_peak_GiB=round(peak, 2), rel_err=f"{err:.1e}"))
                print(rows[-1], flush=True)
            torch.compiler.reset()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[2048])
    ap.add_argument("--spellings", nargs="+", default=list(SPELLINGS))
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no timings)")
    a = ap.parse_args()
    global DEV
    DEV = a.device
    rows = run(a.seq, a.spellings)
    save("attention.json", {"env": env(), "rows": rows})
    print(env())
    print(table(rows, ["spelling", "seq", "batch", "impl", "fwdbwd_ms", "TFLOPs", "extra_peak_GiB", "rel_err"]))


if __name__ == "__main__":
    main()
