"""Horizontal GEMM fusion on the Llama reference layer: q/k/v and gate/up as one GEMM each.

    python benchmarks/bench_horizontal.py [--batch 2] [--seq 2048]

One HF LlamaDecoderLayer (hidden 2048, 32 heads / 8 kv, ffn 8192, bf16, SDPA), forward and fwd+bwd,
under Inductor and under fusion with only gemm_horizontal enabled and forced (cost_model="always"),
so the difference is the horizontal rewrite alone. GPU time is the profiler's kernel sum.
"""
import argparse
import json
import os

import torch

import fusion_compiler as fc
from common import bench_ms, bench_gpu_ms, env, save, table


def layer():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaDecoderLayer(cfg, 0).to("cuda", torch.bfloat16), LlamaRotaryEmbedding(cfg).to("cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=2048)
    args = ap.parse_args()
    model, rope = layer()
    x = torch.randn(args.batch, args.seq, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    pos = torch.arange(args.seq, device="cuda")[None].expand(args.batch, -1)
    cos_sin = rope(x, pos)

    def call(h):
        out = model(h, position_embeddings=cos_sin)
        return out[0] if isinstance(out, tuple) else out
    ref = call(x)
    dout = torch.randn_like(ref)
    ref_dx = torch.autograd.grad(ref, x, dout)[0]
    rows = []
    for label in ("inductor", "fusion_horizontal"):
        be = fc.backend(patterns={"gemm_horizontal"}, cost_model="always") if label != "inductor" else None
        f = torch.compile(call, backend=be or "inductor", dynamic=False)
        out = f(x)
        dx = torch.autograd.grad(out, x, dout)[0]
        row = {"impl": label,
               "out_err": f"{((out.float() - ref.float()).norm() / ref.float().norm()).item():.1e}",
               "dx_err": f"{((dx.float() - ref_dx.float()).norm() / ref_dx.float().norm()).item():.1e}"}
        with torch.no_grad():
            row["fwd_gpu_ms"] = round(bench_gpu_ms(lambda: f(x)), 3)
            row["fwd_wall_ms"] = round(bench_ms(lambda: f(x), warmup=5, rep=30), 3)

        def step():
            f(x).backward(dout)
        row["fwdbwd_gpu_ms"] = round(bench_gpu_ms(step), 3)
        row["fwdbwd_wall_ms"] = round(bench_ms(step, warmup=5, rep=30), 3)
        if be is not None:
            row["decisions"] = [f"{d.verdict} {d.pattern}: {d.reason}" for d in be.log.decisions]
        rows.append(row)
        print(json.dumps(row))
    save(os.environ.get("BENCH_NAME", "horizontal.json"), {"env": env(), "rows": rows,
                                                            "shape": [args.batch, args.seq, 2048]})
    print(table(rows, ["impl", "fwd_gpu_ms", "fwd_wall_ms", "fwdbwd_gpu_ms", "fwdbwd_wall_ms", "out_err", "dx_err"]))


if __name__ == "__main__":
    main()
