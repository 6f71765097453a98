"""Which host ops issue the step's device-to-device copies (one profiled step of a mode).

    python benchmarks/copy_origin.py [--modes inductor_cg fusion_cg]
"""
import argparse

import torch

from bench_llama_step import make_step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["inductor_cg", "fusion_cg"])
    a = ap.parse_args()
    for mode in a.modes:
        step, *_ = make_step(mode)
        for _ in range(4):
            step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        origins = {}
        for f in prof.events():  # host events; a copy is one of the kernels its launch call issued
            for k in getattr(f, "kernels", ()):
                if "Memcpy DtoD" not in k.name:
                    continue
                chain, parent = [], f
                while parent is not None and len(chain) < 6:
                    chain.append(parent.name)
                    parent = parent.cpu_parent
                n, us = origins.get(" <- ".join(chain), (0, 0.0))
                origins[" <- ".join(chain)] = (n + 1, us + k.duration)
        print(f"== {mode}: device-to-device copies by origin (count, us)")
        for key, (n, us) in sorted(origins.items(), key=lambda kv: -kv[1][1]):
            print(f"{n:4d} {us:9.1f}  {key}")
        torch.compiler.reset()


if __name__ == "__main__":
    main()
