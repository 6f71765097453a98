"""MoE block, fwd+bwd: HF transformers' Mixtral sparse-MoE block (router + experts), bf16.

    python benchmarks/bench_moe.py [--configs reference fine] [--sweep] [--loop]

Configs (../shared/anchors/): reference = 8 experts, top-2, hidden 2048, ffn 4096, 8192 tokens;
fine = 128 experts, top-8, hidden 2048, ffn 768, 16384 tokens.
Rows: hf_loop (experts_implementation="eager", eager; --loop, reference only), hf_grouped_mm (HF's
default, eager; `--spellings titan_before titan_after`: torchtitan's spelling instead, `TitanMoE`), inductor (torch.compile of the default), fusion (backend="fusion": the cost model
decides), fusion_triton / fusion_grouped_mm (the rewrite forced, moe_impl fixed); `--spellings dense
loop4x`: benchmarks/moe_spellings.py's dense einsum MoE and transformers 4.x's per-expert loop
(compiled through fusion_compiler.compile, which keeps that loop in one graph).
GPU time is the profiler's kernel sum over a fwd+bwd; wall is do_bench's median of the same step;
peak is the memory allocated during one step above what was allocated before it. Each compiled
result is checked against eager first (output and input gradient, relative error).
--sweep first times codegen/moe.py's tile configs on the reference shape (op alone) and keeps the
fastest for the rest of the run.
"""
import argparse
import json
import os

import torch

import fusion_compiler as fc
from common import bench_ms, env, kernels_ms, save, table, time_and_peak
from moe_spellings import DenseMoE, LoopMoE4x

CONFIGS = {"reference": dict(experts=8, top_k=2, hidden=2048, ffn=4096, tokens=8192),
           "fine": dict(experts=128, top_k=8, hidden=2048, ffn=768, tokens=16384)}


def block(cfg: dict, impl: str):
    if impl in ("dense", "loop4x"):
        torch.manual_seed(0)
        return (DenseMoE if impl == "dense" else LoopMoE4x)(cfg).to("cuda", torch.bfloat16)
    if impl.startswith("titan"):
        torch.manual_seed(0)
        return TitanMoE(cfg, impl == "titan_before").to("cuda", torch.bfloat16)
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    config = MixtralConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"], num_local_experts=cfg["experts"],
                           num_experts_per_tok=cfg["top_k"])
    config._experts_implementation = impl
    torch.manual_seed(0)
    m = MixtralSparseMoeBlock(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, cfg["hidden"] ** -0.5)
    return m


class TitanMoE(torch.nn.Module):
    """torchtitan's routed experts (without its padded dispatch): sigmoid router, argsort, torch.gather,
    scores before (or after) the experts, w1 / w3 / w2 through torch._grouped_mm, scatter_add."""

    def __init__(self, cfg: dict, score_before: bool):
        super().__init__()
        e, d, f = cfg["experts"], cfg["hidden"], cfg["ffn"]
        self.k, self.experts, self.score_before = cfg["top_k"], e, score_before
        self.router = torch.nn.Linear(d, e, bias=False)
        self.w1, self.w3 = (torch.nn.Parameter(torch.randn(e, f, d) * d ** -0.5) for _ in range(2))
        self.w2 = torch.nn.Parameter(torch.randn(e, d, f) * f ** -0.5)

    def forward(self, x):
        x = x.view(-1, x.shape[-1])
        top, index = torch.sigmoid(self.router(x).float()).topk(self.k, dim=1)
        counts = torch.histc(index.view(-1), bins=self.experts, min=0, max=self.experts)
        perm = torch.argsort(index.view(-1), stable=True)
        top_sorted = top.view(-1)[perm]
        token = (perm // self.k).reshape(-1, 1).expand(-1, x.shape[1])
        rows = torch.gather(x, 0, token)
        if self.score_before:
            rows = (rows.to(torch.float32) * top_sorted.reshape(-1, 1)).to(x.dtype)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch.nn.functional.silu(torch._grouped_mm(rows, self.w1.transpose(-2, -1), offs=offsets))
        h = h * torch._grouped_mm(rows, self.w3.transpose(-2, -1), offs=offsets)
        out = torch._grouped_mm(h, self.w2.transpose(-2, -1), offs=offsets).type_as(x)
        if not self.score_before:
            out = (out.to(torch.float32) * top_sorted.reshape(-1, 1)).to(x.dtype)
        return torch.zeros_like(x).scatter_add(0, token, out).unsqueeze(0)


def flops(cfg: dict) -> float:
    rows = cfg["tokens"] * cfg["top_k"]
    experts = 2.0 * rows * cfg["hidden"] * cfg["ffn"] * 3
    router = 2.0 * cfg["tokens"] * cfg["hidden"] * cfg["experts"]
    return 3 * (experts + router)


def sweep(cfg: dict) -> dict:
    """Time the op's kernels per tile config on this shape; set the module's configs to the fastest."""
    from triton.testing import do_bench

    from fusion_compiler.codegen import moe
    t, d, f, e, k = cfg["tokens"], cfg["hidden"], cfg["ffn"], cfg["experts"], cfg["top_k"]
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w, idx = torch.randn(t, e, device="cuda").softmax(-1).topk(k, -1)
    w13 = torch.randn(e, 2 * f, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5
    wd = torch.randn(e, d, f, device="cuda", dtype=torch.bfloat16) * f ** -0.5
    wg, wu = w13[:, :f], w13[:, f:]
    routing = moe.route(idx, w, e)
    out, a1, h = moe.forward(x, routing, wg, wu, wd, "silu", True)
    dout = torch.randn_like(out)
    dw13, dwd = torch.empty_like(w13), torch.empty_like(wd)
    found = {}
    for name, options, fn in (
        ("GATED_CONFIG", [(128, 64, 64, 8, 3, 8), (128, 128, 64, 8, 3, 8), (128, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4)],
         lambda: moe.forward(x, routing, wg, wu, wd, "silu", True)),
        ("ROW_CONFIG", [(128, 128, 64, 8, 3, 8), (128, 128, 64, 8, 4, 4), (128, 256, 64, 8, 3, 8), (64, 128, 64, 8, 4, 4)],
         lambda: moe.backward(dout, x, routing, wg, wu, wd, a1, h, "silu", True, True, True)),
        ("WEIGHT_CONFIG", [(128, 128, 64, 3, 8), (128, 128, 32, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 3, 4)],
         lambda: moe.backward(dout, x, routing, wg, wu, wd, a1, h, "silu", True, False, False,
                              dw13[:, :f], dw13[:, f:], dwd)),
    ):
        times = {}
        for option in options:
            setattr(moe, name, option)
            try:
                times[str(option)] = do_bench(fn, warmup=5, rep=30)
            except Exception as err:  # noqa: BLE001  (a config that does not compile is skipped)
                times[str(option)] = f"{type(err).__name__}"
        best = min((v, o) for o, v in times.items() if isinstance(v, float))[1]
        setattr(moe, name, tuple(int(v) for v in best.strip("()").split(",")))
        found[name] = {"times_ms": times, "chosen": best}
        print(name, json.dumps(times), "->", best)
    return found


def run(names, loop: bool, impls, breakdown: int = 0, spelling: str = "grouped_mm", cudagraphs: bool = False,
        only=None) -> list[dict]:
    rows = []
    for name in names:
        cfg = CONFIGS[name]
        ref_block = block(cfg, spelling)
        x = torch.randn(1, cfg["tokens"], cfg["hidden"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dout = torch.randn_like(x)
        ref = ref_block(x)
        ref_dx = torch.autograd.grad(ref, x, dout)[0]
        variants = {f"{'hf_' if spelling == 'grouped_mm' else ''}{spelling} (eager)": (spelling, None),
                    "inductor": (spelling, "inductor")}
        if loop and name == "reference":
            variants["hf_loop"] = ("eager", None)
        for impl in impls:
            variants[f"fusion_{impl}" if impl != "auto" else "fusion"] = (spelling, impl)
        if cudagraphs:  # the step replayed as CUDA graphs on both sides: no host time per op
            variants["inductor_cg"] = (spelling, "inductor_cg")
            variants["fusion_cg"] = (spelling, "auto_cg")
        for label, (experts_impl, how) in variants.items():
            if only and label not in only:
                continue
            torch.compiler.reset()  # a frame compiled by an earlier row keeps its graph breaks (the 4.x loop's)
            m = block(cfg, experts_impl)
            be = None
            if how == "inductor":
                m = torch.compile(m, dynamic=False)
            elif how == "inductor_cg":
                m = torch.compile(m, mode="reduce-overhead", dynamic=False)
            elif how == "auto_cg":
                be = fc.backend(cudagraphs=True)
                m = fc.compile(m, be, dynamic=False)
            elif how is not None:
                # forced rows: the MoE rewrite alone, whatever the cost model says
                be = fc.backend(moe_impl=how) if how == "auto" else \
                    fc.backend(moe_impl=how, cost_model="always", patterns={"moe_experts"})
                m = fc.compile(m, be, dynamic=False)  # (its Dynamo setting keeps the 4.x loop in one graph)
            row = {"config": name, "spelling": spelling, "impl": label}
            try:
                out = m(x)
                dx = torch.autograd.grad(out, x, dout)[0]
                row["out_err"] = f"{((out.float() - ref.float()).norm() / ref.float().norm()).item():.1e}"
                row["dx_err"] = f"{((dx.float() - ref_dx.float()).norm() / ref_dx.float().norm()).item():.1e}"

                def step():
                    m.zero_grad(set_to_none=True)
                    x.grad = None
                    m(x).backward(dout)
                ms, peak = time_and_peak(step)
                row.update(gpu_ms=round(ms, 3), wall_ms=round(bench_ms(step, warmup=5, rep=30), 3),
                           peak_gib=round(peak, 2), tflops=round(flops(cfg) / ms / 1e9, 1))
                if breakdown and label != "hf_loop":
                    row["kernels"] = kernels_ms(step, top=breakdown)
            except Exception as err:  # noqa: BLE001  (a row that fails says why; the others still run)
                row["error"] = f"{type(err).__name__}: {str(err)[:300]}"
            if be is not None:
                row["decisions"] = [f"{d.verdict} {d.pattern}: {d.reason}" for d in be.log.decisions
                                    if d.family == "moe"]
            rows.append(row)
            print(json.dumps(row))
            del m
            torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--impls", nargs="+", default=["auto", "triton", "grouped_mm"])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--loop", action="store_true")
    ap.add_argument("--cudagraphs", action="store_true", help="add inductor_cg (reduce-overhead) and fusion_cg rows")
    ap.add_argument("--breakdown", type=int, nargs="?", const=10, default=0,
                    help="list the N (default 10) most expensive kernels of each row")
    ap.add_argument("--rows", nargs="+", help="only these rows (labels as printed: inductor, fusion, fusion_cg, ...)")
    ap.add_argument("--spellings", nargs="+", default=["grouped_mm"],
                    help="grouped_mm (HF's default), titan_before / titan_after (torchtitan's, scores before or "
                         "after), dense (every expert on every token, top-k gates), loop4x (transformers 4.x)")
    args = ap.parse_args()
    payload = {"env": env(), "configs": {n: CONFIGS[n] for n in args.configs}}
    if args.sweep:
        payload["sweep"] = sweep(CONFIGS["reference"])
    payload["rows"] = [row for spelling in args.spellings
                       for row in run(args.configs, args.loop, args.impls, args.breakdown, spelling,
                                      args.cudagraphs, args.rows)]
    save(os.environ.get("BENCH_NAME", "moe.json"), payload)
    print(table(payload["rows"], ["config", "spelling", "impl", "gpu_ms", "wall_ms", "peak_gib", "tflops", "out_err", "dx_err",
                                  "error"]))


if __name__ == "__main__":
    main()
