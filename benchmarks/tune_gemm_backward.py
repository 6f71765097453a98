"""The GEMM + epilogue's backward kernel (codegen/gemm.py `backward`: dz and the side inputs'
partial gradients from the upstream gradient and the saved product) at each tile, GPU ms per call
(CUDA-graph replays) and GB/s over the bytes it must move (the upstream gradient, the product and,
for logsumexp, its output read; dz written).

    python tune_gemm_backward.py [--sizes heavy large] [--dtypes bf16 fp32] [--json F]
"""
import argparse

import torch

from fusion_compiler.codegen import gemm
from common import env, save

Z, V0, V1 = ("z",), ("v", 0), ("v", 1)
BIAS = ("add", (Z, ("s", 0)))
EPILOGUES = {  # name -> (steps after the bias, reduce)
    "bias_relu_scale": ((("relu", (V0,)), ("mul", (V1, ("c", 0.5)))), ""),
    "gelu": ((("gelu", (V0,)),), ""),
    "silu": ((("silu", (V0,)),), ""),
    "mish": ((("mish", (V0,)),), ""),
    "tanh_clamp": ((("tanh", (V0,)), ("clamp", (V1, ("c", -0.9), ("c", 0.9)))), ""),
    "logsumexp": ((), "logsumexp"),
}
SIZES = {"large": (1024, 8192, 8192), "heavy": (16384, 1024, 1024)}  # rows, in, out
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TILES = ((64, 64, 4), (32, 128, 4), (64, 128, 4), (64, 128, 8), (32, 256, 4), (32, 256, 8), (64, 256, 8),
         (128, 128, 8), (16, 512, 4), (8, 1024, 4), (16, 1024, 8))


def case(size, dname, ename) -> dict:
    rows, k, n = SIZES[size]
    dtype, dev = DTYPES[dname], "cuda"
    steps, reduce = EPILOGUES[ename]
    ep = gemm.Epilogue(1, (BIAS, *steps), reduce)
    torch.manual_seed(0)
    x = torch.randn(rows, k, device=dev, dtype=dtype)
    w = torch.randn(n, k, device=dev, dtype=dtype) / k ** 0.5
    bias = torch.randn(n, device=dev, dtype=dtype)
    y, z = gemm.forward(ep, x, w.t(), [bias], [rows, n], dtype, True)
    dy = torch.randn_like(y)
    args = (ep, dy, z, y, [bias], [rows, n], [True], dtype, [rows, k], [k, n])
    moved = (2 * rows * n + (rows * n if not reduce else 2 * rows)) * z.element_size()
    row = {"size": size, "dtype": dname, "epilogue": ename}
    ref = gemm.backward(*args)
    for tile in TILES:
        name = "x".join(map(str, tile))
        try:
            dz, (db,) = gemm.backward(*args, tile=tile)
            assert torch.equal(dz, ref[0]) and torch.allclose(db.float(), ref[1][0].float(), rtol=1e-2, atol=1e-2)
            ms = gemm._bench(lambda tile=tile: gemm.backward(*args, tile=tile))
            row[name] = round(ms, 4)
            row[name + "_gbs"] = round(moved / ms / 1e6)
        except Exception as e:  # noqa: BLE001  (a tile that does not compile is reported)
            row[name + "_error"] = f"{type(e).__name__}: {str(e)[:120]}"
    timed = {t: row["x".join(map(str, t))] for t in TILES if "x".join(map(str, t)) in row}
    row["best"] = "x".join(map(str, min(timed, key=timed.get)))
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=["heavy"])
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    p.add_argument("--json", default="tune-gemm-backward.json")
    args = p.parse_args()
    rows = []
    for size in args.sizes:
        for dname in args.dtypes:
            for ename in EPILOGUES:
                rows.append(case(size, dname, ename))
                save(args.json, {"env": env(), "rows": rows})
    default = "x".join(map(str, gemm.BACKWARD_TILE))
    print(f"{'case':<30} {'default ms':>10} {'GB/s':>6} {'best ms':>8} {'GB/s':>6}  best tile")
    for r in rows:
        best = r["best"]
        print(f"{r['size'] + ' ' + r['dtype'] + ' ' + r['epilogue']:<30} {r[default]:10.4f} {r[default + '_gbs']:6d} "
              f"{r[best]:8.4f} {r[best + '_gbs']:6d}  {best}")


if __name__ == "__main__":
    main()
