"""GEMM + epilogue modules: forward and forward+backward under eager, Inductor, Inductor max-autotune
and fusion (and fusion with every region forced onto our kernel, to show the kernel where the cost
model declines it).

    python bench_gemm.py [--sizes large heavy] [--dtypes bf16 fp32] [--modes fwd fwdbwd]
                         [--backends eager inductor autotune fusion forced] [--budget-s 540]

Backends also: inductor_cg (mode="reduce-overhead") and fusion_cg (FusionConfig(cudagraphs=True)),
the pair to compare where a replayed step does not pay our ops' host time.

Sizes: large = Linear(8192, 8192) on 1024 rows (the GEMM dominates); heavy = Linear(1024, 1024) on
16384 rows (the product's write and read-back weigh; the reductions over N never write it).
Floor per case: max(FLOPs / matmul rate, bytes / copy bandwidth) with the card's measured figures
(cost.py profile; fp32 runs as TF32, counted at half the bf16 rate); FLOPs 2MNK (x3 with the backward), bytes the inputs and outputs once (x2 with the
backward, plus the weight gradient). Times: medians of the summed GPU kernel time per call (profiler,
launch gaps excluded) and of the wall time per call (do_bench). Each compiled module is checked
against eager first.
"""
import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import fusion_compiler as fc
from fusion_compiler import cost
from common import bench_gpu_ms, bench_ms, env, save, table

EPILOGUES = {  # name -> (fn(y, r), uses the residual r, reduces over N)
    "bias_relu_scale": (lambda y, r: torch.relu(y) * 0.5, False, False),
    "relu": (lambda y, r: torch.relu(y), False, False),
    "gelu": (lambda y, r: F.gelu(y), False, False),
    "gelu_tanh": (lambda y, r: F.gelu(y, approximate="tanh"), False, False),
    "silu": (lambda y, r: F.silu(y), False, False),
    "mish": (lambda y, r: F.mish(y), False, False),
    "hardswish": (lambda y, r: F.hardswish(y), False, False),
    "leaky_relu": (lambda y, r: F.leaky_relu(y, 0.1), False, False),
    "sigmoid_scale": (lambda y, r: torch.sigmoid(y) * 2.0, False, False),
    "tanh_clamp": (lambda y, r: torch.clamp(torch.tanh(y), -0.9, 0.9), False, False),
    "gelu_residual": (lambda y, r: F.gelu(y) + r, True, False),
    "logsumexp": (lambda y, r: torch.logsumexp(y, -1), False, True),
    "max": (lambda y, r: torch.amax(torch.relu(y), -1), False, True),
}
SIZES = {"large": (1024, 8192, 8192), "heavy": (16384, 1024, 1024)}  # rows, in, out
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class Block(nn.Module):
    def __init__(self, k, n, epilogue):
        super().__init__()
        self.lin = nn.Linear(k, n)
        self.epilogue = epilogue

    def forward(self, x, r):
        return self.epilogue(self.lin(x), r)


def _compile(name, m):
    """(the module under this backend, its fusion backend or None)."""
    if name == "eager":
        return m, None
    if name == "inductor":
        return torch.compile(m), None
    if name == "autotune":
        return torch.compile(m, mode="max-autotune-no-cudagraphs"), None
    if name == "inductor_cg":
        return torch.compile(m, mode="reduce-overhead"), None
    be = {"fusion": fc.backend(), "fusion_cg": fc.backend(cudagraphs=True)}.get(name) or fc.backend(cost_model="always")
    return torch.compile(m, backend=be), be


def _floor(rows, k, n, dtype, reduce, residual, training, profile) -> float:
    es = torch.empty((), dtype=dtype).element_size()
    flops = 2 * rows * k * n * (3 if training else 1)
    rate = profile.matmul_flops / (2 if dtype == torch.float32 else 1)  # TF32: half the bf16 rate
    out = rows * (1 if reduce else n) * es
    moved = rows * k * es + k * n * es + out + (rows * n * es if residual else 0)
    if training:
        moved = 2 * moved + k * n * es
    return max(flops / rate, moved / profile.bandwidth) * 1e3


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _case(dname, ename, size, mode, args, profile) -> dict:
    rows, k, n = SIZES[size]
    dtype = DTYPES[dname]
    epi, residual, reduce = EPILOGUES[ename]
    training = mode == "fwdbwd"
    dev = "cuda"
    torch.manual_seed(0)
    m = Block(k, n, epi).to(dev, dtype)
    x = torch.randn(rows, k, device=dev, dtype=dtype, requires_grad=training)
    r = torch.randn(rows, n, device=dev, dtype=dtype)
    row = {"size": size, "dtype": dname, "epilogue": ename, "mode": mode,
           "floor_ms": round(_floor(rows, k, n, dtype, reduce, residual, training, profile), 4)}
    with torch.no_grad():
        ref = m(x, r)
    g = torch.randn_like(ref)
    for bname in args.backends:
        if bname == "autotune" and (training or ename not in args.autotune):
            continue
        torch.compiler.reset()
        f, be = _compile(bname, m)
        if bname.endswith("_cg"):  # replays read x and r in place (no input copy), like a step's activations
            for t in (x, r):
                torch._dynamo.mark_static_address(t)
        t0 = time.time()
        if training:
            def step():
                x.grad = None
                m.zero_grad(set_to_none=True)
                f(x, r).backward(g)
        else:
            def step():
                with torch.no_grad():
                    return f(x, r)
        try:
            step()
            with torch.no_grad():
                out = f(x, r)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001  (a failing backend is reported, not fatal)
            row[f"{bname}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        row[f"{bname}_compile_s"] = round(time.time() - t0, 1)
        row[f"{bname}_err"] = float(f"{_rel(out, ref):.1e}")
        row[bname] = round(bench_gpu_ms(step), 4)
        row[f"{bname}_wall"] = round(bench_ms(step, warmup=5, rep=30), 4)
        if be is not None:
            row[f"{bname}_decisions"] = [(d.pattern, d.verdict, d.reason[:200])
                                         for d in be.log.decisions if d.family == "gemm"]
    return row


def run(args):
    profile = cost.profile_for(torch.device("cuda"))
    results, started = [], time.time()
    cases = [(dname, ename, size, mode) for dname in args.dtypes for ename in EPILOGUES
             if not args.only or ename in args.only for size in args.sizes for mode in args.modes]
    for case in cases:  # epilogue-major: a budget cut drops whole epilogues, not a size
        if time.time() - started > args.budget_s:
            print(f"budget reached: stopping before {case}", flush=True)
            break
        row = _case(*case, args, profile)
        results.append(row)
        print({k_: v for k_, v in row.items() if not k_.endswith(("_wall", "_decisions"))}, flush=True)
        save(args.json, {"env": env(), "profile": profile.name, "rows": results})
    return results, profile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", nargs="+", default=list(SIZES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES))
    p.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"])
    p.add_argument("--backends", nargs="+", default=["eager", "inductor", "autotune", "fusion", "forced"])
    p.add_argument("--only", nargs="*", default=[])
    p.add_argument("--autotune", nargs="*", default=["bias_relu_scale", "logsumexp"],
                   help="epilogues also compiled with max-autotune, forward only (its tuning takes long)")
    p.add_argument("--budget-s", type=float, default=540)
    p.add_argument("--json", default="gemm.json")
    args = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 = TF32 GEMMs (the fp32 rows)
    results, profile = run(args)
    save(args.json, {"env": env(), "profile": profile.name, "rows": results})
    cols = ["size", "dtype", "epilogue", "mode", "floor_ms", *[b for b in args.backends]]
    print(table(results, cols))
    for size in args.sizes:
        for mode in args.modes:
            sel = [r for r in results if r["size"] == size and r["mode"] == mode]
            for ours, base in (("fusion", "eager"), ("fusion", "inductor"), ("fusion_cg", "inductor_cg")):
                ratios = [r[base] / r[ours] for r in sel if base in r and ours in r]
                if ratios:
                    gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
                    print(f"{size} {mode}: {ours} geomean speed-up over {base}: {gm:.3f}x ({len(ratios)} cases)")
            worst = [r["fusion"] / r["floor_ms"] for r in sel if "fusion" in r]
            if worst:
                print(f"{size} {mode}: fusion / floor: max {max(worst):.2f}, median {sorted(worst)[len(worst) // 2]:.2f}")


if __name__ == "__main__":
    main()
