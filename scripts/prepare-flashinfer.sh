#!/usr/bin/env bash
# Builds .peers/ (ignored by git, carried to the GPU machine): FlashInfer as a benchmark-only peer.
#
# The GPU machine reaches no registry and receives at most ~64 MiB next to the repo, so this
# script does everything that needs the network or a long compile HERE:
#   1. downloads flashinfer-python (py3-none-any) and the apache-tvm-ffi wheels its METADATA asks
#      for: one for this machine's Python (to build and check here) and a cp312 manylinux x86_64
#      one for the GPU machine; plus pure-Python `packaging` and `typing_extensions` wheels that
#      env.sh puts on the path only when the GPU machine's Python lacks them (torch does not
#      bring packaging, which flashinfer.jit.cpp_ext imports at import time; tvm-ffi needs
#      typing_extensions >= 4.13, torch only >= 4.10);
#   2. unpacks FlashInfer into a work dir and ahead-of-time compiles, for sm_90a, the two JIT
#      modules a tpfuse benchmark calls: "norm" (flashinfer.norm.rmsnorm / fused_add_rmsnorm) and
#      "trtllm_comm" (flashinfer.comm.allreduce_fusion with a backend="trtllm" workspace and the
#      older trtllm_allreduce_fusion / trtllm_create_ipc_workspace_for_all_reduce_fusion);
#   3. stages a pruned copy of the package: all its Python except two trees `import flashinfer`
#      never loads (moe_ep, most of experimental), no CUTLASS / kernel sources of other modules, the two .so files where FlashInfer looks for
#      prebuilt ("AOT") modules (flashinfer/data/aot/<name>/<name>.so), and the exact headers and
#      sources of those two modules (from ninja's dependency log) so that the GPU machine can
#      still compile them if it ever has to;
#   4. writes .peers/: the xz tarball of that package, the cp312 tvm-ffi wheel, the two fallback
#      wheels, env.sh and MANIFEST.txt;
#   5. checks the result here: the bundle imports under this Python, both modules resolve to the
#      bundled .so, load, and nvcc is never asked to compile.
#
# Usage:  scripts/prepare-flashinfer.sh [--rebuild] [--no-verify]
#   --rebuild    drop the cached build of the two modules and compile them again
#   --no-verify  skip step 5
# Environment: FI_WORK (work dir, default /tmp/tpfuse-flashinfer-work), JOBS (parallel nvcc jobs,
#   default 2), PYTHON (default python3; needs torch), CUDA_HOME (default /usr/local/cuda).
# A cold build takes 5-8 min on 2 cores (trtllm_allreduce_fusion.cu alone is 4.5-7.5 min, one nvcc
# process), so run it as:  nohup scripts/prepare-flashinfer.sh > /tmp/prepare-flashinfer.log 2>&1 &
#
# On the GPU machine, from the repo root:  source .peers/env.sh   (see the comments in env.sh)
set -euo pipefail

FI_VERSION=0.7.2.post1
ARCH_LIST=9.0a                 # FLASHINFER_CUDA_ARCH_LIST value: H200 = sm_90a
ARCH_TAG=sm90a
DEVICE_PY=3.12                 # the GPU machine's Python
MODULES=(norm trtllm_comm)     # JIT spec names, which are also the AOT directory names

cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=$REPO/.peers
WORK=${FI_WORK:-/tmp/tpfuse-flashinfer-work}
JOBS=${JOBS:-2}
PY=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

REBUILD=0
VERIFY=1
for arg in "$@"; do
  case $arg in
    --rebuild) REBUILD=1 ;;
    --no-verify) VERIFY=0 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done

log() { printf '[prepare-flashinfer %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf '[prepare-flashinfer] error: %s\n' "$*" >&2; exit 1; }

command -v "$PY" >/dev/null || die "no $PY"
"$PY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch (needed to build: ABI flags)"
[ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc under CUDA_HOME=$CUDA_HOME"
mkdir -p "$WORK"/{dl,dl-host,dl-device,dl-fallback}

# Reads one file out of a wheel (a zip) without needing unzip.
wheel_cat() { "$PY" - "$1" "$2" <<'EOF'
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
name = next(n for n in z.namelist() if n.endswith(sys.argv[2]))
sys.stdout.write(z.read(name).decode())
EOF
}

# ---------------------------------------------------------------------------------------------
# 1. Wheels
# ---------------------------------------------------------------------------------------------
FI_WHL=$(ls "$WORK"/dl/flashinfer_python-"$FI_VERSION"-py3-none-any.whl 2>/dev/null || true)
if [ -z "$FI_WHL" ]; then
  log "downloading flashinfer-python==$FI_VERSION (~62 MB)"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "flashinfer-python==$FI_VERSION" -d "$WORK/dl"
  FI_WHL=$(ls "$WORK"/dl/flashinfer_python-"$FI_VERSION"-py3-none-any.whl)
fi

# The tvm-ffi requirement comes from the wheel itself (the unconditional Requires-Dist line).
METADATA=$(wheel_cat "$FI_WHL" .dist-info/METADATA)
TVM_REQ=$(printf '%s\n' "$METADATA" | sed -n 's/^Requires-Dist: \(apache-tvm-ffi[^;]*\)$/\1/p' | head -1)
[ -n "$TVM_REQ" ] || die "no unconditional apache-tvm-ffi requirement in the METADATA"
log "flashinfer $FI_VERSION requires: $TVM_REQ"
printf '%s\n' "$METADATA" | sed -n 's/^Requires-Dist: //p' | grep -v ';' > "$WORK/requires-dist.txt"

if ! ls "$WORK"/dl-host/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
  log "downloading $TVM_REQ for this machine's Python"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "$TVM_REQ" -d "$WORK/dl-host"
fi
if ! ls "$WORK"/dl-device/apache_tvm_ffi-*.whl >/dev/null 2>&1; then
  log "downloading $TVM_REQ for cp${DEVICE_PY/./} manylinux x86_64 (the GPU machine)"
  "$PY" -m pip download -q --no-deps --only-binary=:all: \
    --python-version "$DEVICE_PY" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    "$TVM_REQ" -d "$WORK/dl-device"
fi
if ! ls "$WORK"/dl-fallback/packaging-*-py3-none-any.whl >/dev/null 2>&1; then
  log "downloading a packaging wheel (fallback for a Python without it)"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "packaging>=24.2" -d "$WORK/dl-fallback"
fi
if ! ls "$WORK"/dl-fallback/typing_extensions-*-py3-none-any.whl >/dev/null 2>&1; then
  log "downloading a typing_extensions wheel (fallback for one older than 4.13)"
  "$PY" -m pip download -q --no-deps --only-binary=:all: "typing_extensions>=4.13" -d "$WORK/dl-fallback"
fi
TVM_HOST_WHL=$(ls "$WORK"/dl-host/apache_tvm_ffi-*.whl | head -1)
TVM_DEVICE_WHL=$(ls "$WORK"/dl-device/apache_tvm_ffi-*.whl | head -1)
PACKAGING_WHL=$(ls "$WORK"/dl-fallback/packaging-*-py3-none-any.whl | head -1)
TYPEXT_WHL=$(ls "$WORK"/dl-fallback/typing_extensions-*-py3-none-any.whl | head -1)
case $(basename "$TVM_DEVICE_WHL") in
  *-abi3-*|*-cp312-*) ;;
  *) die "unexpected device tvm-ffi wheel: $TVM_DEVICE_WHL" ;;
esac

# ---------------------------------------------------------------------------------------------
# 2. Host environment (only used here, to build and to check)
# ---------------------------------------------------------------------------------------------
SITE=$WORK/site            # the full, unpruned wheel: JIT sources live in flashinfer/data
HOST_SITE=$WORK/host-site  # this machine's tvm-ffi
HOST_DEPS=$WORK/host-deps  # whatever `import flashinfer` needs that this Python lacks
if [ ! -f "$SITE/.unpacked-$FI_VERSION" ]; then
  log "unpacking the wheel into $SITE"
  rm -rf "$SITE"; mkdir -p "$SITE"
  "$PY" -m zipfile -e "$FI_WHL" "$SITE"
  touch "$SITE/.unpacked-$FI_VERSION"
fi
if [ ! -d "$HOST_SITE/tvm_ffi" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$HOST_SITE" "$TVM_HOST_WHL"
fi
# Modules `import flashinfer, flashinfer.comm, flashinfer.norm` cannot do without, and the
# distributions that provide them (found by importing with each one hidden).
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"numpy": "numpy", "pynvml": "nvidia-ml-py", "tqdm": "tqdm", "requests": "requests",
        "filelock": "filelock", "packaging": "packaging", "typing_extensions": "typing-extensions",
        "cuda.bindings": "cuda-bindings<14,>=13.0.3"}
def have(m):
    try:
        return importlib.util.find_spec(m) is not None
    except ModuleNotFoundError:
        return False
print(" ".join(d for m, d in need.items() if not have(m)))
EOF
)
if [ -n "$missing" ] && [ ! -f "$HOST_DEPS/.done" ]; then
  log "installing for this machine only, into $HOST_DEPS: $missing"
  # shellcheck disable=SC2086
  "$PY" -m pip install -q --target "$HOST_DEPS" $missing
  touch "$HOST_DEPS/.done"
fi
mkdir -p "$HOST_DEPS"
if ! command -v ninja >/dev/null; then
  [ -x "$HOST_DEPS/bin/ninja" ] || "$PY" -m pip install -q --target "$HOST_DEPS" ninja
  export PATH=$HOST_DEPS/bin:$PATH
fi

# ---------------------------------------------------------------------------------------------
# 3. Ahead-of-time build (no GPU here: the arch comes from FLASHINFER_CUDA_ARCH_LIST, and the JIT
#    specs' build() is called directly instead of the ops, which would need a device)
# ---------------------------------------------------------------------------------------------
WS=$WORK/ws   # FLASHINFER_WORKSPACE_BASE for the build: cached_ops/<name>/ holds objects and .so
if [ "$REBUILD" = 1 ]; then rm -rf "$WS"; fi
log "building ${MODULES[*]} for $ARCH_TAG with $JOBS jobs (cold: 5-8 min on 2 cores)"
t0=$(date +%s)
# FLASHINFER_JIT_DEBUG=0 keeps the release flags (-O3): FLASHINFER_JIT_VERBOSE=1 would also turn
# on a -G debug build, so verbosity is asked for through build(verbose=True) instead.
env -u FLASHINFER_EXTRA_CFLAGS -u FLASHINFER_EXTRA_CUDAFLAGS -u FLASHINFER_EXTRA_LDFLAGS \
  -u FLASHINFER_NVCC -u FLASHINFER_JIT_LINEINFO -u FLASHINFER_JIT_VERBOSE \
  PYTHONPATH="$SITE:$HOST_SITE:$HOST_DEPS" FLASHINFER_CUDA_ARCH_LIST=$ARCH_LIST \
  FLASHINFER_WORKSPACE_BASE="$WS" MAX_JOBS="$JOBS" FLASHINFER_JIT_DEBUG=0 \
  "$PY" - "$WORK/built.txt" <<'EOF'
import sys, time
from flashinfer.jit.comm import gen_trtllm_comm_module
from flashinfer.jit.norm import gen_norm_module
lines = []
for gen in (gen_norm_module, gen_trtllm_comm_module):
    spec = gen()
    t = time.time()
    spec.build(verbose=True)   # runs ninja; a no-op when the objects are up to date
    print(f"built {spec.name} in {time.time() - t:.0f}s: {spec.jit_library_path}", flush=True)
    lines.append(f"{spec.name} {spec.build_dir}")
open(sys.argv[1], "w").write("\n".join(lines) + "\n")
EOF
log "build step took $(( $(date +%s) - t0 ))s"

# ---------------------------------------------------------------------------------------------
# 4. Stage the pruned package
# ---------------------------------------------------------------------------------------------
STAGE=$WORK/stage
rm -rf "$STAGE"; mkdir -p "$STAGE"
cp -a "$SITE/flashinfer" "$STAGE/flashinfer"
DIST=flashinfer_python-$FI_VERSION.dist-info
mkdir -p "$STAGE/$DIST"
for f in METADATA WHEEL entry_points.txt top_level.txt; do
  [ -f "$SITE/$DIST/$f" ] && cp "$SITE/$DIST/$f" "$STAGE/$DIST/"
done
[ -d "$SITE/$DIST/licenses" ] && cp -a "$SITE/$DIST/licenses" "$STAGE/$DIST/"
P=$STAGE/flashinfer
# JIT sources and vendored headers (CUTLASS, CCCL, spdlog, ~330 MB): only the two modules' own
# files come back below.
rm -rf "${P:?}/data"; mkdir -p "$P/data"
# Packages that `import flashinfer` never loads: the MoE expert-parallel kernels and every
# experimental kernel except the one support module the top-level import pulls in.
rm -rf "$P/moe_ep"
find "$P/experimental" -mindepth 1 -maxdepth 1 ! -name __init__.py ! -name cake_nvfp4_per_token \
  -exec rm -rf {} +
# CUDA/C++ sources that other JIT modules compile.
find "$P" \( -name '*.cu' -o -name '*.cuh' -o -name '*.cpp' -o -name '*.cc' -o -name '*.c' \
  -o -name '*.h' -o -name '*.hpp' \) -delete
find "$P" -name __pycache__ -prune -exec rm -rf {} +

# The prebuilt modules, where jit/env.py:get_aot_artifacts looks first. An artifact found there
# carries no architecture list, so JitSpecNvcc.try_load returns it without comparing archs.
while read -r name build_dir; do
  mkdir -p "$P/data/aot/$name"
  cp "$build_dir/$name.so" "$P/data/aot/$name/$name.so"
done < "$WORK/built.txt"

# Fallback sources: exactly the files nvcc read from flashinfer/data for the two modules (ninja's
# dependency log), so a JIT build on the GPU machine (PEERS_FI_JIT=1 in env.sh) still works.
: > "$WORK/jit-sources.txt"
while read -r name build_dir; do
  ninja -C "$build_dir" -f "$build_dir/build.ninja" -t deps \
    | sed -n 's/^[[:space:]]\{1,\}//p' | { grep "^$SITE/flashinfer/data/" || true; } \
    >> "$WORK/jit-sources.txt"
done < "$WORK/built.txt"
sort -u "$WORK/jit-sources.txt" -o "$WORK/jit-sources.txt"
[ -s "$WORK/jit-sources.txt" ] || die "ninja reported no dependencies"
sed "s|^$SITE/||" "$WORK/jit-sources.txt" | (cd "$SITE" && tar -cf - -T -) | (cd "$STAGE" && tar -xf -)

# ---------------------------------------------------------------------------------------------
# 5. Write .peers/
# ---------------------------------------------------------------------------------------------
TARBALL=flashinfer-$FI_VERSION-$ARCH_TAG.tar.xz
rm -rf "$OUT"; mkdir -p "$OUT/wheels" "$OUT/fallback"
log "packing $TARBALL"
(cd "$STAGE" && tar --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 \
   -cf - flashinfer "$DIST" | xz -T"$JOBS" -9 > "$OUT/$TARBALL")
cp "$TVM_DEVICE_WHL" "$OUT/wheels/"
cp "$PACKAGING_WHL" "$TYPEXT_WHL" "$OUT/fallback/"
SUM=$(sha256sum "$OUT/$TARBALL" | cut -d' ' -f1)
PACKAGING_NAME=$(basename "$PACKAGING_WHL")
TYPEXT_NAME=$(basename "$TYPEXT_WHL")

# env.sh is generated so it can name the tarball and its checksum.
cat > "$OUT/env.sh" <<EOF
# Source on the GPU machine, from the repo root:   source .peers/env.sh
# Makes \`import flashinfer\` use the bundled FlashInfer $FI_VERSION (pruned; prebuilt $ARCH_TAG
# modules "norm" and "trtllm_comm"). Written by scripts/prepare-flashinfer.sh.
# It installs the tvm-ffi wheel into \$PEERS_SITE when missing (the same pip command as by hand),
# unpacks the package into \$PEERS_FI_DIR when that does not hold this tarball yet, then sets
# PYTHONPATH and FlashInfer's variables. Knobs (set before sourcing):
#   PEERS_PYTHON  interpreter to prepare for (default python3)
#   PEERS_SITE    tvm-ffi install target (default /tmp/peers-site)
#   PEERS_FI_DIR  where the package is unpacked (default /tmp/peers-flashinfer)
#   PEERS_FI_JIT  1 = let FlashInfer compile from the bundled sources if a prebuilt module does
#                 not load (~8 min for trtllm_comm); default 0 = fail fast (FLASHINFER_DISABLE_JIT)
_pfi_here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
_pfi_py=\${PEERS_PYTHON:-python3}
PEERS_SITE=\${PEERS_SITE:-/tmp/peers-site}
PEERS_FI_DIR=\${PEERS_FI_DIR:-/tmp/peers-flashinfer}
_pfi_tar=\$_pfi_here/$TARBALL
_pfi_sum=$SUM
_pfi_ok=1
if [ ! -d "\$PEERS_SITE/tvm_ffi" ]; then
  PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 \\
  "\$_pfi_py" -m pip install -q --no-index --no-deps --no-compile --target "\$PEERS_SITE" \\
    "\$_pfi_here"/wheels/*.whl || { echo "env.sh: tvm-ffi install failed" >&2; _pfi_ok=0; }
fi
if [ "\$_pfi_ok" = 1 ] && [ "\$(cat "\$PEERS_FI_DIR/.bundle-sha256" 2>/dev/null)" != "\$_pfi_sum" ]; then
  # Unpack next to the target and move it into place, so a half-unpacked tree is never used.
  # Python's tarfile does the xz part: the machine may lack the xz program.
  _pfi_tmp=\$(mktemp -d "\$PEERS_FI_DIR.XXXXXX") &&
    "\$_pfi_py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \\
      "\$_pfi_tar" "\$_pfi_tmp" &&
    echo "\$_pfi_sum" > "\$_pfi_tmp/.bundle-sha256" &&
    rm -rf "\$PEERS_FI_DIR" && mv "\$_pfi_tmp" "\$PEERS_FI_DIR" ||
    { echo "env.sh: unpacking \$_pfi_tar failed" >&2; _pfi_ok=0; }
fi
if [ "\$_pfi_ok" = 1 ]; then
  case ":\${PYTHONPATH:-}:" in   # sourcing twice adds nothing
    *":\$PEERS_FI_DIR:\$PEERS_SITE:"*) ;;
    *) export PYTHONPATH=\$PEERS_FI_DIR:\$PEERS_SITE\${PYTHONPATH:+:\$PYTHONPATH} ;;
  esac
  # flashinfer/jit/cpp_ext.py imports packaging at import time, and tvm_ffi needs
  # typing_extensions >= 4.13 (get_annotations). A bundled wheel (pure Python, imported straight
  # from the zip) is added only when the interpreter's own copy is missing or too old, so a good
  # installed one is never shadowed.
  if ! "\$_pfi_py" -c 'import packaging.version' 2>/dev/null; then
    export PYTHONPATH=\$PYTHONPATH:\$_pfi_here/fallback/$PACKAGING_NAME
  fi
  if ! "\$_pfi_py" -c 'from typing_extensions import get_annotations, deprecated' 2>/dev/null; then
    export PYTHONPATH=\$_pfi_here/fallback/$TYPEXT_NAME:\$PYTHONPATH
  fi
  export FLASHINFER_CUDA_ARCH_LIST="$ARCH_LIST"          # targets; also names the cache dir
  export FLASHINFER_WORKSPACE_BASE=\${FLASHINFER_WORKSPACE_BASE:-/tmp/peers-flashinfer-ws}  # log, locks
  export FLASHINFER_USE_CUDA_NORM=1                 # norm via the CUDA module, not CuTe DSL
  if [ "\${PEERS_FI_JIT:-0}" = 1 ]; then unset FLASHINFER_DISABLE_JIT; else export FLASHINFER_DISABLE_JIT=1; fi
fi
unset _pfi_here _pfi_py _pfi_tar _pfi_sum _pfi_tmp
_pfi_rc=0; [ "\$_pfi_ok" = 1 ] || _pfi_rc=1   # also safe in a caller running under set -e
unset _pfi_ok; return \$_pfi_rc 2>/dev/null || exit \$_pfi_rc
EOF

{
  echo "FlashInfer $FI_VERSION benchmark peer, built $(date -u +%Y-%m-%dT%H:%MZ) by scripts/prepare-flashinfer.sh"
  echo "arch: $ARCH_TAG (FLASHINFER_CUDA_ARCH_LIST=$ARCH_LIST), nvcc: $("$CUDA_HOME/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p'), torch here: $("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  echo "flashinfer Requires-Dist (unconditional): $(paste -sd' ' "$WORK/requires-dist.txt")"
  echo
  echo "sha256:"
  (cd "$OUT" && find . -type f ! -name MANIFEST.txt | sort | xargs sha256sum)
  echo
  echo "prebuilt modules inside $TARBALL:"
  for m in "${MODULES[@]}"; do
    echo "  flashinfer/data/aot/$m/$m.so  $(stat -c %s "$P/data/aot/$m/$m.so") bytes"
  done
  echo "JIT fallback sources inside $TARBALL: $(wc -l < "$WORK/jit-sources.txt") files"
} > "$OUT/MANIFEST.txt"

# ---------------------------------------------------------------------------------------------
# 6. Check: unpack the tarball as env.sh would, import it under this Python, resolve and load
#    both modules, and make sure nvcc compiles nothing (a logging nvcc stands in for the real one)
# ---------------------------------------------------------------------------------------------
if [ "$VERIFY" = 1 ]; then
  V=$WORK/verify
  rm -rf "$V"; mkdir -p "$V/fi" "$V/cuda/bin"
  "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' "$OUT/$TARBALL" "$V/fi"
  for d in "$CUDA_HOME"/*; do [ "$(basename "$d")" = bin ] || ln -s "$d" "$V/cuda/"; done
  for b in "$CUDA_HOME"/bin/*; do ln -s "$b" "$V/cuda/bin/"; done
  rm "$V/cuda/bin/nvcc"
  printf '#!/bin/sh\necho "$*" >> %s\nexec %s "$@"\n' "$V/nvcc-calls.log" "$CUDA_HOME/bin/nvcc" > "$V/cuda/bin/nvcc"
  chmod +x "$V/cuda/bin/nvcc"
  : > "$V/nvcc-calls.log"
  for round in 1 2 3; do
    # Rounds 1 and 2 run as env.sh sets things up (JIT disabled); round 3 allows JIT, to show the
    # prebuilt module still wins.
    jit_env=(FLASHINFER_DISABLE_JIT=1); [ $round = 3 ] && jit_env=(FLASHINFER_DISABLE_JIT=)
    env -u FLASHINFER_DISABLE_JIT PYTHONPATH="$V/fi:$HOST_SITE:$HOST_DEPS" CUDA_HOME="$V/cuda" \
      FLASHINFER_CUDA_ARCH_LIST=$ARCH_LIST FLASHINFER_WORKSPACE_BASE="$V/ws" FLASHINFER_USE_CUDA_NORM=1 \
      "${jit_env[@]}" "$PY" - "$V/fi" "$round" <<'EOF'
import os, sys
if not os.environ.get("FLASHINFER_DISABLE_JIT"):
    os.environ.pop("FLASHINFER_DISABLE_JIT", None)
root, rnd = sys.argv[1], sys.argv[2]
import flashinfer, flashinfer.comm, flashinfer.norm
from flashinfer.jit import build_jit_specs
from flashinfer.jit.comm import gen_trtllm_comm_module
from flashinfer.jit.norm import gen_norm_module
assert flashinfer.__file__.startswith(root), flashinfer.__file__
want = {"norm": ["rmsnorm", "fused_add_rmsnorm"],
        "trtllm_comm": ["trtllm_allreduce_fusion", "trtllm_lamport_initialize"]}
specs = [gen_norm_module(), gen_trtllm_comm_module()]
for spec in specs:
    path = str(spec.get_library_path())
    assert spec.is_aot and spec.is_compiled and path.startswith(root), (spec.name, path)
    mod = spec.build_and_load()    # AOT artifact; would raise MissingJITCacheError if missing
    for fn in want[spec.name]:
        getattr(mod, fn)
    print(f"round {rnd}: {spec.name}: prebuilt {path} loads; has {', '.join(want[spec.name])}")
build_jit_specs(specs)             # skips specs whose AOT artifact exists: nothing to build
print(f"round {rnd}: flashinfer {flashinfer.__version__} from {os.path.dirname(flashinfer.__file__)}")
EOF
  done
  if grep -E '(^| )-c( |$)' "$V/nvcc-calls.log"; then die "nvcc was asked to compile (above)"; fi
  log "nvcc calls during the check (queries only): $(sort "$V/nvcc-calls.log" | uniq -c | paste -sd';')"
  [ ! -d "$V/ws/.cache/flashinfer/$FI_VERSION" ] || ! find "$V/ws" -name '*.o' | grep -q . \
    || die "objects were built under $V/ws"
fi

log ".peers ready: $(du -sh "$OUT" | cut -f1) ($(du -sb "$OUT" | cut -f1) bytes)"
ls -l "$OUT" "$OUT/wheels" "$OUT/fallback"
