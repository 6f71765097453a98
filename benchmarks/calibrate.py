"""Turn a bench_norm_elementwise.py result into the cost model's efficiency table.

    python benchmarks/calibrate.py benchmarks/runs/<run>.json [bandwidth_TBps]
Prints {kernel: ((max_width, ours_fwd, inductor_fwd, ours_fwdbwd, inductor_fwdbwd), ...)}: achieved
bytes/s (the benchmark's fused byte count) over the copy bandwidth, for cost.PROFILES. "Ours" is the
fusion(backend) row: our op inside Inductor's graph, which is what a user of the backend gets.
"""
import json
import sys

# benchmark kernel -> cost-model kernel; width: the row width the kernel sees at a given "hidden"
KERNELS = {"rms_norm": "rms_norm", "add_rms_norm": "add_rms_norm", "layer_norm": "layer_norm",
           "rope": "rope", "glu_silu": "glu", "glu_silu_packed": "glu_packed"}


def main():
    data = json.load(open(sys.argv[1]))
    bw = float(sys.argv[2]) * 1e12 if len(sys.argv) > 2 else 4.3e12
    table = {}
    by = {(r["kernel"], r["hidden"], r["impl"]): r for r in data["rows"] if "hidden" in r}
    for (kernel, hidden, impl), r in sorted(by.items(), key=str):
        if impl != "fusion(backend)" or kernel not in KERNELS:
            continue
        ind = by[(kernel, hidden, "inductor")]
        entry = tuple(round(x * 1e9 / bw, 3) for x in
                      (r["fwd_GBps"], ind["fwd_GBps"], r["fwdbwd_GBps"], ind["fwdbwd_GBps"]))
        width = 1 << 30 if kernel == "rope" and hidden == max(h for k, h, _ in by if k == kernel) else hidden
        table.setdefault(KERNELS[kernel], []).append((width,) + entry)
    for k, rows in table.items():
        if k == "rope":  # the row width is the head dim whatever the hidden size: one averaged entry
            n = len(rows)
            rows[:] = [(1 << 30,) + tuple(round(sum(r[i] for r in rows) / n, 3) for i in range(1, 5))]
        print(f"    {k!r}: {tuple(rows)},")


if __name__ == "__main__":
    main()
