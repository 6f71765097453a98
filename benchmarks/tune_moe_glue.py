"""The grouped_mm path's glue kernels (codegen/moe_grouped_mm.py) at each (BLOCK_T, BLOCK_D, warps):
the token-major row copy and the combine (tokens a program x columns), and the GLU's backward with the
routing weights' gradient (sorted rows a program x column block), at bench_moe.py's two shapes.

    python benchmarks/tune_moe_glue.py
"""
import itertools

import torch
from triton.testing import do_bench

from fusion_compiler.codegen import moe, moe_grouped_mm as glue
from fusion_compiler.codegen.launch import cdiv
from common import env, save, table

SHAPES = {"reference": (8192, 8, 2, 2048, 4096), "fine": (16384, 128, 8, 2048, 768)}  # tokens, experts, k, width, ffn
# (tokens or rows a program, columns a block, warps) tried per kernel; the row kernels' were swept at run 8
# of 2026-12-05 (a whole row of 2048 best), so only the GLU's backward sweeps wide here
SPACE = {"spread": list(itertools.product((1, 4), (1024, 2048), (4, 8))),
         "combine": list(itertools.product((1, 4), (1024, 2048), (4, 8))),
         "glu_grad": list(itertools.product((1, 2, 4, 8, 16), (128, 256, 512, 1024), (4, 8)))}


def main():
    rows = []
    for name, (tokens, experts, k, width, ffn) in SHAPES.items():
        logits = torch.randn(tokens, experts, device="cuda")
        weight, index = logits.softmax(-1).topk(k, -1)
        routing = moe.route(index, weight, experts)
        inverse = routing.inverse
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        slots = tokens * k
        y = torch.randn(slots, width, device="cuda", dtype=torch.bfloat16)
        out_rows = torch.empty_like(y)
        a1, dh = (torch.randn(slots, n, device="cuda", dtype=torch.bfloat16) for n in (2 * ffn, ffn))
        da1, dw = torch.empty_like(a1), torch.empty(slots, device="cuda")
        out = torch.empty_like(x)
        end = routing.offsets[-1:]
        current = {"spread": glue._tile(width, 4) + (4,), "combine": glue._tile(width, 1) + (4,),
                   "glu_grad": glue._glu_tile(ffn) + (4,)}
        for kernel, space in SPACE.items():
            for block_t, block_d, warps in space:
                grid2 = (cdiv(tokens, block_t), cdiv(width, block_d))
                fn = {
                    "spread": lambda: glue._spread_kernel[grid2](
                        x, inverse, routing.slot_weight, out_rows, tokens, width, x.stride(0), 1, out_rows.stride(0),
                        TOP_K=k, SCALED=False, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps),
                    "combine": lambda: glue._combine_kernel[grid2](
                        y, y, inverse, routing.slot_weight, end, out, out, out, tokens, width, y.stride(0),
                        y.stride(0), out.stride(0), 0, TOP_K=k, WEIGHTED=False, TWO=False, DOTS=False,
                        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps),
                    "glu_grad": lambda: glue._glu_grad_kernel[(cdiv(slots, block_t),)](
                        dh, a1, a1[:, ffn:], routing.perm, routing.slot_weight, end, da1, da1[:, ffn:], dw, slots,
                        ffn, dh.stride(0), a1.stride(0), a1.stride(0), da1.stride(0), da1.stride(0), ACT=0,
                        BLOCK_M=block_t, BLOCK_N=block_d, num_warps=warps),
                }[kernel]
                try:
                    us = do_bench(fn, return_mode="median") * 1e3
                except Exception:  # noqa: BLE001  (a config that does not compile is skipped)
                    us = None
                rows.append({"shape": name, "kernel": kernel, "block_t": block_t, "block_d": block_d, "warps": warps,
                             "us": None if us is None else round(us, 1),
                             "current": (block_t, block_d, warps) == current[kernel]})
    save("tune_moe_glue.json", {"env": env(), "rows": rows})
    best = []
    for name in SHAPES:
        for kernel in SPACE:
            timed = [r for r in rows if r["shape"] == name and r["kernel"] == kernel and r["us"] is not None]
            current = next(r for r in timed if r["current"])
            best.append({**min(timed, key=lambda r: r["us"]), "current_us": current["us"]})
    print(table(best, ["shape", "kernel", "block_t", "block_d", "warps", "us", "current_us"]))


if __name__ == "__main__":
    main()
