"""The MoE op's per-row routing tables (token, routing weight in sorted and slot order, the inverse
permutation) made in one kernel (`codegen/moe.py` `_tables_kernel`) against the same tables in torch
ops (what `rebuild` and the grouped_mm path's `_inverse` ran before: a division, a cast, two gathers,
an arange and an index_put). The forward runs the sort and the tables, the backward the tables again.

Rows: the sort + tables alone (GPU ms from the profiler's kernel sum, wall ms from do_bench: launch
overhead included) at bench_moe.py's two shapes; then the whole block, fwd+bwd under the default
backend, with each variant (bench_moe.py's `fusion` row), alternated (--attempts times, default 2).

    python benchmarks/moe_routing_tables.py [--attempts N]
"""
import argparse
import contextlib

import torch

from bench_moe import CONFIGS, run
from common import bench_gpu_ms, bench_ms, env, save, table
from fusion_compiler.codegen import moe


def rebuild_in_torch_ops(perm, offsets, weight):
    top_k = weight.shape[-1]
    slot_weight = weight.reshape(-1).float()
    inverse = torch.empty_like(perm)
    inverse[perm.long()] = torch.arange(perm.numel(), device=perm.device, dtype=torch.int32)
    return moe.Routing(perm, perm // top_k, slot_weight[perm.long()], slot_weight, inverse, offsets, top_k)


@contextlib.contextmanager
def tables(variant: str):
    kernel = moe.rebuild
    moe.rebuild = kernel if variant == "kernel" else rebuild_in_torch_ops
    try:
        yield
    finally:
        moe.rebuild = kernel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--attempts", type=int, default=2)
    attempts = ap.parse_args().attempts
    rows = []
    for name, cfg in CONFIGS.items():
        logits = torch.randn(cfg["tokens"], cfg["experts"], device="cuda")
        weight, index = logits.softmax(-1).topk(cfg["top_k"], -1)
        weight = weight.to(torch.bfloat16)
        for variant in ("torch ops", "kernel"):
            with tables(variant):
                def step():
                    r = moe.route(index, weight, cfg["experts"])
                    moe.rebuild(r.perm, r.offsets, weight)  # the backward's
                rows.append({"config": name, "what": "sort + tables (fwd and bwd)", "variant": variant,
                             "gpu_ms": round(bench_gpu_ms(step), 4), "wall_ms": round(bench_ms(step), 4)})
                print(rows[-1])
    for attempt in range(1, attempts + 1):
        for variant in ("torch ops", "kernel"):
            with tables(variant):
                for row in run(list(CONFIGS), False, ["auto"], only=["fusion"]):
                    rows.append({"config": row["config"], "what": f"block fwd+bwd (run {attempt})", "variant": variant,
                                 "gpu_ms": row.get("gpu_ms"), "wall_ms": row.get("wall_ms"),
                                 "error": row.get("error", "")})
    save("moe_routing_tables.json", {"env": env(), "rows": rows})
    print(table(rows, ["config", "what", "variant", "gpu_ms", "wall_ms", "error"]))


if __name__ == "__main__":
    main()
