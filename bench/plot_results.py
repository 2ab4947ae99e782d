#!/usr/bin/env python3
"""Plots a tpfuse-bench results file: microseconds per op against tokens, one panel per width.

The row ops (all-reduce + add + RMSNorm, all-reduce, the local add + RMSNorm) share a panel per
width; any other op (the QK norm) has its own panel per shape, titled by the op and its shape.

usage: python3 bench/plot_results.py RESULTS.json [more.json ...]

Writes RESULTS.png next to each results file. Each panel has one line per (op, impl) and dashed
horizontal lines for the floors measured in the same run (an empty kernel in a CUDA graph with
programmatic dependent launch, and the NVLink one-way latency): the lowest a one-op-per-layer
collective can go.
"""

import json
import math
import os
import sys
import textwrap
from collections import defaultdict

# Floors drawn on every panel, with their legend labels.
FLOORS = {
    "empty_kernel_graph": "floor: empty kernel in a graph (PDL)",
    "nvlink_one_way": "floor: NVLink one-way",
}


# Short legend names for the ops.
OP_LABELS = {
    "allreduce_add_rmsnorm": "AR+add+norm",
    "allreduce": "AR",
    "add_rmsnorm": "local add+norm",
    "allreduce_qk_rmsnorm": "QK norm",
    "allreduce_add_rmsnorm_fp8": "AR+add+norm+FP8 static",
    "allreduce_add_rmsnorm_fp8_token": "AR+add+norm+FP8 per token",
    "allreduce_add_rmsnorm_fp8_group128": "AR+add+norm+FP8 per group",
}


def load_records(path):
    with open(path) as file:
        records = json.load(file)
    if not isinstance(records, list):
        raise SystemExit(f"{path}: expected a list of records, got {type(records).__name__}")
    return records


def describe_run(records):
    """A title line from the fields every record shares."""
    first = next((r for r in records if r.get("op") != "floor"), records[0] if records else {})
    parts = [first.get("gpu", "?")]
    if first.get("backend") == "cpu":
        parts.append("CPU backend (not GPU figures)")
    parts.append(first.get("dtype", "?"))
    world = max((r.get("world_size", 1) for r in records if r.get("op") != "floor"), default=0)
    if world:
        parts.append(f"world {world}")
    for key, label in (("driver", "driver"), ("cuda", "CUDA"), ("nccl", "NCCL")):
        if first.get(key):
            parts.append(f"{label} {first[key]}")
    parts.append(f"commit {first.get('commit', '?')}")
    parts.append(first.get("date", "?"))
    return ", ".join(parts)


ROW_OPS = ("allreduce_add_rmsnorm", "allreduce", "add_rmsnorm")


def panel_of(record):
    """(sort key, title) of the panel a record is drawn in."""
    if record["op"] in ROW_OPS or record["op"].startswith("allreduce_add_rmsnorm_fp8"):
        return (0, record["hidden"], ""), f"hidden {record['hidden']}"
    shape = record.get("shape") or f"hidden {record['hidden']}"
    return (1, record["hidden"], record["op"]), f"{record['op']}\n{shape}"


def plot(path, plt):
    records = load_records(path)
    series = defaultdict(lambda: defaultdict(list))  # panel -> (op, impl) -> [(tokens, us)]
    floors = {}
    for record in records:
        us = record.get("us")
        if us is None or not math.isfinite(us):
            continue
        if record.get("op") == "floor":
            floors[record.get("impl")] = us
            continue
        key = (record["op"], record["impl"])
        series[panel_of(record)][key].append((record["tokens"], us))
    if not series:
        print(f"{path}: no op records to plot")
        return None

    panels = sorted(series)
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(max(7, 6 * columns), 4.5 * rows),
                                squeeze=False)
    for index, panel in enumerate(panels):
        axis = axes[index // columns][index % columns]
        for (op, impl), points in sorted(series[panel].items()):
            points.sort()
            tokens = [t for t, _ in points]
            us = [u for _, u in points]
            label = f"{OP_LABELS.get(op, op)}: {impl}"
            axis.plot(tokens, us, marker="o", markersize=3, label=label)
        for impl, label in FLOORS.items():
            if impl in floors:
                axis.axhline(floors[impl], linestyle="--", linewidth=1, color="gray"
                             if impl == "empty_kernel_graph" else "black", label=label)
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("tokens")
        axis.set_ylabel("µs per op")
        axis.set_title(panel[1], fontsize=9)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    for index in range(len(panels), rows * columns):
        axes[index // columns][index % columns].set_visible(False)
    figure.suptitle("\n".join(textwrap.wrap(describe_run(records), 110)), fontsize=9)
    figure.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    figure.savefig(out, dpi=120)
    plt.close(figure)
    return out


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if len(argv) >= 2 else 2
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results.py: matplotlib is not installed; no plot written "
              "(pip install matplotlib)")
        return 0
    for path in argv[1:]:
        out = plot(path, plt)
        if out:
            print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
