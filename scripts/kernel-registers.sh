#!/usr/bin/env bash
# Registers and spill bytes of the fused kernels (ptxas -v, sm_90a), this tree against another
# source tree: a cheap check before spending device time on an A/B. Needs nvcc, no GPU.
#   bash scripts/kernel-registers.sh <other-tree> [kernel files: oneshot twoshot qknorm]
# (e.g. mkdir -p build/base && git archive <commit> | tar -x -C build/base)
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(realpath "$1"); shift
files=${*:-oneshot twoshot qknorm}
work=$(mktemp -d)
generated=$(ls -d build/*/generated/include 2>/dev/null | head -1)
[ -n "$generated" ] || { echo "configure a build first (cmake --preset release)"; exit 1; }
generated=$(realpath "$generated")
compile() {  # tree file out
  nvcc -I"$1/include" -I"$generated" -I"$1/src" -O3 -DNDEBUG --expt-relaxed-constexpr -std=c++17 \
    --generate-code=arch=compute_90a,code=sm_90a -Xptxas=-v -x cu -c "$1/src/cuda/$2.cu" \
    -o /dev/null 2>"$3"
}
for f in $files; do
  compile "$base" "$f" "$work/base_$f" &
  compile "$PWD" "$f" "$work/this_$f" &
done
wait
python3 - "$work" $files <<'PY'
import re, sys, collections
work, files = sys.argv[1], sys.argv[2:]
def parse(path):
    kernels, name, spill = {}, None, 0
    for line in open(path):
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = re.sub(r"_GLOBAL__N__[0-9a-f]+_|_cu_[0-9a-f]+", "", m.group(1)); spill = 0
            # An epilogue without an FP8 output names its kQuant = false since that parameter
            # came: the same kernel as before it.
            name = re.sub(r"(NormWeightE\d)ELb0E", r"\1E", name)
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name: spill = int(m.group(1))
        m = re.search(r"Used (\d+) registers", line)
        if m and name: kernels[name] = (int(m.group(1)), spill); name = None
    return kernels
for f in files:
    base, this = parse(f"{work}/base_{f}"), parse(f"{work}/this_{f}")
    common = [k for k in base if k in this]
    deltas = collections.Counter(this[k][0] - base[k][0] for k in common)
    spills = sum(1 for k in common if this[k][1] > base[k][1])
    print(f"{f}: {len(common)} kernels in both, {len(this) - len(common)} only here; register "
          f"change -> count {sorted(deltas.items())}; {spills} spill more")
    for k in common:  # the decode kernels: bf16, world 2
        if re.search(r"BFloat16ELi2E", k) and this[k] != base[k] and not re.search(r"Li[48]EEEv", k):
            print(f"   {base[k]} -> {this[k]}  {re.sub(r'^.*kernelI', '', k)[:80]}")
PY
rm -rf "$work"
