"""Where the reference Llama step peaks: the live allocations at the peak of one step, by origin.

    python benchmarks/profile_memory.py [--modes inductor fusion_drop_logits liger]

Records the CUDA caching allocator's history for one step (after 3 warm-up steps), replays its
events to the peak and prints the largest allocations alive there, each with the first frame that
says who made it (generated Inductor code, this project, Liger, transformers, the optimizer)."""
import argparse
import linecache
import os

import torch

from bench_llama_step import make_step

OWNERS = ("torchinductor", "fusion_compiler", "liger_kernel", "transformers", "optim", "autograd")


def origin(frames) -> str:
    for f in frames:
        if any(o in f["filename"] for o in OWNERS):
            src = linecache.getline(f["filename"], f["line"]).strip()[:90]
            return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}: {src}"
    return "?"


def peak_of_one_step(mode, top):
    step, _, model, opt = make_step(mode)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=500000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, cur, peak, at_peak = {}, base, base, {}
    for ev in snap["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            cur -= live.pop(ev["addr"])["size"]
    print(f"## {mode}: before the step {base / 2**30:.2f} GiB, peak {peak / 2**30:.2f} GiB "
          f"= {peak / 2**20:.1f} MiB (allocations made in the step and alive at the peak: "
          f"{(peak - base) / 2**20:.1f} MiB)")
    by = {}
    for ev in at_peak.values():
        key = origin(ev["frames"])
        n, size = by.get(key, (0, 0))
        by[key] = (n + 1, size + ev["size"])
    for key, (n, size) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"|{size / 2**20:9.1f} MiB | {n:4d} | {key}")
    del step, model, opt
    torch.compiler.reset()
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", nargs="+", default=["inductor", "fusion_drop_logits", "liger"])
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    for mode in a.modes:
        peak_of_one_step(mode, a.top)


if __name__ == "__main__":
    main()
