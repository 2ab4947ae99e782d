#!/usr/bin/env bash
# The CPU torch-path study's one device call: a CPU-only build (the torch ops and tpfuse-bench),
# then two rounds, in alternating order, of tpfuse-bench --processes (C++) and
# bench/cpu_processes.py (torch, from_group on gloo) at worlds 4 and 8, hidden 7168, 64 and 256
# tokens; then the torch run once more with glibc's malloc told to keep freed memory (large trim
# and mmap thresholds), to see what fresh pages cost the op that allocates its outputs.
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/cpu-study-out}
mkdir -p "$OUT"
{ lscpu; nproc; uname -r; } >"$OUT/machine.txt" 2>&1
if ! cmake -S . -B build/cpu-study -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPFUSE_CUDA=OFF \
  -DTPFUSE_BUILD_TESTS=OFF -DTPFUSE_TORCH=ON >"$OUT/build.log" 2>&1 ||
  ! cmake --build build/cpu-study -j 16 --target tpfuse_torch tpfuse-bench >>"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"
  exit 1
fi
export PYTHONPATH=$PWD/python TPFUSE_TORCH_LIBRARY=$PWD/build/cpu-study/python/libtpfuse_torch.so
cpp() {
  for world in 4 8; do
    build/cpu-study/bench/tpfuse-bench --backend cpu --processes --world $world --hidden 7168 \
      --tokens 64,256 --out "$OUT/cpp-x$world-r$1.json" 2>&1 | grep -A3 "^hidden 7168, bf16"
  done
}
torch_path() {
  python3 bench/cpu_processes.py --world 4,8 --hidden 7168 --tokens 64,256 \
    --out "$OUT/torch-$1.json" 2>&1 | grep -v -i warn | tail -12
}
echo "== round 1: C++ first"; cpp 1; torch_path r1
echo "== round 2: torch first"; torch_path r2; cpp 2
echo "== torch, malloc keeping freed memory"
MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296 torch_path keep
