"""Selection-table rows (data/algorithms.csv) from a tpfuse-bench results file: for each GPU and
world size in it, the fastest of one-shot, two-shot and NCCL (+ the local fused kernel) at every
measured message size of allreduce_add_rmsnorm, as first-match rows with the measurements in a
comment above them.

    python3 bench/selection_table.py bench/results/<run>.json            # prints the rows
    python3 bench/selection_table.py <run>.json --merge data/algorithms.csv
        # prints that table with the run's (GPU, world size) rows replaced or added

Rules: message bytes = tokens x hidden x element size; a point's winner is the fastest algorithm
measured there, except that one within `--tie` (default 2%) of the fastest earlier algorithm in
the order one-shot, two-shot, NCCL loses to it (the simpler one; noise does not flip a choice);
consecutive points with the same winner make one row, whose max_bytes is the largest of them
(sizes between two measured points go to the next point's winner); past the largest measured
size, NCCL ("not measured").

CPU runs (tpfuse-bench --backend cpu, records of backend "cpu") give rows for the device "cpu",
the name every CPU team looks its rows up by: one-shot against two-shot (the CPU backend's "nccl"
is a stand-in, never what a CPU team should choose), with one crossover: one-shot up to the
first size two-shot wins, two-shot from there on (a team falls back on its own when the
workspace cannot carry a message). CPU figures are noisy where the two are close (ranks share
their cores with everything else on the host); one crossover keeps that noise out of the table.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections import defaultdict

ALGORITHMS = ("oneshot", "twoshot", "nccl")  # the order ties are broken in
IMPLS = {"tpfuse_oneshot": "oneshot", "tpfuse_twoshot": "twoshot", "tpfuse_nccl": "nccl",
         "tpfuse_oneshot_cpu": "oneshot", "tpfuse_twoshot_cpu": "twoshot"}
CPU_DEVICE = "cpu"  # the selection table's device name of every CPU team
ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
HEADER = "device,world_size,max_bytes,algorithm"


def measurements(records):
    """{(device, world): {bytes: {algorithm: us}}} of the fused op's forced algorithms (several
    widths giving one size: their mean); device is the GPU's name, or "cpu" for CPU records."""
    samples = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in records:
        if r.get("op") != "allreduce_add_rmsnorm" or r.get("impl") not in IMPLS:
            continue
        backend = r.get("backend", "cuda")
        if backend not in ("cuda", "cpu") or r["impl"].endswith("_cpu") != (backend == "cpu"):
            continue
        device = CPU_DEVICE if backend == "cpu" else r["gpu"]
        size = int(r["tokens"]) * int(r["hidden"]) * ELEMENT_BYTES[r.get("dtype", "bf16")]
        samples[(device, int(r["world_size"]))][size][IMPLS[r["impl"]]].append(float(r["us"]))
    return {group: {size: {a: sum(v) / len(v) for a, v in by_algorithm.items()}
                    for size, by_algorithm in sizes.items()}
            for group, sizes in samples.items()}


def winner(times, tie):
    best = min(times.values())
    return next(a for a in ALGORITHMS if a in times and times[a] <= best * (1 + tie))


def rows(sizes, tie=0.02, beyond="nccl"):
    """[(max_bytes, algorithm)] for one device and world size; max_bytes None means no bound.
    Past the largest measured size: `beyond`, or None for the last winner (the CPU's rule)."""
    runs = []
    for size in sorted(sizes):
        algorithm = winner(sizes[size], tie)
        if runs and runs[-1][1] == algorithm:
            runs[-1][0] = size
        else:
            runs.append([size, algorithm])
    if runs and runs[-1][1] == (beyond or runs[-1][1]):
        runs[-1][0] = None
    else:
        runs.append([None, beyond])
    return [tuple(run) for run in runs]


def cpu_rows(sizes, tie=0.02):
    """[(max_bytes, algorithm)] for a CPU team: one-shot up to the first size two-shot wins (ties
    to one-shot), two-shot beyond."""
    ordered = sorted(sizes)
    first = next((i for i, size in enumerate(ordered)
                  if winner({a: us for a, us in sizes[size].items() if a != "nccl"}, tie)
                  == "twoshot"), None)
    if first is None:
        return [(None, "oneshot")]
    if first == 0:
        return [(None, "twoshot")]
    return [(ordered[first - 1], "oneshot"), (None, "twoshot")]


def device_rows(device, sizes, tie=0.02):
    """The device's rows: rows() for a GPU, cpu_rows() for the CPU."""
    return cpu_rows(sizes, tie) if device == CPU_DEVICE else rows(sizes, tie)


def note(records, gpu, world, sizes, source):
    """The comment block above a group's rows: where the figures come from, and the figures."""
    cpu = gpu == CPU_DEVICE
    first = next(r for r in records if r.get("gpu") == gpu and int(r.get("world_size", 0)) == world
                 and r.get("op") == "allreduce_add_rmsnorm")
    if cpu:
        text = (f"CPU teams ({first.get('host_cpu') or 'host CPU'}), {world} ranks, commit "
                f"{first.get('commit', '?')}, {first.get('date', '?')[:10]}, "
                f"{first.get('method', '?')} ({source}), us per op:")
        shown = ALGORITHMS[:2]
    else:
        text = (f"{gpu}, {world} ranks, driver {first.get('driver', '?')}, CUDA "
                f"{first.get('cuda', '?')}, NCCL {first.get('nccl', '?')}, commit "
                f"{first.get('commit', '?')}, {first.get('date', '?')[:10]}, "
                f"{first.get('method', '?')} ({source}), us per op (nccl: NCCL all-reduce + the "
                "local fused kernel):")
        shown = ALGORITHMS
    # Never broken inside a name: the tests find the results file the note names.
    lines = ["# " + line for line in textwrap.wrap(text, 96, break_on_hyphens=False,
                                                   break_long_words=False)]
    lines.append("#   bytes      " + "  ".join(f"{a:>8}" for a in shown))
    for size in sorted(sizes):
        cells = [f"{sizes[size][a]:8.2f}" if a in sizes[size] else f"{'-':>8}" for a in shown]
        lines.append(f"#   {size:<10} " + "  ".join(cells))
    if cpu:
        lines.append("# Rows by bench/selection_table.py: one-shot up to the first size two-shot "
                     "wins, two-shot beyond.")
    else:
        lines.append("# Rows by bench/selection_table.py; past the largest size measured: NCCL.")
    return lines


def table_rows(gpu, world, group_rows):
    return [f"{gpu},{world},{'inf' if max_bytes is None else max_bytes},{algorithm}"
            for max_bytes, algorithm in group_rows]


def parse_row(line):
    """((device, world size), max_bytes) of a table row; world "*" stays a string, max_bytes
    "inf" is None."""
    device, world, max_bytes, _ = [f.strip() for f in line.split(",")]
    return ((device, world if world == "*" else int(world)),
            None if max_bytes == "inf" else int(max_bytes))


def merge(table_text, blocks):
    """`table_text` with every row of the groups in `blocks` removed, with the comment block
    just above them, and `blocks` ({(gpu, world): lines}) inserted right after the CSV header,
    ahead of other rows (first match wins: a new GPU's rows must not sit behind a wildcard
    row). The comments above the header (the table's own description) stay."""
    lines = table_text.splitlines()
    header_at = next((i for i, line in enumerate(lines) if line.strip() == HEADER), None)
    if header_at is None:
        raise ValueError(f"the table has no header line '{HEADER}'")
    kept, pending_comments = [], []
    for line in lines[header_at + 1:]:
        if line.startswith("#") or not line.strip():
            pending_comments.append(line)
            continue
        if parse_row(line)[0] in blocks:
            pending_comments = []  # the comment block above a replaced group's rows goes too
            continue
        kept.extend(pending_comments + [line])
        pending_comments = []
    kept.extend(pending_comments)
    top = lines[:header_at]
    inserted = [line for block in blocks.values() for line in block]
    return "\n".join(top + [lines[header_at]] + inserted + kept) + "\n"


def narrowed(table_text, groups):
    """[(gpu, world, measured, committed)] for each group whose committed rows name a bounded
    message size larger than the run measured: merged, those sizes would go to NCCL (the rule
    past the largest measured size), whatever the committed rows chose."""
    reach = {}
    for line in table_text.splitlines():
        if line.startswith("#") or not line.strip() or line.strip() == HEADER:
            continue
        key, max_bytes = parse_row(line)
        if max_bytes is not None:
            reach[key] = max(reach.get(key, 0), max_bytes)
    return [(gpu, world, max(sizes), reach[(gpu, world)])
            for (gpu, world), sizes in sorted(groups.items())
            if reach.get((gpu, world), 0) > max(sizes)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", help="tpfuse-bench results JSON")
    parser.add_argument("--merge", help="a selection table to print with these rows merged in")
    parser.add_argument("--source", help="the results file's name in the note (default: as "
                        "given; name it as committed under bench/results/)")
    parser.add_argument("--tie", type=float, default=0.02,
                        help="relative margin within which the simpler algorithm wins")
    args = parser.parse_args(argv)
    with open(args.results) as file:
        records = json.load(file)
    groups = measurements(records)
    if not groups:
        print(f"{args.results}: no allreduce_add_rmsnorm records with forced algorithms",
              file=sys.stderr)
        return 1
    blocks = {}
    for (gpu, world), sizes in sorted(groups.items()):
        blocks[(gpu, world)] = (note(records, gpu, world, sizes, args.source or args.results)
                                + table_rows(gpu, world, device_rows(gpu, sizes, args.tie)))
    if args.merge:
        with open(args.merge) as file:
            table_text = file.read()
        for gpu, world, measured, committed in narrowed(table_text, groups):
            print(f"warning: {gpu}, {world} ranks: this run measured messages up to {measured} "
                  f"bytes; the rows it replaces chose for up to {committed}. Merged, larger "
                  "messages go to NCCL: rerun with larger --tokens to keep them.", file=sys.stderr)
        sys.stdout.write(merge(table_text, blocks))
    else:
        print(HEADER)
        for block in blocks.values():
            print("\n".join(block))
    return 0


if __name__ == "__main__":
    sys.exit(main())
