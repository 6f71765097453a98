"""Plot bench_fp8.py's loss curves (bf16 vs FP8) to a PNG: each mode one colour, its repeats
(`--repeats`: keys "mode#2", ...) in the same colour; a moving average of 10 steps.

    python benchmarks/plot_fp8.py runs/2026-12-03-h200-fp8-1.json fp8_loss_curve.png   (needs matplotlib)
"""
import json
import sys

WINDOW = 10


def main(src: str, dst: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(src) as f:
        run = json.load(f)
    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {}
    for key, losses in run["train"].items():
        mode = key.split("#")[0]
        first = mode not in colours
        colours.setdefault(mode, f"C{len(colours)}")
        smooth = [sum(losses[max(0, i - WINDOW + 1):i + 1]) / len(losses[max(0, i - WINDOW + 1):i + 1])
                  for i in range(len(losses))]
        ax.plot(range(1, len(losses) + 1), smooth, color=colours[mode], linewidth=1, alpha=0.9 if first else 0.6,
                label=mode if first else None)
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss ({WINDOW}-step mean)")
    ax.set_yscale("log")
    ax.set_title(f"small Llama, bf16 vs FP8 linears ({run['env'].get('gpu', '?')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
