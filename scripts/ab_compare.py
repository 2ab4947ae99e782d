"""Same-machine A/B of two tpfuse-bench builds: each (op, impl, dtype, hidden, tokens) row's
median over the rounds of each side, the ratio new / base, and the spread between rounds (the
run-to-run noise the ratio must be read against).

    python3 scripts/ab_compare.py --base base-1.json base-2.json --new new-1.json new-2.json
"""

import argparse
import json
import statistics
from collections import defaultdict


def load(paths):
    rows = defaultdict(list)
    for path in paths:
        with open(path) as f:
            for record in json.load(f):
                if record.get("op") == "floor" or "us" not in record:
                    continue
                key = (record["op"], record["impl"], record.get("dtype"), record.get("hidden"),
                       record.get("tokens"))
                rows[key].append(float(record["us"]))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", nargs="+", required=True)
    parser.add_argument("--new", nargs="+", required=True)
    parser.add_argument("--impl", default="tpfuse", help="only impls starting with this")
    args = parser.parse_args()
    base, new = load(args.base), load(args.new)
    print(f"{'op':<22} {'impl':<26} {'hidden':>6} {'tokens':>6} {'base us':>8} {'new us':>8} "
          f"{'new/base':>8} {'spread':>7}")
    ratios = []
    for key in sorted(set(base) & set(new), key=str):
        if not key[1].startswith(args.impl):
            continue
        b, n = statistics.median(base[key]), statistics.median(new[key])
        # Spread: the largest relative difference between rounds of one side.
        spread = max((max(v) - min(v)) / min(v) for v in (base[key], new[key]))
        ratios.append(n / b)
        print(f"{key[0]:<22} {key[1]:<26} {key[3]!s:>6} {key[4]!s:>6} {b:8.2f} {n:8.2f} "
              f"{n / b:8.3f} {spread:7.3f}")
    if ratios:
        print(f"rows {len(ratios)}: new/base median {statistics.median(ratios):.3f}, "
              f"min {min(ratios):.3f}, max {max(ratios):.3f}")


if __name__ == "__main__":
    main()
