"""Plots an end-to-end decode results file (decode.py --out): per context, the projected decode
step at 62 layers and the output tokens per second against batch, one line per mode.

    python3 bench/e2e/plot.py results.json      # writes results.png beside it
"""

import json
import os
import sys

MODE_LABELS = {
    "nccl": "(a) NCCL all-reduce + norms",
    "symm_mem": "(b) torch symm-mem one-shot + norms",
    "tpfuse": "(c) tpfuse ops",
    "tpfuse_compiled": "(c) tpfuse ops, layer compiled",
    "compiled": "(d) compiled with tpfuse passes",
    "inductor": "(a) compiled, no tpfuse (control)",
    "local": "(a) without its all-reduces (its floor)",
    "tpfuse_local": "(c) on a team of one (its floor)",
}


def main(path: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as file:
        results = json.load(file)
    summary = [s for s in results["summary"]
               if s.get("projected_tokens_per_s_62_layers") is not None]
    if not summary:
        print(f"{path}: no projected figures to plot (needs two layer counts)")
        return 1
    contexts = sorted({s["context"] for s in summary})
    figure, axes = plt.subplots(2, len(contexts), figsize=(6 * len(contexts), 8), squeeze=False)
    for column, context in enumerate(contexts):
        for mode, label in MODE_LABELS.items():
            points = sorted((s["batch"], s) for s in summary
                            if s["mode"] == mode and s["context"] == context)
            if not points:
                continue
            batches = [b for b, _ in points]
            style = "--" if mode.endswith("local") else "-"
            axes[0][column].plot(batches, [s["projected_ms_per_step_62_layers"] for _, s in points],
                                 style, marker="o", label=label)
            axes[1][column].plot(batches,
                                 [s["projected_tokens_per_s_62_layers"] for _, s in points],
                                 style, marker="o", label=label)
        for row, ylabel in enumerate(("ms per decode step (62 layers, projected)",
                                      "output tokens / s (62 layers, projected)")):
            axis = axes[row][column]
            axis.set_xscale("log", base=2)
            axis.set_xlabel("batch")
            axis.set_ylabel(ylabel)
            axis.set_title(f"context {context}")
            axis.grid(True, alpha=0.3)
        axes[0][column].legend(fontsize=8)
    info = results.get("info", {})
    weights = "FP8 (block-scaled)" if info.get("fp8") else "bf16"
    figure.suptitle(f"MiniMax-M2-shaped decode, {weights}, TP {info.get('world_size')} on "
                    f"{info.get('device')}, commit {info.get('commit')}")
    figure.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    figure.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]) if len(sys.argv) == 2 else 2)
