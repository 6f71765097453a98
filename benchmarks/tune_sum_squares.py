"""The clip's sum-of-squares pass alone on the optimizer benchmark's 42 fp32 gradients (468.7M):
fusion::multi_tensor_sum_squares at each NORM_BLOCKxNORM_WARPSxNORM_PER, next to torch's
_foreach_norm and a read-bandwidth bound (one flat fp32 buffer of the same size summed by Inductor).
GB/s counts 4 bytes a parameter (one read of the gradient).

    python3 tune_sum_squares.py [--configs 4096x8x1 4096x8x2 ...]
"""
import argparse

import torch

from bench_optimizer import make_params
from common import bench_ms, env, save, table
from fusion_compiler.codegen import multi_tensor


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--configs", nargs="*", default=["4096x8x1", "4096x8x2", "4096x8x4", "2048x4x4", "8192x8x1",
                                                      "2048x8x8", "1024x4x8"])
    args = ap.parse_args()
    grads = [p.grad for p in make_params(args.layers)]
    n = sum(g.numel() for g in grads)
    ref = torch.stack([g.double().square().sum() for g in grads])
    rows = []

    def row(name, fn, check=True):
        ms = bench_ms(fn)
        err = ((fn().double() - ref).abs().max() / ref.abs().max()).item() if check else float("nan")
        rows.append({"kernel": name, "ms": round(ms, 4), "GB/s": round(n * 4 / ms / 1e6), "rel_err": f"{err:.1e}"})
        print(rows[-1], flush=True)

    for config in args.configs:
        multi_tensor.NORM_BLOCK, multi_tensor.NORM_WARPS, multi_tensor.NORM_PER = map(int, config.split("x"))
        row(f"sum_squares {config}", lambda: multi_tensor.sum_squares(grads))
    row("torch._foreach_norm (squared)", lambda: torch.stack(torch._foreach_norm(grads)) ** 2)
    flat = torch.randn(n, device="cuda")
    total = torch.compile(lambda t: t.square().sum())
    row("inductor sum of squares, one flat buffer", lambda: total(flat), check=False)
    save("sum-squares.json", {"env": env() | {"params": n}, "rows": rows})
    print(env())
    print(table(rows, ["kernel", "ms", "GB/s", "rel_err"]))


if __name__ == "__main__":
    main()
