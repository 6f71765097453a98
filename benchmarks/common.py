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
    try:
        import liger_kernel  # noqa: F401
        from importlib.metadata import version
        info["liger_kernel"] = version("liger-kernel")
    except ImportError:
        pass
    return info


def bench_ms(fn, warmup=25, rep=100) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


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
