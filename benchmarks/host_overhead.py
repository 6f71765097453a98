"""Host time per call of the project's ops against ATen's, on tiny operands (the GPU finishes each
kernel before the host issues the next, so the loop's time is the host's): custom-op dispatch, the
Python wrapper, Triton's launch.

    python benchmarks/host_overhead.py
"""
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

    def bare_launch():
        rmsnorm._rms_norm_fwd_kernel[grid](xd, xd, wd, y, y, rstd, y, rstd, 16, 256, 256, 0, 256, 0, 1e-6,
                                           HAS_RESIDUAL=False, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                                           QUANT=False, **fp8.cast_args(torch.float8_e4m3fn))
    cases = {
        "aten F.rms_norm fwd": lambda: F.rms_norm(xd, (256,), wd, 1e-6),
        "fusion.rms_norm fwd (custom op)": lambda: torch.ops.fusion.rms_norm(xd, wd, 1e-6),
        "rmsnorm.rms_norm_fwd (wrapper, no op)": lambda: rmsnorm.rms_norm_fwd(xd, wd, 1e-6),
        "bare Triton launch (rms_norm_fwd kernel)": bare_launch,
        "aten F.rms_norm fwd+bwd": lambda: F.rms_norm(x, (256,), w, 1e-6).sum().backward(),
        "fusion.rms_norm fwd+bwd": lambda: torch.ops.fusion.rms_norm(x, w, 1e-6)[0].sum().backward(),
        "aten F.linear fwd+bwd": lambda: F.linear(x, lw).sum().backward(),
        "fusion.fp8_linear fwd (rowwise)": lambda: torch.ops.fusion.fp8_linear(xd, lw.detach(), "rowwise", False),
        "fusion.fp8_linear fwd+bwd (rowwise)": lambda: torch.ops.fusion.fp8_linear(x, lw, "rowwise", False).sum().backward(),
        "fp8.quantize rows": lambda: fp8.quantize(xd, torch.float8_e4m3fn, True),
        "fp8.quantize transposed": lambda: fp8.quantize(xd.t(), torch.float8_e4m3fn, True),
        "torch.empty": lambda: torch.empty(16, 256, device="cuda"),
        "torch.zeros": lambda: torch.zeros(16, 256, device="cuda"),
    }
    rows = [dict(case=name, host_us=host_us(fn)) for name, fn in cases.items()]
    save("host_overhead.json", {"env": env(), "rows": rows})
    print(table(rows, ["case", "host_us"]))


if __name__ == "__main__":
    main()
