"""Optimizer step: AdamW on 42 fp32 tensors (468.7M parameters), with and without a global-norm clip.

The tensors are the q/k/v/o/gate/up/down weights of 6 Llama-style layers (hidden 2048, kv 512,
ffn 11008); the anchors' case is 42 fp32 tensors, 470M parameters. Modes (one process, one card):
  for_loop, foreach, fused        eager torch.optim.AdamW
  inductor / fusion               torch.compile(opt.step) (foreach spelling; for-loop with --for-loop)
  fusion_always                   the same with cost_model="always" (our kernel whatever the cost model says)
  clip+...                        clip_grad_norm_(1.0) then the step, two compiled graphs (torch.optim's
                                  step starts with a graph break) or one graph (the step called through
                                  inspect.unwrap, as tests/patterns/test_optimizer_patterns.py does)
Time: median wall time per step (CUDA events, do_bench), launch overhead included; kernels_ms: the
summed device time of the step's kernels (profiler; the rest of ms is launch gaps); compile: first
call; --profile prints each step's kernels. TB/s counts the bytes a step must move: 28 B/param for
AdamW (read p, g, m, v; write p, m, v),
+8 with the clip (read g for the norm, write the clipped g), +4 when the clipped g is not stored.

    python3 bench_optimizer.py [--layers 6] [--blocks 1024x4 2048x4 1024x4:4096x8x2]
"""
import argparse
import inspect
import time

import torch

import fusion_compiler as fc
from common import bench_gpu_ms, bench_ms, env, kernels_ms, save, table
from fusion_compiler.codegen import multi_tensor


def make_params(layers: int, hidden=2048, kv=512, ffn=11008):
    shapes = []
    for _ in range(layers):
        shapes += [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden),
                   (ffn, hidden), (ffn, hidden), (hidden, ffn)]
    g = torch.Generator(device="cuda").manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=g) * 1e-2
    return params


def clone_params(params):
    out = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for o, p in zip(out, params):
        o.grad = p.grad.clone()
    return out


RAW_STEP = inspect.unwrap(torch.optim.AdamW.step)


def make_step(mode: str, params, for_loop: bool):
    """(step function, optimizer, backend or None) for a mode."""
    foreach = not for_loop
    kind = mode.split("+")[-1]
    if kind == "for_loop":
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    elif kind == "foreach":
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    elif kind == "fused":
        opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    else:
        opt = torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    be = None
    if kind.startswith("fusion"):
        be = fc.backend(skip_clipped_grad_store=kind.endswith("skip_store"),
                        cost_model="always" if "always" in kind else "roofline")
    compiler = (lambda f: torch.compile(f, backend=be)) if be is not None else \
        (lambda f: torch.compile(f)) if kind.startswith("inductor") else (lambda f: f)
    clip = mode.startswith("clip")
    one_graph = mode.startswith("clip1")

    if not clip:
        step = compiler(opt.step)
    elif one_graph:
        def one(ps=params, o=opt):
            with torch.no_grad():
                torch.nn.utils.clip_grad_norm_(ps, 1.0)
                RAW_STEP(o)
        step = compiler(one)
    else:
        clip_fn = compiler(lambda ps=params: torch.nn.utils.clip_grad_norm_(ps, 1.0))
        inner = compiler(opt.step)

        def step():
            clip_fn()
            inner()
    return step, opt, be


def reference_error(mode, params, for_loop):
    """Max |p - p_eager| after one step from the same state (eager foreach as the reference)."""
    ours, ref = clone_params(params), clone_params(params)
    step, _, _ = make_step(mode, ours, for_loop)
    ref_step, _, _ = make_step(("clip2+" if mode.startswith("clip") else "") + "foreach", ref, for_loop)
    step()
    ref_step()
    err = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    del ours, ref
    return err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--for-loop", action="store_true", help="compile the for-loop spelling instead of foreach")
    mt = multi_tensor
    default = f"{mt.BLOCK}x{mt.WARPS}:{mt.NORM_BLOCK}x{mt.NORM_WARPS}x{mt.NORM_PER}"
    ap.add_argument("--blocks", nargs="*", default=[default],
                    help="BLOCKxWARPS[:NORM_BLOCKxNORM_WARPS[xNORM_PER]]: all are timed in the fusion modes named by "
                         "--sweep, the first elsewhere")
    ap.add_argument("--sweep", nargs="*", default=["fusion"], help="modes timed with every --blocks entry")
    ap.add_argument("--profile", action="store_true", help="print each step's kernels (profiler, device time)")
    ap.add_argument("--modes", nargs="*", default=[
        "for_loop", "foreach", "fused", "inductor", "fusion",
        "clip2+foreach", "clip2+inductor", "clip2+fusion",
        "clip1+inductor", "clip1+fusion", "clip1+fusion_skip_store"])
    args = ap.parse_args()
    params = make_params(args.layers)
    n = sum(p.numel() for p in params)
    rows = []
    for mode in args.modes:
        blocks = args.blocks if mode in args.sweep else [args.blocks[0]] if "fusion" in mode else [None]
        for block in blocks:
            if block:  # BLOCKxWARPS[:NORM_BLOCKxNORM_WARPS]
                tile, _, norm = block.partition(":")
                multi_tensor.BLOCK, multi_tensor.WARPS = map(int, tile.split("x"))
                if norm:
                    norm = [int(v) for v in norm.split("x")]  # NORM_BLOCKxNORM_WARPS[xNORM_PER]
                    multi_tensor.NORM_BLOCK, multi_tensor.NORM_WARPS, multi_tensor.NORM_PER = (norm + [1])[:3]
            torch.compiler.reset()
            work = clone_params(params)
            step, opt, be = make_step(mode, work, args.for_loop)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            first_s = time.perf_counter() - t0
            ms = bench_ms(step)
            gpu_ms = bench_gpu_ms(step)
            if args.profile:
                print(mode, block, kernels_ms(step), flush=True)
            per_param = 28 + (8 if mode.startswith("clip") else 0) - (4 if mode.endswith("skip_store") else 0)
            applied = sorted({d.pattern for d in be.log.decisions if d.verdict == "applied"}) if be else []
            fallbacks = [d.reason[:120] for d in be.log.decisions if d.verdict == "fallback"] if be else []
            del step, opt, work
            torch.cuda.empty_cache()
            err = reference_error(mode, params, args.for_loop) if "fusion" in mode else float("nan")
            rows.append({"mode": mode, "block": block or "", "ms": round(ms, 3), "kernels_ms": round(gpu_ms, 3),
                         "TB/s": round(n * per_param / ms / 1e9, 2), "first_call_s": round(first_s, 1),
                         "max_err": f"{err:.1e}", "applied": " ".join(applied), "fallback": " | ".join(fallbacks)})
            print(rows[-1], flush=True)
    info = env() | {"params": n, "tensors": len(params), "for_loop_compiled": args.for_loop}
    save(f"optimizer{'-forloop' if args.for_loop else ''}.json", {"env": info, "rows": rows})
    print(info)
    print(table(rows, ["mode", "block", "ms", "kernels_ms", "TB/s", "first_call_s", "max_err", "applied"]))


if __name__ == "__main__":
    main()
