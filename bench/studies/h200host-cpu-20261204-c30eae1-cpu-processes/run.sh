#!/usr/bin/env bash
# One device call: a CPU-only build (the torch ops), then bench/cpu_processes.py at worlds 2, 4
# and 8, hidden 3072 and 7168, the token counts README's CPU table quotes (1, 16, 64, 128, 256),
# its default method (20 calls a replay, median of 15 replays).
set -uo pipefail
cd "$(dirname "$0")/../../.." || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/cpu-study-out}
mkdir -p "$OUT"
{ lscpu; nproc; uname -r; } >"$OUT/machine.txt" 2>&1
if ! cmake -S . -B build/cpu-study -G Ninja -DCMAKE_BUILD_TYPE=Release -DTPFUSE_CUDA=OFF \
  -DTPFUSE_BUILD_TESTS=OFF -DTPFUSE_BUILD_BENCH=OFF -DTPFUSE_TORCH=ON >"$OUT/build.log" 2>&1 ||
  ! cmake --build build/cpu-study -j 16 --target tpfuse_torch >>"$OUT/build.log" 2>&1; then
  tail -30 "$OUT/build.log"
  exit 1
fi
echo "built $(date -u +%H:%M:%S)"
export PYTHONPATH=$PWD/python TPFUSE_TORCH_LIBRARY=$PWD/build/cpu-study/python/libtpfuse_torch.so
python3 bench/cpu_processes.py --world 2,4,8 --tokens 1,16,64,128,256 \
  --out "$OUT/cpu-processes.json" 2>&1 | grep -v -i warn | tail -50
