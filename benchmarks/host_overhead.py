"""Host time per call of the project's ops against ATen's, on tiny operands (the GPU finishes each
kernel before the host issues the next, so the loop's time is the host's): custom-op dispatch, the
Python wrapper, Triton's launch (its own and codegen/launch.py's FastKernel), and the dispatch of a
trivial body as a plain function, a torch.library op and a custom_op; then a profile of the FP8
linear's forward + backward.

    python benchmarks/host_overhead.py
"""
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
import triton

from common import env, save, table
from fusion_compiler.codegen import fp8, rmsnorm
from fusion_compiler.codegen.launch import row_tile


def host_us(fn, calls=300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return round(elapsed / calls * 1e6, 1)


def main():
    x = torch.randn(16, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(256, device="cuda", dtype=torch.bfloat16).requires_grad_()
    lw = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    xd, wd = x.detach(), w.detach()
    y, rstd = torch.empty_like(xd), torch.empty(16, device="cuda")
    block_m, block_n, warps = row_tile(256)
    grid = (triton.cdiv(16, block_m),)

    args = (xd, xd, wd, y, y, rstd, y, rstd, 16, 256, 256, 0, 256, 0, 1e-6)
    kwargs = dict(HAS_RESIDUAL=False, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, QUANT=False,
                  **fp8.cast_args(torch.float8_e4m3fn))
    kernel = rmsnorm._rms_norm_fwd_kernel  # a FastKernel on the GPU
    triton_fn = getattr(kernel, "fn", kernel)

    def body(x, w, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape[:1])

    lib = torch.library.Library("host_probe", "DEF")
    lib.define("lib_op(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)")
    lib.impl("lib_op", body, "CUDA")
    custom = torch.library.custom_op("host_probe::custom", body, mutates_args=(),
                                     schema="(Tensor x, Tensor w, float eps) -> (Tensor, Tensor)")
    cases = {
        "python function: two new_empty": lambda: body(xd, wd, 1e-6),
        "the same as a Library op (CUDA kernel)": lambda: torch.ops.host_probe.lib_op.default(xd, wd, 1e-6),
        "the same as a custom_op": lambda: custom(xd, wd, 1e-6),
        "aten F.rms_norm fwd": lambda: F.rms_norm(xd, (256,), wd, 1e-6),
        "fusion.rms_norm fwd (the op)": lambda: torch.ops.fusion.rms_norm(xd, wd, 1e-6),
        "rmsnorm.rms_norm_fwd (wrapper, no op)": lambda: rmsnorm.rms_norm_fwd(xd, wd, 1e-6),
        "Triton's own launch (rms_norm_fwd kernel)": lambda: triton_fn[grid](*args, **kwargs),
        "FastKernel launch (rms_norm_fwd kernel)": lambda: kernel[grid](*args, **kwargs),
        "aten F.rms_norm fwd+bwd": lambda: F.rms_norm(x, (256,), w, 1e-6).sum().backward(),
        "fusion.rms_norm fwd+bwd": lambda: torch.ops.fusion.rms_norm(x, w, 1e-6)[0].sum().backward(),
        "aten F.linear fwd+bwd": lambda: F.linear(x, lw).sum().backward(),
        "fusion.fp8_linear fwd (rowwise)": lambda: torch.ops.fusion.fp8_linear(xd, lw.detach(), "rowwise", False),
        "fusion.fp8_linear fwd+bwd (rowwise)": lambda: torch.ops.fusion.fp8_linear(x, lw, "rowwise", False).sum().backward(),
        "fp8.quantize rows": lambda: fp8.quantize(xd, torch.float8_e4m3fn),
        "fp8.quantize transposed": lambda: fp8.quantize(xd.t(), torch.float8_e4m3fn),
        "fp8.quantize_tensorwise both layouts": lambda: fp8.quantize_tensorwise(xd, torch.float8_e4m3fn),
        "torch.topk fwd (16 x 256, k = 8)": lambda: torch.topk(xd, 8, -1),
        "fusion.topk fwd (16 x 256, k = 8)": lambda: torch.ops.fusion.topk(xd, 8),
        "torch.topk fwd+bwd": lambda: torch.topk(x, 8, -1)[0].sum().backward(),
        "fusion.topk fwd+bwd": lambda: torch.ops.fusion.topk(x, 8)[0].sum().backward(),
        "torch.empty": lambda: torch.empty(16, 256, device="cuda"),
        "torch.zeros": lambda: torch.zeros(16, 256, device="cuda"),
    }
    rows = [dict(case=name, host_us=host_us(fn)) for name, fn in cases.items()]
    profile = cProfile.Profile()
    profile.runcall(lambda: [cases["fusion.fp8_linear fwd+bwd (rowwise)"]() for _ in range(200)])
    pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
    save("host_overhead.json", {"env": env(), "rows": rows})
    print(table(rows, ["case", "host_us"]))


if __name__ == "__main__":
    main()
