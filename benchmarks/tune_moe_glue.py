"""The grouped_mm path's glue kernels (codegen/moe_grouped_mm.py) at each (BLOCK_T, BLOCK_D, warps):
the token-major row copy, the output-gradient pass and the combine, at bench_moe.py's two shapes.

    python benchmarks/tune_moe_glue.py
"""
import itertools

import torch
from triton.testing import do_bench

from fusion_compiler.codegen import moe, moe_grouped_mm as glue
from fusion_compiler.codegen.launch import cdiv
from common import env, save, table

SHAPES = {"reference": (8192, 8, 2, 2048), "fine": (16384, 128, 8, 2048)}  # tokens, experts, k, width


def main():
    rows = []
    for name, (tokens, experts, k, width) in SHAPES.items():
        logits = torch.randn(tokens, experts, device="cuda")
        weight, index = logits.softmax(-1).topk(k, -1)
        routing = moe.route(index, weight, experts)
        inverse = glue._inverse(routing)
        x = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
        slots = tokens * k
        y = torch.randn(slots, width, device="cuda", dtype=torch.bfloat16)
        out_rows = torch.empty_like(y)
        dy, dw = torch.empty_like(y), torch.empty(slots, device="cuda")
        out = torch.empty_like(x)
        end = routing.offsets[-1:]
        for block_t, block_d, warps in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8)):
            grid2 = (cdiv(tokens, block_t), cdiv(width, block_d))
            kernels = {
                "spread": lambda: glue._spread_kernel[grid2](
                    x, inverse, routing.slot_weight, out_rows, tokens, width, x.stride(0), 1, out_rows.stride(0),
                    TOP_K=k, SCALED=False, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps),
                "spread_grad": lambda: glue._spread_grad_kernel[(cdiv(tokens, block_t),)](
                    x, inverse, routing.slot_weight, y, end, dy, dw, tokens, width, x.stride(0), y.stride(0),
                    dy.stride(0), TOP_K=k, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps),
                "combine": lambda: glue._combine_kernel[grid2](
                    y, inverse, routing.slot_weight, end, out, tokens, width, y.stride(0), out.stride(0),
                    TOP_K=k, WEIGHTED=True, BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps),
            }
            for kernel, fn in kernels.items():
                try:
                    us = do_bench(fn, return_mode="median") * 1e3
                except Exception as err:  # noqa: BLE001  (a config that does not compile is skipped)
                    us = None
                rows.append({"shape": name, "kernel": kernel, "block_t": block_t, "block_d": block_d, "warps": warps,
                             "us": None if us is None else round(us, 1)})
    save("tune_moe_glue.json", {"env": env(), "rows": rows})
    best = []
    for name in SHAPES:
        for kernel in ("spread", "spread_grad", "combine"):
            timed = [r for r in rows if r["shape"] == name and r["kernel"] == kernel and r["us"] is not None]
            current = next(r for r in timed if (r["block_t"], r["block_d"], r["warps"]) == (4, 1024, 4))
            top = min(timed, key=lambda r: r["us"])
            best.append({**top, "current_us": current["us"]})
    print(table(best, ["shape", "kernel", "block_t", "block_d", "warps", "us", "current_us"]))


if __name__ == "__main__":
    main()
