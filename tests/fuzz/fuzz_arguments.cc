// libFuzzer target: argument validation of both fused ops on the CPU backend (a one-rank team,
// so that no call waits for a peer). Each input picks every argument: pointers into, across and
// outside a few buffers (aligned, misaligned, overlapping each other and the weights, null),
// sizes, dtype, eps, algorithm, norm weight, the FP8 output, RoPE. A call either throws
// tpfuse::Error or runs; the sanitizers (address, undefined) catch any read or write outside the
// buffers, and the buffers' guard bytes any write past an output. Built with -DTPFUSE_FUZZ=ON
// (clang).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "tpfuse/tpfuse.h"

namespace {

// Each buffer: 256 KiB and a guard that must stay untouched. Pointers start in its first 64 KiB
// and calls are cut to at most 192 KiB a tensor (tpfuse cannot know a buffer's size: a call
// larger than its buffer is the caller's error, not one the fuzzer looks for).
constexpr size_t kBufferBytes = 256 << 10;
constexpr size_t kOffsetBytes = 64 << 10;
constexpr int64_t kExtentBytes = 192 << 10;
constexpr size_t kGuardBytes = 256;
constexpr int kBuffers = 6;

struct Input {
  const uint8_t* data;
  size_t size;
  size_t at = 0;
  uint64_t take(int bytes) {
    uint64_t value = 0;
    for (int i = 0; i < bytes; ++i) value = value << 8 | (at < size ? data[at++] : 0);
    return value;
  }
};

class Arena {
 public:
  Arena() : memory_(kBuffers * (kBufferBytes + kGuardBytes) + 64) {
    base_ = memory_.data() + (64 - reinterpret_cast<uintptr_t>(memory_.data()) % 64) % 64;
    // Small finite values (bf16, fp16 and fp32 alike read them as numbers).
    for (int b = 0; b < kBuffers; ++b) {
      for (size_t i = 0; i < kBufferBytes; i += 2) start(b)[i] = 0x10, start(b)[i + 1] = 0x3c;
    }
  }
  void reset() {
    for (int b = 0; b < kBuffers; ++b) std::memset(start(b) + kBufferBytes, 0x5a, kGuardBytes);
  }
  bool guards_intact() const {
    for (int b = 0; b < kBuffers; ++b) {
      const char* guard = start(b) + kBufferBytes;
      for (size_t i = 0; i < kGuardBytes; ++i) {
        if (guard[i] != 0x5a) return false;
      }
    }
    return true;
  }
  // A pointer the input chooses: null, or buffer b at an offset (aligned or not).
  void* pointer(Input& in) {
    const uint64_t choice = in.take(1);
    if (choice % 8 == 0) return nullptr;
    const int buffer = int(choice % kBuffers);
    const uint64_t offset = in.take(2) % kOffsetBytes;
    return start(buffer) + (in.take(1) % 4 == 0 ? offset : offset / 16 * 16);
  }
  char* start(int b) const { return base_ + b * (kBufferBytes + kGuardBytes); }

 private:
  std::vector<char> memory_;
  char* base_;
};

tpfuse::Team& team() {
  static tpfuse::Team rank = [] {
    tpfuse::TeamOptions options;
    options.packet_bytes = 64 << 10;
    return tpfuse::create_cpu_team(1, options)[0];
  }();
  return rank;
}

// At most the tokens whose rows of `row_elements` (fp32 at worst) fit kExtentBytes.
int64_t fitting_tokens(int64_t tokens, int64_t row_elements) {
  if (tokens <= 0 || row_elements <= 0) return tokens;
  const int64_t most = kExtentBytes / (row_elements * 4);
  return tokens < most ? tokens : most;
}

int64_t size_from(Input& in, int64_t limit) {
  const uint64_t v = in.take(2);
  return v % 16 == 0 ? -int64_t(v % 7) : int64_t(v % uint64_t(limit));
}

float float_from(Input& in) {
  const uint32_t bits = uint32_t(in.take(4));
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Arena arena;
  arena.reset();
  Input in{data, size};
  try {
    if (in.take(1) % 2 == 0) {
      tpfuse::AddRmsNormArgs a;
      a.input = arena.pointer(in);
      a.residual = arena.pointer(in);
      a.gamma = arena.pointer(in);
      a.residual_out = arena.pointer(in);
      a.norm_out = arena.pointer(in);
      a.tokens = size_from(in, 40);
      a.hidden = size_from(in, 17000);
      a.dtype = tpfuse::DType(in.take(1) % 4);
      a.eps = in.take(1) % 4 == 0 ? float_from(in) : 1e-6f;
      a.norm_weight = tpfuse::NormWeight(in.take(1) % 3);
      a.tokens = fitting_tokens(a.tokens, a.hidden);
      a.algorithm = tpfuse::Algorithm(in.take(1) % 5);
      if (in.take(1) % 2 == 0) {
        // The FP8 output: any mode (an unknown one too), its pointers anywhere.
        a.quant = tpfuse::QuantMode(in.take(1) % 5);
        a.quant_out = arena.pointer(in);
        a.quant_scale = static_cast<const float*>(arena.pointer(in));
        a.scales_out = static_cast<float*>(arena.pointer(in));
        a.scales_column_major = in.take(1) % 2 == 0;
      }
      tpfuse::allreduce_add_rmsnorm(team(), a);
    } else {
      tpfuse::QkNormArgs a;
      a.qkv = arena.pointer(in);
      a.q_out = in.take(1) % 2 ? arena.pointer(in) : nullptr;
      a.k_out = in.take(1) % 2 ? arena.pointer(in) : nullptr;
      a.q_gamma = arena.pointer(in);
      a.k_gamma = arena.pointer(in);
      a.tokens = size_from(in, 20);
      a.q_size = size_from(in, 4200);
      a.kv_size = size_from(in, 1100);
      a.q_global_size = size_from(in, 9000);
      a.k_global_size = size_from(in, 2200);
      a.kv_replicas = int(in.take(1) % 3);
      a.dtype = tpfuse::DType(in.take(1) % 4);
      a.eps = in.take(1) % 4 == 0 ? float_from(in) : 1e-6f;
      a.rope = tpfuse::RopeStyle(in.take(1) % 4);
      a.head_dim = size_from(in, 300);
      a.rotary_dim = size_from(in, 300);
      a.positions = static_cast<const int64_t*>(arena.pointer(in));
      a.cos_sin_cache = static_cast<const float*>(arena.pointer(in));
      a.max_position = size_from(in, 64);
      a.tokens = fitting_tokens(a.tokens, a.q_size + 2 * a.kv_size);
      a.algorithm = tpfuse::Algorithm(in.take(1) % 5);
      tpfuse::allreduce_qk_rmsnorm(team(), a);
    }
  } catch (const tpfuse::Error&) {
    // Rejected, naming the argument: what validation is for.
  }
  if (!arena.guards_intact()) __builtin_trap();  // a call wrote past a buffer it was given
  return 0;
}
