// The CPU backend's row calls: one-shot, two-shot, the local epilogue and the NCCL path's
// stand-in. Ranks are threads of one process or processes of one host; each call is a Lamport
// session (tpfuse/impl/session.h) run by the rank's one thread, with the steps and the math the
// CUDA kernels run: the rank-ordered fp32 sum, residual add, one rounding, canonical zeros and the
// norm of tpfuse/impl/epilogue.h.
//
// Rows, not vectors: packets move a row at a time (store_packets, poll_packets in cpu/exchange.h)
// and each step of the epilogue is a loop over a whole row, which the compiler vectorizes (for the
// baseline instruction set and for AVX2: RowLoops). Every element goes through the operations of
// epilogue.h's per-vector steps, in their order (the sum from rank 0's value on, + residual,
// from_float, the sentinel's word as +0, (x * scale) * weight), so vectorizing across elements
// changes no bit (NaN payloads aside: where two NaNs meet, which payload survives is the
// compiler's choice, as it always was). The one reduction, a row's sum of squares, stays what it
// always was on the CPU: a sequential fp32 sum from element 0 to hidden - 1, each square rounded
// before it is added. Up to kGroupRows rows are finished together so that their sums, independent
// chains of adds, overlap. tests/cpu/test_row_bits.cc holds the rows to epilogue.h's per-vector
// steps, bit for bit.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "core/signature_fields.h"
#include "cpu/exchange.h"
#include "cpu/kernels.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse::impl {
namespace {

constexpr int kGroupRows = 8;

// A row's 32-bit words, for the sentinel rewrite of rows written as T elements.
using Word = uint32_t __attribute__((may_alias));

// Raw, 64-byte aligned memory that grows to the largest request and is kept: a rank thread's rows
// of T (any dtype: no declared type), without an allocation per call.
class ScratchBytes {
 public:
  ScratchBytes() = default;
  ScratchBytes(const ScratchBytes&) = delete;
  ScratchBytes& operator=(const ScratchBytes&) = delete;
  ~ScratchBytes() { std::free(data_); }
  void* reserve(size_t bytes) {
    if (bytes > size_) {
      const size_t size = (bytes + 63) / 64 * 64;
      std::free(data_);
      size_ = 0;
      data_ = std::aligned_alloc(64, size);
      if (data_ == nullptr) TPF_FAIL("out of host memory for " << size << " bytes of scratch rows");
      size_ = size;
    }
    return data_;
  }

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
};

// Each rank thread's rows: the rank sum in fp32 (then the rounded values), one row of packets,
// the rounded rows of a group and their squares, the norm's weight, one normalized row.
struct RowScratch {
  ScratchBytes sum, packets, rounded, squares, weight, normalized;
};

RowScratch& row_scratch() {
  thread_local RowScratch scratch;
  return scratch;
}

// The loops below are inlined into each instruction set's build of them (RowLoops).
#define TPF_ROW_LOOP inline __attribute__((always_inline))

// A row as the loops see it: its 32-bit words (Word), each holding kLanes<T> elements (one fp32,
// or two 16-bit elements, the low half first), and its fp32 values split by lane: lane j of word k
// at [j * words + k]. Every loop then works on whole words, element-wise, and vectorizes without
// shuffles.
template <typename T>
constexpr int kLanes = int(4 / sizeof(T));

template <typename T>
float lane_value(uint32_t word, int lane) {
  if constexpr (kLanes<T> == 1) {
    return bits_float(word);
  } else {
    return to_float(T{uint16_t(word >> (16 * lane))});
  }
}

template <typename T>
uint32_t lane_bits(float x, int lane) {
  if constexpr (kLanes<T> == 1) {
    return float_bits(x);
  } else {
    return uint32_t(from_float<T>(x).bits) << (16 * lane);
  }
}

// The per-element steps of epilogue.h over a row of `words` words.

// accumulate_first, then accumulate: split = x, split += x.
template <typename T>
TPF_ROW_LOOP void widen(const Word* __restrict x, int64_t words, float* __restrict split) {
  for (int64_t k = 0; k < words; ++k) {
    for (int j = 0; j < kLanes<T>; ++j) split[j * words + k] = lane_value<T>(x[k], j);
  }
}
template <typename T>
TPF_ROW_LOOP void add_widened(const Word* __restrict x, int64_t words, float* __restrict split) {
  for (int64_t k = 0; k < words; ++k) {
    for (int j = 0; j < kLanes<T>; ++j) split[j * words + k] += lane_value<T>(x[k], j);
  }
}

// rewrite_sentinel, word by word.
void copy_rewritten(const void* source, size_t bytes, void* out) {
  const Word* __restrict from = static_cast<const Word*>(source);
  Word* __restrict to = static_cast<Word*>(out);
  for (size_t k = 0; k < bytes / 4; ++k) to[k] = from[k] == kSentinel ? 0u : from[k];
}

// round_output: one rounding to T, then canonical zeros.
template <typename T>
TPF_ROW_LOOP void round_row(const float* __restrict split, int64_t words, Word* __restrict out) {
  for (int64_t k = 0; k < words; ++k) {
    uint32_t word = 0;
    for (int j = 0; j < kLanes<T>; ++j) word |= lane_bits<T>(split[j * words + k], j);
    out[k] = word == kSentinel ? 0u : word;
  }
}

// The squares residual_round adds to a row's sum: of the rounded values, as fp32.
template <typename T>
TPF_ROW_LOOP void square_row(const Word* __restrict rounded, int64_t words,
                             float* __restrict squares) {
  for (int64_t k = 0; k < words; ++k) {
    for (int j = 0; j < kLanes<T>; ++j) {
      const float x = lane_value<T>(rounded[k], j);
      squares[j * words + k] = x * x;
    }
  }
}

// Each row's sum of its squares in element order, element 0 first (kRows rows of split squares,
// `stride` floats apart): the rows' sums run side by side, each a chain of its own.
template <int kRows, int kRowLanes>
void sum_rows(const float* squares, int64_t stride, int64_t words, float* sums) {
  float sum[kRows];
  for (int r = 0; r < kRows; ++r) sum[r] = 0.0f;
  for (int64_t k = 0; k < words; ++k) {
    for (int r = 0; r < kRows; ++r) {
      for (int j = 0; j < kRowLanes; ++j) sum[r] += squares[r * stride + j * words + k];
    }
  }
  for (int r = 0; r < kRows; ++r) sums[r] = sum[r];
}

template <int kRowLanes>
void sums_of_squares(const float* squares, int64_t stride, int64_t words, int rows, float* sums) {
  static_assert(kGroupRows == 8, "a case per group size");
  switch (rows) {
    case 1:
      return sum_rows<1, kRowLanes>(squares, stride, words, sums);
    case 2:
      return sum_rows<2, kRowLanes>(squares, stride, words, sums);
    case 3:
      return sum_rows<3, kRowLanes>(squares, stride, words, sums);
    case 4:
      return sum_rows<4, kRowLanes>(squares, stride, words, sums);
    case 5:
      return sum_rows<5, kRowLanes>(squares, stride, words, sums);
    case 6:
      return sum_rows<6, kRowLanes>(squares, stride, words, sums);
    case 7:
      return sum_rows<7, kRowLanes>(squares, stride, words, sums);
    case 8:
      return sum_rows<8, kRowLanes>(squares, stride, words, sums);
    default:
      TPF_FAIL("a group of " << rows << " rows");
  }
}

// The norm's weight per element, as normalize computes it: gamma, or 1 + gamma in fp32.
template <typename T, NormWeight kWeight>
TPF_ROW_LOOP void load_weight(const Word* __restrict gamma, int64_t words,
                              float* __restrict split) {
  for (int64_t k = 0; k < words; ++k) {
    for (int j = 0; j < kLanes<T>; ++j) {
      const float g = lane_value<T>(gamma[k], j);
      split[j * words + k] = kWeight == NormWeight::kOnePlusGamma ? 1.0f + g : g;
    }
  }
}

// normalize: (x * scale) * weight, rounded once.
template <typename T>
TPF_ROW_LOOP void normalize_row(const Word* __restrict rounded, const float* __restrict weight,
                                float scale, int64_t words, Word* __restrict out) {
  for (int64_t k = 0; k < words; ++k) {
    uint32_t word = 0;
    for (int j = 0; j < kLanes<T>; ++j) {
      word |= lane_bits<T>((lane_value<T>(rounded[k], j) * scale) * weight[j * words + k], j);
    }
    out[k] = word;
  }
}

// The FP8 output's steps over a row of normalized words. row_amax: vector_amax folded with fmaxf
// from 0, as the bits of the magnitudes (for floats of one sign, the order of their bits is the
// order of their values) with a NaN as 0: a NaN never wins, and max is exact in any order.
// quantize_words: quantize_vector's bytes, element by element.
template <typename T>
TPF_ROW_LOOP float row_amax(const Word* __restrict x, int64_t words) {
  uint32_t most = 0;
  for (int64_t k = 0; k < words; ++k) {
    uint32_t in_word = 0;
    for (int j = 0; j < kLanes<T>; ++j) {
      const uint32_t magnitude = float_bits(lane_value<T>(x[k], j)) & 0x7fffffffu;
      const uint32_t value = magnitude > 0x7f800000u ? 0u : magnitude;
      in_word = value > in_word ? value : in_word;
    }
    most = in_word > most ? in_word : most;  // one reduction step a word: it vectorizes
  }
  return bits_float(most);
}

template <typename T>
TPF_ROW_LOOP void quantize_words(const Word* __restrict x, int64_t words, float scale,
                                 uint8_t* __restrict out) {
  for (int64_t k = 0; k < words; ++k) {
    for (int j = 0; j < kLanes<T>; ++j) {
      out[k * kLanes<T> + j] = fp8_e4m3_from_float(lane_value<T>(x[k], j) / scale).bits;
    }
  }
}

// The row loops of one instruction set. On x86-64 they are built twice: for the baseline
// (SSE2) and for AVX2, which a rank uses where the CPU has it (row_loops; TPFUSE_CPU_ISA=baseline
// keeps the baseline). The same operations on wider vectors, and no FMA in either (nor any
// contraction: the library is built with -ffp-contract=off): both give the same bits.
template <typename T>
struct RowLoops {
  void (*widen)(const Word*, int64_t, float*);
  void (*add_widened)(const Word*, int64_t, float*);
  void (*round_row)(const float*, int64_t, Word*);
  void (*square_row)(const Word*, int64_t, float*);
  void (*load_weight[2])(const Word*, int64_t, float*);  // by NormWeight
  void (*normalize_row)(const Word*, const float*, float, int64_t, Word*);
  float (*amax)(const Word*, int64_t);
  void (*quantize)(const Word*, int64_t, float, uint8_t*);
};

#define TPF_ROW_LOOPS_FOR(Name, attributes)                                                      \
  template <typename T>                                                                          \
  struct Name {                                                                                  \
    attributes static void widen(const Word* x, int64_t words, float* split) {                   \
      impl::widen<T>(x, words, split);                                                           \
    }                                                                                            \
    attributes static void add_widened(const Word* x, int64_t words, float* split) {             \
      impl::add_widened<T>(x, words, split);                                                     \
    }                                                                                            \
    attributes static void round_row(const float* split, int64_t words, Word* out) {             \
      impl::round_row<T>(split, words, out);                                                     \
    }                                                                                            \
    attributes static void square_row(const Word* rounded, int64_t words, float* squares) {      \
      impl::square_row<T>(rounded, words, squares);                                              \
    }                                                                                            \
    attributes static void load_gamma(const Word* gamma, int64_t words, float* split) {          \
      impl::load_weight<T, NormWeight::kGamma>(gamma, words, split);                             \
    }                                                                                            \
    attributes static void load_one_plus_gamma(const Word* gamma, int64_t words, float* split) { \
      impl::load_weight<T, NormWeight::kOnePlusGamma>(gamma, words, split);                      \
    }                                                                                            \
    attributes static void normalize_row(const Word* rounded, const float* weight, float scale,  \
                                         int64_t words, Word* out) {                             \
      impl::normalize_row<T>(rounded, weight, scale, words, out);                                \
    }                                                                                            \
    attributes static float amax(const Word* x, int64_t words) {                                 \
      return impl::row_amax<T>(x, words);                                                        \
    }                                                                                            \
    attributes static void quantize(const Word* x, int64_t words, float scale, uint8_t* out) {   \
      impl::quantize_words<T>(x, words, scale, out);                                             \
    }                                                                                            \
    static constexpr RowLoops<T> loops() {                                                       \
      return {&widen,                                                                            \
              &add_widened,                                                                      \
              &round_row,                                                                        \
              &square_row,                                                                       \
              {&load_gamma, &load_one_plus_gamma},                                               \
              &normalize_row,                                                                    \
              &amax,                                                                             \
              &quantize};                                                                        \
    }                                                                                            \
  };

TPF_ROW_LOOPS_FOR(BaselineLoops, )
#if defined(__x86_64__)
TPF_ROW_LOOPS_FOR(Avx2Loops, __attribute__((target("avx2"))))
#endif

template <typename T>
const RowLoops<T>& row_loops() {
  static const RowLoops<T> loops = [] {
#if defined(__x86_64__)
    const char* isa = std::getenv("TPFUSE_CPU_ISA");
    const bool baseline = isa != nullptr && std::strcmp(isa, "baseline") == 0;
    if (!baseline && __builtin_cpu_supports("avx2")) return Avx2Loops<T>::loops();
#endif
    return BaselineLoops<T>::loops();
  }();
  return loops;
}

// The FP8 output of one row from its normalized row (as stored in norm_out): the Output policy
// of the call's mode (tpfuse/impl/epilogue/outputs.h) gives the scale of the token or of each
// group of kQuantGroupSize elements from its amax, with the same step as the GPU's; the call's
// scale for kCall.
template <typename T>
void quantize_row(const RowLoops<T>& loops, const Word* normalized, const RowCall& p,
                  int64_t token) {
  const int64_t words = p.hidden / kLanes<T>;
  uint8_t* const out = static_cast<uint8_t*>(p.quant_out) + token * p.hidden;
  dispatch_output(p.quant, [&](auto output) {
    using Output = decltype(output);
    if constexpr (Output::kScope == OutputScope::kCall) {
      loops.quantize(normalized, words, *p.quant_scale, out);
    } else if constexpr (Output::kScope == OutputScope::kToken) {
      const float scale = Output::scale(dynamic_scale(loops.amax(normalized, words)));
      p.scales_out[token] = scale;
      loops.quantize(normalized, words, scale, out);
    } else if constexpr (Output::kScope == OutputScope::kGroup) {
      const int64_t per_group = kQuantGroupSize / kLanes<T>;
      const int64_t groups = p.hidden / kQuantGroupSize;
      for (int64_t g = 0; g < groups; ++g) {
        const float scale =
            Output::scale(dynamic_scale(loops.amax(normalized + g * per_group, per_group)));
        p.scales_out[group_scale_index(token, g, p.tokens, groups, p.scales_column_major)] = scale;
        loops.quantize(normalized + g * per_group, per_group, scale, out + g * kQuantGroupSize);
      }
    }
  });
}

// The epilogue over rows whose rank sum (fp32, split by lane) is in sum(): finish() rounds a row
// and stores it at once (on_rounded sees it: the two-shot owner sends it to its peers there); the
// norm follows for kGroupRows rows at a time (flush(): also the rows left at the end).
template <typename T, typename Epilogue>
class RowFinisher {
 public:
  RowFinisher(const RowCall& p, RowScratch& scratch)
      : p_(p),
        n_(p.hidden),
        words_(p.hidden / kLanes<T>),
        row_bytes_(size_t(p.hidden) * sizeof(T)),
        sum_(static_cast<float*>(scratch.sum.reserve(size_t(n_) * sizeof(float)))),
        rounded_(static_cast<Word*>(scratch.rounded.reserve(kGroupRows * row_bytes_))) {
    if constexpr (Epilogue::kHasNorm) {
      squares_ = static_cast<float*>(scratch.squares.reserve(kGroupRows * size_t(n_) * 4));
      weight_ = static_cast<float*>(scratch.weight.reserve(size_t(n_) * sizeof(float)));
      const int weight = Epilogue::kKind.weight == NormWeight::kOnePlusGamma ? 1 : 0;
      loops_.load_weight[weight](static_cast<const Word*>(p.gamma), words_, weight_);
      if constexpr (Epilogue::kHasQuant) {
        normalized_ = static_cast<Word*>(scratch.normalized.reserve(row_bytes_));
      }
    }
  }

  float* sum() { return sum_; }

  // round_sum for the row of `token`: + residual, one rounding, canonical zeros; the rounded row
  // to residual_out (out without a norm) and to on_rounded(const void* row).
  template <typename OnRounded>
  void finish(int64_t token, OnRounded&& on_rounded) {
    Word* const rounded = rounded_ + size_t(rows_) * size_t(words_);
    if constexpr (Epilogue::kHasResidual) {
      loops_.add_widened(row_of(p_.residual, token), words_, sum_);
    }
    loops_.round_row(sum_, words_, rounded);
    void* destination = Epilogue::kHasNorm ? p_.residual_out : p_.norm_out;
    if (destination != nullptr) std::memcpy(row_of(destination, token), rounded, row_bytes_);
    on_rounded(static_cast<const void*>(rounded));
    if constexpr (Epilogue::kHasNorm) {
      loops_.square_row(rounded, words_, squares_ + size_t(rows_) * size_t(n_));
      tokens_[rows_] = token;
      if (++rows_ == kGroupRows) flush();
    }
  }
  void finish(int64_t token) {
    finish(token, [](const void*) {});
  }

  // The norm of the rows finished since the last flush.
  void flush() {
    if constexpr (Epilogue::kHasNorm) {
      if (rows_ == 0) return;
      float sums[kGroupRows];
      sums_of_squares<kLanes<T>>(squares_, n_, words_, rows_, sums);
      for (int r = 0; r < rows_; ++r) {
        const float scale = rms_scale(sums[r], p_.hidden, p_.eps);
        Word* const out = Epilogue::kHasQuant ? normalized_ : row_of(p_.norm_out, tokens_[r]);
        loops_.normalize_row(rounded_ + size_t(r) * size_t(words_), weight_, scale, words_, out);
        if constexpr (Epilogue::kHasQuant) {
          if (p_.norm_out != nullptr) std::memcpy(row_of(p_.norm_out, tokens_[r]), out, row_bytes_);
          quantize_row<T>(loops_, out, p_, tokens_[r]);
        }
      }
      rows_ = 0;
    }
  }

 private:
  Word* row_of(void* base, int64_t token) const {
    return reinterpret_cast<Word*>(static_cast<char*>(base) + size_t(token) * row_bytes_);
  }
  const Word* row_of(const void* base, int64_t token) const {
    return reinterpret_cast<const Word*>(static_cast<const char*>(base) +
                                         size_t(token) * row_bytes_);
  }

  const RowCall& p_;
  const RowLoops<T>& loops_ = row_loops<T>();
  const int64_t n_;
  const int64_t words_;
  const size_t row_bytes_;
  float* const sum_;
  Word* const rounded_;       // kGroupRows rows
  float* squares_ = nullptr;  // kGroupRows rows, split by lane
  float* weight_ = nullptr;
  Word* normalized_ = nullptr;
  int rows_ = 0;
  int64_t tokens_[kGroupRows] = {};
};

// The rank sum, in rank order, of one row into `sum`: this rank's own row from `own`, sentinel
// words rewritten as a peer receives them, and every other sender's packets at `offset` of its
// region of this rank's slot.
template <typename T>
void receive_row(const CpuSession& session, CpuCall& call, const RowCall& p, size_t offset,
                 const void* own, float* sum) {
  const Exchange& x = p.exchange;
  const size_t row_bytes = size_t(p.hidden) * sizeof(T);
  void* const packets = row_scratch().packets.reserve(row_bytes);
  const RowLoops<T>& loops = row_loops<T>();
  for (int r = 0; r < x.world_size; ++r) {
    if (r == x.rank) {
      copy_rewritten(own, row_bytes, packets);
    } else {
      poll_packets(session.receive_region(x, r) + offset, row_bytes, call, r, packets);
    }
    if (r == 0) {
      loops.widen(static_cast<const Word*>(packets), p.hidden / kLanes<T>, sum);
    } else {
      loops.add_widened(static_cast<const Word*>(packets), p.hidden / kLanes<T>, sum);
    }
  }
}

// Stores `bytes` of `row` (sentinel words rewritten) at `offset` of this rank's sender region of
// the call's slot in every other rank's workspace, the next rank first.
void send_to_peers(const Exchange& x, const CpuSession& session, size_t offset, const void* row,
                   size_t bytes) {
  for (int step = 1; step < x.world_size; ++step) {
    const int receiver = (x.rank + step) % x.world_size;
    store_packets(x.workspace[receiver] + session.send_offset(x) + offset, row, bytes);
  }
}

template <typename T, typename Epilogue>
void oneshot(const RowCall& p) {
  const Exchange& x = p.exchange;
  const CpuSession session = begin_session(x);
  const size_t row_bytes = size_t(p.hidden) * sizeof(T);
  const auto input_row = [&](int64_t token) {
    return static_cast<const char*>(p.input) + size_t(token) * row_bytes;
  };

  // Send: the call header, then this rank's packet, sentinel words rewritten, into every other
  // rank's slot, row by row.
  CpuCall call = start_call(x, session, p.signature);
  void* const packets = row_scratch().packets.reserve(row_bytes);
  for (int64_t token = 0; token < p.tokens; ++token) {
    copy_rewritten(input_row(token), row_bytes, packets);
    send_to_peers(x, session, size_t(token) * row_bytes, packets, row_bytes);
  }
  session.clear_previous(x);

  // Receive: sum every rank's packet in rank order, then the epilogue.
  RowFinisher<T, Epilogue> finisher(p, row_scratch());
  for (int64_t token = 0; token < p.tokens; ++token) {
    receive_row<T>(session, call, p, size_t(token) * row_bytes, input_row(token), finisher.sum());
    finisher.finish(token);
  }
  finisher.flush();
  session.arrive(x.control, uint64_t(p.tokens) * row_bytes);
  finish_call(call);
}

// Two-shot (tpfuse/impl/lamport.h): reduce-scatter the input rows to their owners, finish the
// owned rows and all-gather them rounded, finish the rows received rounded.
template <typename T, typename Epilogue>
void twoshot(const RowCall& p) {
  const Exchange& x = p.exchange;
  const CpuSession session = begin_session(x);
  CpuCall call = start_call(x, session, p.signature);
  const int rank = x.rank;
  const size_t row_bytes = size_t(p.hidden) * sizeof(T);
  const TwoShotLayout layout(p.tokens, session.world(x));
  const auto input_row = [&](int64_t token) {
    return static_cast<const char*>(p.input) + size_t(token) * row_bytes;
  };

  // Reduce-scatter: each input row to the rank that owns its token (its own rows stay in its
  // input), the next rank first.
  void* const packets = row_scratch().packets.reserve(row_bytes);
  for (int step = 1; step < x.world_size; ++step) {
    const int owner = (rank + step) % x.world_size;
    for (int64_t local = 0; local < layout.count(owner); ++local) {
      copy_rewritten(input_row(layout.begin(owner) + local), row_bytes, packets);
      store_packets(
          x.workspace[owner] + session.send_offset(x) + layout.scatter_row(local, row_bytes),
          packets, row_bytes);
    }
  }
  session.clear_previous(x);

  // Owned rows: rank-ordered sum, epilogue, and the rounded row to every other rank.
  {
    RowFinisher<T, Epilogue> finisher(p, row_scratch());
    for (int64_t local = 0; local < layout.count(rank); ++local) {
      const int64_t token = layout.begin(rank) + local;
      receive_row<T>(session, call, p, layout.scatter_row(local, row_bytes), input_row(token),
                     finisher.sum());
      finisher.finish(token, [&](const void* rounded) {
        send_to_peers(x, session, layout.gather_row(local, row_bytes), rounded, row_bytes);
      });
    }
    finisher.flush();
  }

  // Rows other ranks own arrive rounded: finish them exactly as their owner did.
  RowFinisher<T, typename Epilogue::Gathered> finisher(p, row_scratch());
  for (int step = 1; step < x.world_size; ++step) {
    const int owner = (rank + step) % x.world_size;
    const char* base = session.receive_region(x, owner);
    for (int64_t local = 0; local < layout.count(owner); ++local) {
      poll_packets(base + layout.gather_row(local, row_bytes), row_bytes, call, owner, packets);
      row_loops<T>().widen(static_cast<const Word*>(packets), p.hidden / kLanes<T>, finisher.sum());
      finisher.finish(layout.begin(owner) + local);
    }
  }
  finisher.flush();
  session.arrive(x.control, layout.sender_bytes(row_bytes));
  finish_call(call);
}

template <typename T, typename Epilogue>
void local_epilogue(const RowCall& p) {
  RowFinisher<T, Epilogue> finisher(p, row_scratch());
  for (int64_t token = 0; token < p.tokens; ++token) {
    row_loops<T>().widen(static_cast<const Word*>(p.input) + token * (p.hidden / kLanes<T>),
                         p.hidden / kLanes<T>, finisher.sum());
    finisher.finish(token);
  }
  finisher.flush();
}

// Binds dtype and epilogue and calls fn(T, Epilogue).
template <typename Fn>
void dispatch_row(DType dtype, const RowEpilogueKind& kind, Fn&& fn) {
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = typename decltype(type_tag)::type;
    const bool found = dispatch_epilogue_in(RowEpilogues{}, kind,
                                            [&](auto epilogue) { fn(TypeTag<T>{}, epilogue); });
    if (!found) TPF_FAIL("no row epilogue for this combination");  // validate_* rule it out
  });
}

}  // namespace

void cpu_oneshot(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  dispatch_row(dtype, epilogue, [&](auto type_tag, auto epilogue_tag) {
    oneshot<typename decltype(type_tag)::type, decltype(epilogue_tag)>(call);
  });
}

void cpu_twoshot(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  dispatch_row(dtype, epilogue, [&](auto type_tag, auto epilogue_tag) {
    twoshot<typename decltype(type_tag)::type, decltype(epilogue_tag)>(call);
  });
}

void cpu_local_epilogue(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  dispatch_row(dtype, epilogue, [&](auto type_tag, auto epilogue_tag) {
    local_epilogue<typename decltype(type_tag)::type, decltype(epilogue_tag)>(call);
  });
}

// The header of one protocol call of the NCCL path's stand-in: labelled kNccl (so that a fused
// peer is told the algorithm differs), with its payload's dtype, rows and width (what an absent
// call drains), the user call's epilogue bits, and a hash of the user call's whole signature and
// the piece's index (so that ranks whose calls disagree in anything are told, at the first piece).
CallSignature stand_in_signature(const CallSignature& user, DType payload, int64_t rows,
                                 int64_t width, uint32_t piece) {
  const uint32_t qk = user.op() == CallOp::kQkOneShot ? kStandInQkBit : 0u;
  const uint32_t word0 = kOpField.encode(uint32_t(CallOp::kNccl)) |
                         kDTypeField.encode(uint32_t(payload)) |
                         (user.header.word[0] & kRowEpilogueBits) | qk;
  const uint32_t extra[] = {user.hash(), piece};
  return make_signature(word0, uint32_t(rows), uint32_t(width), extra, 2);
}

void cpu_allreduce_rows(const Exchange& exchange, const CallSignature& user, const void* input,
                        void* out, int64_t rows, int64_t row_elements, DType dtype) {
  const size_t element = dtype_size(dtype);
  size_t row_bytes = size_t(row_elements) * element;
  if (row_bytes > exchange.packet_bytes) {
    // A row wider than a packet: the sum is element-wise, so the message is cut into rows of
    // one packet (the last one shorter), each carried by a call of its own.
    const int64_t total = rows * row_elements;
    const int64_t width = int64_t(exchange.packet_bytes / element);
    const int64_t full = total / width;
    uint32_t piece = 0;
    const auto run = [&](int64_t first_element, int64_t count) {
      RowCall sum{};
      sum.exchange = exchange;
      sum.signature = stand_in_signature(user, dtype, 1, count, piece++);
      sum.input = static_cast<const char*>(input) + size_t(first_element) * element;
      sum.norm_out = static_cast<char*>(out) + size_t(first_element) * element;
      sum.tokens = 1;
      sum.hidden = count;
      cpu_oneshot(sum, dtype, SumEpilogue::kKind);
    };
    for (int64_t r = 0; r < full; ++r) run(r * width, width);
    if (total % width != 0) run(full * width, total % width);
    return;
  }
  const int64_t chunk = int64_t(exchange.packet_bytes / row_bytes);
  uint32_t piece = 0;
  for (int64_t first = 0; first < rows; first += chunk) {
    const int64_t count = std::min(chunk, rows - first);
    RowCall sum{};
    sum.exchange = exchange;
    sum.signature = stand_in_signature(user, dtype, count, row_elements, piece++);
    sum.input = static_cast<const char*>(input) + size_t(first) * row_bytes;
    sum.norm_out = static_cast<char*>(out) + size_t(first) * row_bytes;
    sum.tokens = count;
    sum.hidden = row_elements;
    cpu_oneshot(sum, dtype, SumEpilogue::kKind);
  }
}

void cpu_nccl_path(const RowCall& call, DType dtype, const RowEpilogueKind& epilogue) {
  if (!epilogue.norm) {
    cpu_allreduce_rows(call.exchange, call.signature, call.input, call.norm_out, call.tokens,
                       call.hidden, dtype);
    return;
  }
  // The sum, rounded to dtype as NCCL delivers it, then the local epilogue on it.
  std::vector<Vec16> sum(size_t(call.tokens * call.hidden) * dtype_size(dtype) / 16);
  cpu_allreduce_rows(call.exchange, call.signature, call.input, sum.data(), call.tokens,
                     call.hidden, dtype);
  RowCall local = call;
  local.input = sum.data();
  cpu_local_epilogue(local, dtype, epilogue);
}

}  // namespace tpfuse::impl
