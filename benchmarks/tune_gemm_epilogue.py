"""Tile configs of the generated GEMM + epilogue per epilogue (codegen/gemm.py): does an epilogue with
transcendental math (erf, exp, tanh) or a reduction over N want another tile than relu's? Bias + each
activation on the memory-heavy product (16384 x 1024 -> 1024, bf16, forward), every CONFIGS entry
with each load mode (pointer, TMA, persistent TMA, each TMA mode with the epilogue on column halves:
gemm.load_modes); GPU ms per call (profiler kernel sum, the reduction's second stage
included), cuBLAS's bare product for scale, and the kernels of the best logsumexp call.

    python benchmarks/tune_gemm_epilogue.py
"""
import torch

from common import bench_gpu_ms, env, kernels_ms, save, table
from fusion_compiler.codegen import gemm

Z, V0, V1 = ("z",), ("v", 0), ("v", 1)
BIAS = ("add", (Z, ("s", 0)))
EPILOGUES = {
    "relu": ((BIAS, ("relu", (V0,))), ""),
    "gelu": ((BIAS, ("gelu", (V0,))), ""),
    "gelu_tanh": ((BIAS, ("gelu_tanh", (V0,))), ""),
    "silu": ((BIAS, ("silu", (V0,))), ""),
    "mish": ((BIAS, ("mish", (V0,))), ""),
    "sigmoid_scale": ((BIAS, ("sigmoid", (V0,)), ("mul", (V1, ("c", 2.0)))), ""),
    "logsumexp": ((BIAS,), "logsumexp"),
    "max_relu": ((BIAS, ("relu", (V0,))), "amax"),
}


def main(m=16384, k=1024, n=1024):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    cublas = bench_gpu_ms(lambda: x @ w.t())
    rows, best_rows = [], []
    for name, (steps, reduce) in EPILOGUES.items():
        ep = gemm.Epilogue(1, steps, reduce)
        lay = gemm.layout(x, w.t(), [bias], (m, n))
        timed = []
        for c in gemm.configs(2):
            for loads in gemm.load_modes(lay, reduce):
                config = (*c, loads)
                try:
                    ms = bench_gpu_ms(lambda: gemm.forward(ep, x, w.t(), [bias], (m, n), torch.bfloat16, False, config))
                except Exception as e:  # noqa: BLE001  (a config that does not compile is a row)
                    rows.append(dict(epilogue=name, config=str(config), ms=f"failed: {type(e).__name__}"))
                    continue
                timed.append((ms, config))
                rows.append(dict(epilogue=name, config=str(config), ms=round(ms, 4)))
        ms, config = min(timed)
        best_rows.append(dict(epilogue=name, best=str(config), ms=round(ms, 4), vs_cublas=round(ms / cublas, 3)))
        if reduce:
            best_rows[-1]["kernels"] = kernels_ms(
                lambda: gemm.forward(ep, x, w.t(), [bias], (m, n), torch.bfloat16, False, config), top=8)
        print(best_rows[-1], flush=True)
        save("tune_gemm_epilogue.json", {"env": env(), "cublas_ms": cublas, "rows": rows, "best": best_rows})
    print(table(rows, ["epilogue", "config", "ms"]))
    print(f"cuBLAS bare product: {cublas:.4f} ms")
    print(table(best_rows, ["epilogue", "best", "ms", "vs_cublas"]))


if __name__ == "__main__":
    main()
