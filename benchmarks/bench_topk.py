"""The router's top-k: torch.topk (what Inductor runs) against fusion::topk on expert-score rows.

    python benchmarks/bench_topk.py

Shapes (tokens, experts, k): Mixtral (8192, 8, 2), the fine-grained MoE of bench_moe.py (16384, 128, 8)
and DeepSeek-V3-like (16384, 256, 8), Qwen2-MoE-like (16384, 60, 4), a long batch (65536, 8, 2).
fp32 scores (routers softmax in fp32). GPU time per call (profiler kernel sum) of the forward alone and
of forward + the values' backward; the selections are checked equal first.
"""
import torch

from fusion_compiler.codegen import topk as kernels
from common import bench_gpu_ms, bench_ms, env, save, table

SHAPES = [(8192, 8, 2), (65536, 8, 2), (16384, 60, 4), (16384, 128, 8), (16384, 256, 8)]


def main():
    rows = []
    for tokens, experts, k in SHAPES:
        x = torch.randn(tokens, experts, device="cuda").softmax(-1).requires_grad_()
        ref_v, ref_i = torch.topk(x, k, -1)
        v, i = torch.ops.fusion.topk(x, k)
        assert torch.equal(v, ref_v) and torch.equal(x.gather(-1, i), v)
        grad = torch.randn_like(v)
        row = {"tokens": tokens, "experts": experts, "k": k}
        for name, fn in (("torch", lambda: torch.topk(x, k, -1)), ("fusion", lambda: torch.ops.fusion.topk(x, k))):
            row[f"{name}_fwd"] = round(bench_gpu_ms(lambda: fn()) * 1e3, 1)
            row[f"{name}_fwdbwd"] = round(bench_gpu_ms(lambda: torch.autograd.grad(fn()[0], x, grad)) * 1e3, 1)
            row[f"{name}_wall"] = round(bench_ms(lambda: fn()) * 1e3, 1)
        row["speedup_fwd"] = round(row["torch_fwd"] / row["fusion_fwd"], 2)
        rows.append(row)
        print(row, flush=True)
    save("topk.json", {"env": env(), "units": "us", "rows": rows})
    print(table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
