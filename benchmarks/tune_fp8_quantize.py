"""Tiles of the FP8 cast of a transposed operand (codegen/fp8.py quantize_strided: the backward's x^T,
dy^T, w^T): every (BLOCK_R, BLOCK_C, CHUNK, warps) on the reference Llama step's operands, GPU ms
per cast (amax pass + cast), the best first.

    python benchmarks/tune_fp8_quantize.py
"""
import itertools
import json

import torch

from common import bench_gpu_ms, env, save, table
from fusion_compiler.codegen import fp8

SHAPES = ((4096, 2048), (4096, 8192), (8192, 2048), (4096, 512))


def main():
    rows = []
    for m, k in SHAPES:
        t = torch.randn(m, k, device="cuda", dtype=torch.bfloat16).t()
        q = torch.empty(t.shape, device="cuda", dtype=torch.float8_e4m3fn)
        inv = torch.empty((t.shape[0], 1), device="cuda", dtype=torch.float32)
        ref_q, ref_inv = fp8.quantize_reference(t, torch.float8_e4m3fn, True)
        timed = []
        for tiles in itertools.product((32, 64, 128), (32, 64, 128), (256, 1024), (4, 8)):
            fp8.quantize_strided(t, q, inv, True, torch.float8_e4m3fn, tiles)
            assert torch.allclose(inv, ref_inv, rtol=1e-6), tiles
            ms = bench_gpu_ms(lambda: fp8.quantize_strided(t, q, inv, True, torch.float8_e4m3fn, tiles))
            timed.append(dict(shape=f"{tuple(t.shape)}", tiles=str(tiles), ms=round(ms, 4),
                              gbps=round(3 * m * k / ms / 1e6)))
        timed.sort(key=lambda r: r["ms"])
        default = next(r for r in timed if r["tiles"] == str(fp8.STRIDED_TILES))
        rows += timed[:3] + [dict(default, tiles=default["tiles"] + " (default)")]
        print(json.dumps(timed[:3]), flush=True)
    save("tune_fp8_quantize.json", {"env": env(), "rows": rows})
    print(table(rows, ["shape", "tiles", "ms", "gbps"]))


if __name__ == "__main__":
    main()
