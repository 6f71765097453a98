"""Shared benchmark helpers: timing (triton.testing.do_bench medians), environment line, tables."""
import json
import os
import platform

import torch


def env() -> dict:
    import triton
    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version
    for dist in ("liger-kernel", "torchao"):
        try:
            info[dist.replace("-", "_")] = version(dist)
        except PackageNotFoundError:
            pass
    return info


def torchao_float8(model, recipe: str = "tensorwise"):
    """`model` with every nn.Linear swapped for torchao's Float8Linear under its named recipe (the
    peer: module swapping, each linear whatever its shape; carried as a wheel to the GPU machine)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe))


def bench_ms(fn, warmup=25, rep=100) -> float:
    """Wall time per call (CUDA events around a loop): includes CPU dispatch overhead."""
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def _profiled(fn, iters: int, warmup: int):
    """The profiler's per-kernel averages over `iters` calls of fn, after `warmup` calls."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def bench_gpu_ms(fn, iters=20) -> float:
    """GPU time per call: the summed duration of every kernel (and memset/copy) that fn launched,
    from the profiler; launch gaps and CPU dispatch are excluded (see bench_ms for wall time)."""
    return sum(e.self_device_time_total for e in _profiled(fn, iters, warmup=3)) / iters / 1e3


def kernels_ms(step, top: int = 10, iters: int = 5) -> list:
    """[(kernel name, GPU ms per step, launches per step)] of the `top` most expensive kernels of a step
    (profiler, after one warm-up step)."""
    events = sorted(_profiled(step, iters, warmup=1), key=lambda e: -e.self_device_time_total)[:top]
    return [(e.key[:90], round(e.self_device_time_total / iters / 1e3, 3), e.count / iters) for e in events]


def time_and_peak(step, iters=10) -> tuple[float, float]:
    """(GPU ms per call, GiB allocated during one call above what was allocated before it)."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return bench_gpu_ms(step, iters=iters), peak


def save(name: str, payload: dict) -> None:
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, name), "w") as f:
        json.dump(payload, f, indent=1)


def table(rows: list[dict], cols: list[str]) -> str:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) + " |")
    return "\n".join(lines)
