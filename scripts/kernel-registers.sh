#!/usr/bin/env bash
# Registers and spill bytes of the fused kernels (ptxas -v, sm_90a), this tree against another
# source tree: a cheap check before spending device time on an A/B. Needs nvcc, no GPU. Each
# tree is configured (CUDA on) in a temporary build directory, and its kernels compiled there.
#   bash scripts/kernel-registers.sh <other-tree> [kernel files: oneshot twoshot qknorm]
# (e.g. mkdir -p build/base && git archive <commit> | tar -x -C build/base)
# NVDISASM=<path to nvdisasm> also counts each changed kernel's SASS instructions (static: every
# path, not what a call executes). The CUDA 13.0 toolkit here has no nvdisasm; PyPI's
# nvidia-cuda-nvdisasm wheel has one (nvidia/cu13/bin/nvdisasm; a developer tool, not a
# dependency of tpfuse).
set -euo pipefail
cd "$(dirname "$0")/.."
base=$(realpath "$1"); shift
files=${*:-oneshot twoshot qknorm}
work=$(mktemp -d)
# A kernel file's translation units are those the tree's build compiles for it: src/cuda/<file>.cu
# and the parts CMakeLists.txt generates (generated/cuda/<file>_*.cu), with the build's flags.
configure() {  # tree build
  cmake -S "$1" -B "$2" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPFUSE_CUDA=ON -DTPFUSE_TORCH=OFF \
    -DTPFUSE_BUILD_TESTS=OFF -DTPFUSE_BUILD_BENCH=OFF >"$2.log" 2>&1 ||
    { echo "configuring $1 failed:"; tail -20 "$2.log"; exit 1; }
}
compile() {  # build file out
  ninja -C "$1" -t commands tpfuse |
    grep -E -- "-c [^ ]*/(src/cuda/$2|generated/cuda/$2_[^ /]*)\.cu " |
    while read -r command; do
      (cd "$1" && sh -c "$command -Xptxas=-v")
      if [ -n "${NVDISASM:-}" ]; then  # the same unit as a cubin for sm_90a, disassembled
        cubin=$(mktemp -p "$work" --suffix .cubin)
        (cd "$1" && sh -c "$(echo "$command" | sed -E "s# -c # -cubin #; s# -o [^ ]+# -o $cubin#;
          s#--generate-code=[^ ]+#-arch=sm_90a#; s# -MD -MT [^ ]+ -MF [^ ]+##")" &&
          "$NVDISASM" -c "$cubin" >>"$3.sass") 2>/dev/null
      fi
    done >/dev/null 2>"$3"
}
configure "$base" "$work/base"
configure "$PWD" "$work/this"
for f in $files; do
  compile "$work/base" "$f" "$work/base_$f" &
  compile "$work/this" "$f" "$work/this_$f" &
done
wait
python3 - "$work" $files <<'PY'
import re, sys, collections
work, files = sys.argv[1], sys.argv[2:]
def drop_anonymous_namespace(name):
    # <length>_GLOBAL__N__<hash>_<length>_<file>_cu_<hash>: named after the translation unit, so
    # the same kernel compiled in another file differs only there.
    m = re.search(r"(\d+)_GLOBAL__N__", name)
    return name if not m else name[:m.start()] + name[m.end(1) + int(m.group(1)):]
def sass_counts(path):  # kernel -> SASS instructions, from nvdisasm -c output
    counts, name = {}, None
    try:
        lines = open(path)
    except OSError:
        return counts
    for line in lines:
        m = re.match(r"\.text\.(\S+):", line)
        if m:
            name = drop_anonymous_namespace(m.group(1)); counts.setdefault(name, 0); continue
        if name and re.match(r"\s+/\*[0-9a-f]{4}\*/", line): counts[name] += 1
    return counts
def parse(path):
    kernels, name, spill = {}, None, 0
    for line in open(path):
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            name = drop_anonymous_namespace(m.group(1)); spill = 0
            # An epilogue without the MoE finalize names its kMoe = false, and one without an FP8
            # output its kQuant = false, since those parameters came: the same kernel as before.
            name = re.sub(r"(NormWeightE\d)ELb([01])ELb0EE", r"\1ELb\2EE", name)
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
    for k in sorted(k for k in common if this[k][1] != base[k][1]):  # every spill that changed
        print(f"   spill {base[k]} -> {this[k]}  {re.sub(r'^.*kernelI', '', k)[:100]}")
    base_sass, this_sass = sass_counts(f"{work}/base_{f}.sass"), sass_counts(f"{work}/this_{f}.sass")
    for k in common:  # the decode kernels: bf16, world 2
        sass = (f"  SASS {base_sass[k]} -> {this_sass[k]}"
                if base_sass.get(k, 0) != this_sass.get(k, 0) else "")
        if re.search(r"BFloat16ELi2E", k) and (this[k] != base[k] or sass) and \
                not re.search(r"Li[48]EEEv", k):
            print(f"   {base[k]} -> {this[k]}{sass}  {re.sub(r'^.*kernelI', '', k)[:80]}")
PY
rm -rf "$work"
