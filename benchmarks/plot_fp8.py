"""Plot bench_fp8.py's loss curves (bf16 vs FP8) to a PNG: each mode one colour (a file's `mode_prefix`
joins the mode's name), its runs (`--repeats`: keys "mode#2", ..., and runs of other files) in the same
colour; a moving average of 10 steps. Below, each run's distance from the mean curve of the first file's
bf16 mode of the same prefix, in %, with the +-1% band of issue 7's goal.

    python benchmarks/plot_fp8.py SRC.json [SRC.json ...] DST.png   (needs matplotlib)
"""
import json
import statistics
import sys

WINDOW = 10


def smooth(losses: list) -> list:
    return [statistics.mean(losses[max(0, i - WINDOW + 1):i + 1]) for i in range(len(losses))]


def curves(srcs: list) -> dict:
    """mode (prefixed) -> the smoothed curves of its runs, over every file; also the card's name."""
    runs, gpu = {}, "?"
    for src in srcs:
        with open(src) as f:
            payload = json.load(f)
        gpu = payload["env"].get("gpu", gpu)
        for key, losses in payload["train"].items():
            runs.setdefault(payload.get("mode_prefix", "") + key.split("#")[0], []).append(smooth(losses))
    return runs, gpu


def main(*args: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    *srcs, dst = args
    runs, gpu = curves(srcs)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 2))
    for i, (mode, mode_runs) in enumerate(runs.items()):
        prefix = mode[:mode.rfind(":") + 1]
        base = runs.get(prefix + "bf16")
        mean_base = [statistics.mean(v) for v in zip(*base)] if base else None
        for j, curve in enumerate(mode_runs):
            style = dict(color=f"C{i}", linewidth=1, alpha=0.9 if j == 0 else 0.5, label=mode if j == 0 else None)
            top.plot(range(1, len(curve) + 1), curve, **style)
            if mean_base:
                bottom.plot(range(1, len(curve) + 1), [(c / b - 1) * 100 for c, b in zip(curve, mean_base)], **style)
    for y in (-1, 1):
        bottom.axhline(y, color="grey", linestyle="--", linewidth=0.8)
    top.set_ylabel(f"training loss ({WINDOW}-step mean)")
    top.set_yscale("log")
    top.set_title(f"small Llama, bf16 vs FP8 linears ({gpu})")
    top.legend(fontsize=8)
    bottom.set_ylabel("vs bf16's mean (%)")
    bottom.set_xlabel("step")
    bottom.set_ylim(-4, 6)
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:])
