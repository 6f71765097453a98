"""Plot bench_fp8.py's loss curves (bf16 vs FP8) to a PNG.

    python benchmarks/plot_fp8.py runs/2026-12-03-h200-fp8-1.json fp8_loss_curve.png   (needs matplotlib)
"""
import json
import sys


def main(src: str, dst: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    with open(src) as f:
        run = json.load(f)
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, losses in run["train"].items():
        ax.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title(f"small Llama, bf16 vs FP8 linears ({run['env'].get('gpu', '?')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(dst, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:3])
