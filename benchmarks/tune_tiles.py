"""Time tile choices (rows per program, warps) of the row kernels on the GPU; prints the best per width.

    python benchmarks/tune_tiles.py
The chosen values go into codegen/launch.py (row_tile / bwd_row_tile); this script is the record of why.
"""
import torch
import triton

from common import bench_gpu_ms
from fusion_compiler.codegen import fp8, rmsnorm


def time_fwd(x, w, block_m, warps):
    m, n = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(m, device=x.device, dtype=torch.float32)
    block_n = triton.next_power_of_2(n)
    return bench_gpu_ms(lambda: rmsnorm._rms_norm_fwd_kernel[(triton.cdiv(m, block_m),)](
        x, x, w, y, y, rstd, y, rstd, m, n, x.stride(0), 0, y.stride(0), 0, 1e-6,
        HAS_RESIDUAL=False, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, QUANT=False,
        **fp8.cast_args(torch.float8_e4m3fn)))


def time_bwd(x, w, block_m, warps, progs_per_sm):
    m, n = x.shape
    dy, dx = torch.randn_like(x), torch.empty_like(x)
    rstd = torch.rand(m, device=x.device, dtype=torch.float32) + 0.5
    block_n = triton.next_power_of_2(n)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    progs = min(triton.cdiv(m, block_m), progs_per_sm * sms)
    part = torch.empty(progs, n, device=x.device, dtype=torch.float32)
    return bench_gpu_ms(lambda: rmsnorm._rms_norm_bwd_kernel[(progs,)](
        dy, x, w, rstd, dy, dx, part, m, n, dy.stride(0), x.stride(0), 0, dx.stride(0),
        HAS_DH_IN=False, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps))


def main():
    rows = 32768
    for n in (2048, 4096, 8192):
        x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        nb = x.numel() * 2
        fwd = []
        for bm in (1, 2, 4, 8):
            for wp in (4, 8, 16):
                if bm * n <= 32768:
                    t = time_fwd(x, w, bm, wp)
                    fwd.append((t, bm, wp))
        bwd = []
        for bm in (1, 2, 4, 8):
            for wp in (4, 8, 16):
                for pps in (1, 2, 4):
                    if bm * n <= 32768:
                        t = time_bwd(x, w, bm, wp, pps)
                        bwd.append((t, bm, wp, pps))
        fwd.sort()
        bwd.sort()
        print(f"n={n} fwd best (us, block_m, warps): {[(round(t*1e3,1), a, b) for t, a, b in fwd[:4]]} "
              f"GB/s {2 * nb / fwd[0][0] / 1e6:.0f}")
        print(f"n={n} bwd best (us, block_m, warps, progs/SM): {[(round(t*1e3,1), a, b, c) for t, a, b, c in bwd[:4]]} "
              f"GB/s {3 * nb / bwd[0][0] / 1e6:.0f}")
        cur_bm = max(1, min(64, 4096 // n))
        cur = [r for r in bwd if r[1] == cur_bm and r[3] == 2]
        print(f"n={n} current bwd (block_m={cur_bm}, progs/SM=2): {[(round(t*1e3,1), b) for t, a, b, c in cur]}")


if __name__ == "__main__":
    main()
