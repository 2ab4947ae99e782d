// Faults at random (issue 40), written once for every backend: the sequence generator, the
// runner of a rank (teams of threads, or of forked processes), the verifier with its oracle, the
// shrinker and the report. tests/cpu/test_fault_random.cc runs it on CPU teams of threads (world
// 2-8) and of processes (world 2-4); tests/gpu/test_fault_random_gpu.cc on CUDA teams of one
// process a rank, every rank on GPU 0 (world 2-4).
//
// Long seeded sequences of valid calls, rejected calls (a bad argument on one rank, or
// reject_call), calls that disagree, late peers past a short timeout, teams without peer stores
// and tiny packets (where the backend's team has them: Limits below). Every call of every rank
// must end in one of two ways: the exact result, or a tpfuse::Error, as the rules say:
//   - a valid call whose peers make the same valid call: the exact result, the same bits on
//     every rank;
//   - a rank that rejects its call throws its own argument error (reject_call returns), writes
//     nothing; its peers throw an Error saying it rejected its part, every output of theirs NaN;
//     the team goes on (peer stores or not, every algorithm);
//   - ranks whose calls disagree: every rank throws an Error naming a peer, every output NaN, and
//     the team is failed: Team::check() and every later call throw at once, on every rank;
//   - a peer late past the timeout: each waiting rank throws naming it (or, if it came in time
//     for that rank, returns the exact result); the late rank throws or returns the exact
//     result, never a mix; if any rank threw, the team is failed on every rank as above.
// After a team is failed (and after every disagreement or late peer) the ranks make a new team.
// A CUDA rank's call "throws" where the call itself or the Team::check() after its stream's work
// does (its errors are reported there: tpfuse.h).
//
// The reference is exact without a second implementation: inputs are small integers, so every
// sum is exact in fp32 and in each dtype, and the outputs are the backend's own local ops'
// (add_rmsnorm, qk_rmsnorm_from_sums on the exact sums) bit for bit, whatever the algorithm. The
// backend supplies that reference (reference_hashes on its Memory): the CPU's local ops for the
// CPU, the GPU's for the GPU (whose norm's last bit may differ from the host's).
//
// On a failure the test prints the seed, shrinks the sequence (drops steps, lowers the world
// while the same rule still fails) and prints how to re-run the shortest one:
//   TPFUSE_FAULT_SEED=s TPFUSE_FAULT_STEPS=n [TPFUSE_FAULT_WORLD=w] [TPFUSE_FAULT_KEEP=i,j,..]
// runs the one sequence of seed s (n steps, only steps i, j, ... kept, on world w);
// TPFUSE_FAULT_CALLS sets how many calls the bounded run makes; TPFUSE_FAULT_NO_SHRINK=1 skips
// the shrinking; TPFUSE_FAULT_SURVEY=1 runs every sequence and prints each one's first failure;
// TPFUSE_FAULT_PRINT=1 lists each sequence's steps.
#pragma once

#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tpfuse/tpfuse.h"

namespace tpfuse::testing::fault_random {

// Every team but a late peer's. Long enough that a loaded 2-core machine (CI, builds beside it)
// never makes a peer that is on time look late; a broken sequence still ends within a few of
// them (note_timeout below).
constexpr double kLongTimeout = 10.0;
constexpr int kStepsPerSequence = 250;

// What a backend's teams can be asked for: the generator draws nothing else.
struct Limits {
  bool peer_stores_optional = true;  // teams without peer stores (all-NCCL) may be drawn
  std::array<size_t, 5> packets = {64, 256, 4096, 64 << 10, 64 << 10};  // packet_bytes drawn
  bool nccl = true;  // the teams have an NCCL path (the CPU's stand-in): Algorithm::kNccl drawn
  // A late peer's team times out after late_timeout + late_timeout_step * k s, k in 0..3; the
  // late rank comes 3 times that late.
  double late_timeout = 0.05;
  double late_timeout_step = 0.01;
};

// --- the sequence ---

enum class Op : int { kRows = 0, kAllreduce = 1, kQkNorm = 2 };
enum class Fault : int { kNone = 0, kBadArgument = 1, kRejectCall = 2, kDisagree = 3 };

struct TeamConfig {
  bool peer_stores = true;
  size_t packet_bytes = 64 << 10;
};

// One call as every rank makes it (a disagreeing rank's is changed from it).
struct Call {
  Op op = Op::kRows;
  DType dtype = DType::kBFloat16;
  Algorithm algorithm = Algorithm::kAuto;
  int64_t tokens = 1;
  int64_t hidden = 64;  // rows: hidden; allreduce: count = tokens * hidden
  float eps = 1e-6f;
  // Rows.
  bool residual = true;
  bool residual_out = true;  // without a residual
  bool norm_out = true;      // with an FP8 output
  NormWeight weight = NormWeight::kGamma;
  QuantMode quant = QuantMode::kNone;
  // QK norm: this rank's heads; kv_replicated: every rank holds the same KV heads.
  int64_t head_dim = 32;
  int64_t q_heads = 1;
  int64_t kv_heads = 1;
  bool kv_replicated = false;
  RopeStyle rope = RopeStyle::kNone;
  bool half_rotary = false;
  uint64_t data_seed = 0;
};

struct Step {
  enum Kind { kCall, kNewTeam, kLate } kind = kCall;
  int index = 0;  // in the generated sequence
  TeamConfig config;
  Call call;
  Fault fault = Fault::kNone;
  int fault_rank = 0;  // taken modulo the world size
  int variant = 0;     // which bad argument or disagreement
  int warmup = 0;      // kLate: good calls before the late one, on the short-timeout team
  double timeout = 0.1;
};

struct Sequence {
  uint64_t seed = 0;
  int world = 2;
  TeamConfig first;
  std::vector<Step> steps;
  Limits limits;  // of the backend it was generated for
};

inline const char* op_name(Op op) {
  return op == Op::kRows ? "allreduce_add_rmsnorm" : op == Op::kAllreduce ? "allreduce" : "qk";
}

inline std::string describe(const Call& c) {
  std::ostringstream out;
  out << op_name(c.op) << " " << dtype_name(c.dtype) << " " << algorithm_name(c.algorithm)
      << " tokens=" << c.tokens;
  if (c.op == Op::kQkNorm) {
    out << " head_dim=" << c.head_dim << " q_heads=" << c.q_heads << " kv_heads=" << c.kv_heads
        << (c.kv_replicated ? " kv_replicated" : "");
    if (c.rope != RopeStyle::kNone) {
      out << " rope=" << int(c.rope) << (c.half_rotary ? " half_rotary" : "");
    }
  } else {
    out << " hidden=" << c.hidden;
  }
  if (c.op == Op::kRows) {
    out << (c.residual       ? " residual"
            : c.residual_out ? " residual_out"
                             : "")
        << (c.weight == NormWeight::kOnePlusGamma ? " one_plus_gamma" : "");
    if (c.quant != QuantMode::kNone) {
      out << " quant=" << quant_mode_name(c.quant) << (c.norm_out ? "" : " no_norm_out");
    }
  }
  if (c.op != Op::kAllreduce) out << " eps=" << c.eps;
  return out.str();
}

// --- bad arguments and disagreements ---

struct BadArgument {
  const char* expected;  // what the rejecting rank's error must contain
};

// Applied in execute() by index; the texts are what each rank's own error names.
inline const std::vector<BadArgument>& bad_arguments(Op op) {
  static const std::vector<BadArgument> rows = {
      {"gamma is null"},
      {"input is null"},
      {"tokens must be >= 0"},
      {"hidden must be"},
      {"eps"},
      {"dtype"},
      {"algorithm 9"},
      {"16-byte aligned"},
      {""} /* one-shot over capacity: any argument error (its tokens outgrow the buffers too) */};
  static const std::vector<BadArgument> sums = {
      {"count must be"}, {"input is null"}, {"dtype"}, {"algorithm 9"}, {"16-byte aligned"}};
  static const std::vector<BadArgument> qk = {{"q_gamma is null"},        {"qkv is null"},
                                              {"tokens must be >= 0"},    {"eps"},
                                              {"twoshot is not offered"}, {"kv_replicas"}};
  return op == Op::kRows ? rows : op == Op::kAllreduce ? sums : qk;
}

inline DType other_dtype(DType d) {
  return d == DType::kBFloat16 ? DType::kFloat16 : DType::kBFloat16;
}

// Rank `fault_rank`'s changed call for disagreement `variant`; false if it would not change it.
// Without an NCCL path (nccl false) a changed algorithm is one the team has.
inline bool disagree(Call& c, int variant, bool nccl) {
  const int kind = variant % 7;
  switch (c.op) {
    case Op::kRows:
      switch (kind) {
        case 0:
          c.tokens += 1;
          return true;
        case 1:
          if (c.quant == QuantMode::kPerTokenGroup128 || c.hidden + 8 > kMaxHidden) return false;
          c.hidden += 8;
          return true;
        case 2:
          c.eps *= 2;
          return true;
        case 3:
          c.dtype = other_dtype(c.dtype);
          return true;
        case 4:
          c.residual = !c.residual;
          c.residual_out = true;
          return true;
        case 5:
          if (variant % 2 == 0) {
            c.weight =
                c.weight == NormWeight::kGamma ? NormWeight::kOnePlusGamma : NormWeight::kGamma;
          } else {
            c.quant = c.quant == QuantMode::kNone ? QuantMode::kPerToken : QuantMode::kNone;
            c.norm_out = true;
          }
          return true;
        default:
          if (variant % 3 == 0) {
            c.op = Op::kAllreduce;
            return true;
          }
          c.algorithm = c.algorithm == Algorithm::kOneShot           ? Algorithm::kTwoShot
                        : c.algorithm == Algorithm::kTwoShot && nccl ? Algorithm::kNccl
                                                                     : Algorithm::kOneShot;
          return true;
      }
    case Op::kAllreduce:
      switch (kind % 4) {
        case 0:
          c.tokens += 1;
          return true;
        case 1:
          c.dtype = other_dtype(c.dtype);
          return true;
        case 2:
          c.op = Op::kRows;
          return true;
        default:
          c.algorithm = c.algorithm != Algorithm::kOneShot ? Algorithm::kOneShot
                        : nccl                             ? Algorithm::kNccl
                                                           : Algorithm::kTwoShot;
          return true;
      }
    case Op::kQkNorm:
      switch (kind % 6) {
        case 0:
          c.tokens += 1;
          return true;
        case 1:
          c.eps *= 2;
          return true;
        case 2:
          c.q_heads += 1;
          return true;
        case 3:
          c.dtype = other_dtype(c.dtype);
          return true;
        case 4:
          c.rope = c.rope == RopeStyle::kNone ? RopeStyle::kNeox : RopeStyle::kNone;
          return true;
        default:
          // The QK norm has one fused algorithm: without NCCL, auto (which runs it) for one-shot,
          // a change that makes no difference.
          c.algorithm = c.algorithm != Algorithm::kOneShot ? Algorithm::kOneShot
                        : nccl                             ? Algorithm::kNccl
                                                           : Algorithm::kAuto;
          return true;
      }
  }
  return false;
}

// The call rank `rank` makes at a step.
inline Call call_of(const Step& step, int rank, const Sequence& s) {
  Call c = step.call;
  if (step.kind == Step::kCall && step.fault == Fault::kDisagree &&
      rank == step.fault_rank % s.world) {
    disagree(c, step.variant, s.limits.nccl);
  }
  return c;
}

// --- generation ---

// (The draws are the same whatever the limits: a limit maps a draw, it never skips one.)
inline TeamConfig random_config(std::mt19937_64& rng, const Limits& limits) {
  TeamConfig config;
  config.peer_stores = rng() % 4 != 0 || !limits.peer_stores_optional;
  config.packet_bytes = limits.packets[rng() % 5];
  return config;
}

inline Call random_call(std::mt19937_64& rng, bool faulty, const Limits& limits) {
  Call c;
  const int op = int(rng() % 20);
  c.op = op < 10 ? Op::kRows : op < 15 ? Op::kAllreduce : Op::kQkNorm;
  const DType dtypes[] = {DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  c.dtype = dtypes[rng() % 3];
  c.eps = rng() % 2 ? 1e-6f : 1e-5f;
  c.data_seed = rng();
  const int64_t min_tokens = faulty ? 1 : 0;
  if (c.op == Op::kQkNorm) {
    const Algorithm algorithms[] = {Algorithm::kAuto, Algorithm::kOneShot, Algorithm::kNccl};
    c.algorithm = algorithms[rng() % 3];
    if (c.algorithm == Algorithm::kNccl && !limits.nccl) c.algorithm = Algorithm::kAuto;
    const int64_t dims[] = {16, 32, 64};
    c.head_dim = dims[rng() % 3];
    c.q_heads = 1 + int64_t(rng() % 4);
    c.kv_heads = 1 + int64_t(rng() % 2);
    c.kv_replicated = rng() % 4 == 0;
    c.tokens = std::max<int64_t>(min_tokens, int64_t(rng() % 11));
    if (rng() % 3 == 0) {
      c.rope = rng() % 2 ? RopeStyle::kNeox : RopeStyle::kInterleaved;
      c.half_rotary = rng() % 2;
    }
    return c;
  }
  const Algorithm algorithms[] = {Algorithm::kAuto, Algorithm::kOneShot, Algorithm::kTwoShot,
                                  Algorithm::kNccl};
  c.algorithm = algorithms[rng() % 4];
  if (c.algorithm == Algorithm::kNccl && !limits.nccl) c.algorithm = Algorithm::kAuto;
  const int64_t widths[] = {8, 16, 24, 64, 128, 256, 384, 1024};
  c.hidden = widths[rng() % 8];
  c.tokens = std::max<int64_t>(c.op == Op::kAllreduce ? 1 : min_tokens, int64_t(rng() % 13));
  if (c.op == Op::kRows) {
    c.residual = rng() % 10 < 7;
    c.residual_out = c.residual || rng() % 2;
    c.weight = rng() % 5 == 0 ? NormWeight::kOnePlusGamma : NormWeight::kGamma;
    if (rng() % 5 == 0) {
      const QuantMode modes[] = {QuantMode::kStatic, QuantMode::kPerToken,
                                 QuantMode::kPerTokenGroup128};
      c.quant = modes[rng() % 3];
      if (c.quant == QuantMode::kPerTokenGroup128 && c.hidden % kQuantGroupSize != 0) {
        c.quant = QuantMode::kPerToken;
      }
      c.norm_out = rng() % 10 < 7;
    }
  }
  return c;
}

inline Sequence generate(uint64_t seed, int steps, int min_world, int max_world,
                         const Limits& limits) {
  std::mt19937_64 rng(seed);
  Sequence s;
  s.seed = seed;
  s.limits = limits;
  s.world = min_world + int(rng() % uint64_t(max_world - min_world + 1));
  s.first = random_config(rng, limits);
  for (int i = 0; i < steps; ++i) {
    Step step;
    step.index = i;
    const int draw = int(rng() % 1000);
    if (draw < 25) {
      step.kind = Step::kNewTeam;
      step.config = random_config(rng, limits);
    } else if (draw < 29) {
      step.kind = Step::kLate;
      step.call = random_call(rng, true, limits);
      step.fault_rank = int(rng() % 64);
      step.warmup = int(rng() % 3);
      step.timeout = limits.late_timeout + limits.late_timeout_step * double(rng() % 4);
    } else {
      const int fault = int(rng() % 100);
      step.fault = fault < 72   ? Fault::kNone
                   : fault < 84 ? Fault::kBadArgument
                   : fault < 90 ? Fault::kRejectCall
                                : Fault::kDisagree;
      step.call = random_call(rng, step.fault != Fault::kNone, limits);
      step.fault_rank = int(rng() % 64);
      step.variant = int(rng() % 1024);
    }
    s.steps.push_back(step);
  }
  return s;
}

// Collective calls a sequence makes (a probe after a failure counts; Team::check does not).
inline int calls_of(const Sequence& s) {
  int calls = 0;
  for (const Step& step : s.steps) {
    if (step.kind == Step::kCall) calls += step.fault == Fault::kDisagree ? 2 : 1;
    if (step.kind == Step::kLate) calls += step.warmup + 2;
  }
  return calls;
}

inline std::string describe(const Step& step, const Sequence& s) {
  const int world = s.world;
  std::ostringstream out;
  out << "step " << step.index << ": ";
  switch (step.kind) {
    case Step::kNewTeam:
      out << "new team, peer_stores=" << step.config.peer_stores
          << " packet_bytes=" << step.config.packet_bytes;
      break;
    case Step::kLate:
      out << "a team with timeout " << step.timeout << " s, " << step.warmup
          << " good call(s), then rank " << step.fault_rank % world << " late (" << 3 * step.timeout
          << " s) to " << describe(step.call);
      break;
    case Step::kCall:
      out << describe(step.call);
      if (step.fault == Fault::kBadArgument) {
        const auto& bad = bad_arguments(step.call.op);
        out << "; rank " << step.fault_rank % world << " gives a bad argument ("
            << bad[size_t(step.variant) % bad.size()].expected << ")";
      } else if (step.fault == Fault::kRejectCall) {
        out << "; rank " << step.fault_rank % world << " calls reject_call";
      } else if (step.fault == Fault::kDisagree) {
        out << "; rank " << step.fault_rank % world << " calls "
            << describe(call_of(step, step.fault_rank % world, s));
      }
      break;
  }
  return out.str();
}

// --- data ---

struct Aligned {
  explicit Aligned(size_t n) : bytes(n) {
    data = static_cast<uint8_t*>(std::aligned_alloc(64, capacity()));
    std::memset(data, 0x5a, capacity());
  }
  size_t capacity() const { return (bytes + 64) / 64 * 64 + 64; }  // allocated (poisoned) bytes
  ~Aligned() { std::free(data); }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  uint8_t* data;
  size_t bytes;
};

// One element of a dtype holding a small integer (or a dyadic fraction): exact in every dtype.
inline void store(DType dtype, void* base, size_t i, float x) {
  if (dtype == DType::kFloat32) {
    std::memcpy(static_cast<char*>(base) + 4 * i, &x, 4);
    return;
  }
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  uint16_t h;
  if (dtype == DType::kBFloat16) {
    h = uint16_t(bits >> 16);  // exact: the values below have at most 8 significant bits
  } else {
    // fp16 of a value with few significant bits and magnitude in [2^-14, 2^15), or zero.
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const int exponent = int((bits >> 23) & 0xff) - 127;
    if ((bits & 0x7fffffffu) == 0) {
      h = uint16_t(sign);
    } else {
      h = uint16_t(sign | uint32_t(exponent + 15) << 10 | ((bits >> 13) & 0x3ffu));
    }
  }
  std::memcpy(static_cast<char*>(base) + 2 * i, &h, 2);
}

// Everything the call reads, for every rank (the same on every rank where TP has it the same).
struct CallData {
  std::vector<std::vector<float>> inputs;  // rows: [tokens, hidden]; qk: [tokens, q + 2 kv]
  std::vector<float> residual, gamma, k_gamma;
  std::vector<int64_t> positions;
  std::vector<float> cos_sin;
  int64_t max_position = 0;
};

inline int64_t q_size(const Call& c) {
  return c.q_heads * c.head_dim;
}
inline int64_t kv_size(const Call& c) {
  return c.kv_heads * c.head_dim;
}
inline int64_t row_elements(const Call& c) {
  return c.op == Op::kQkNorm ? q_size(c) + 2 * kv_size(c) : c.hidden;
}

inline CallData make_data(const Call& c, int world) {
  std::mt19937_64 rng(c.data_seed);
  CallData d;
  const auto integer = [&](int bound) {
    return float(int(rng() % uint64_t(2 * bound + 1)) - bound);
  };
  const size_t count = size_t(std::max<int64_t>(c.tokens, 0) * row_elements(c));
  for (int r = 0; r < world; ++r) {
    d.inputs.emplace_back(count);
    for (float& x : d.inputs.back()) x = integer(8);
  }
  d.residual.resize(count);
  for (float& x : d.residual) x = integer(8);
  const size_t width = size_t(c.op == Op::kQkNorm ? q_size(c) : c.hidden);
  d.gamma.resize(width);
  for (float& x : d.gamma) x = integer(8) / 4;
  d.k_gamma.resize(size_t(kv_size(c)));
  for (float& x : d.k_gamma) x = integer(8) / 4;
  if (c.op == Op::kQkNorm && c.rope != RopeStyle::kNone) {
    d.max_position = 16;
    const int64_t rotary = c.half_rotary ? c.head_dim / 2 : c.head_dim;
    d.cos_sin.resize(size_t(d.max_position * rotary));
    for (float& x : d.cos_sin) x = integer(8) / 8;
    d.positions.resize(size_t(std::max<int64_t>(c.tokens, 1)));  // never null: rope needs it
    for (int64_t& p : d.positions) p = int64_t(rng() % uint64_t(d.max_position));
  }
  return d;
}

// --- one rank's buffers of a call ---

enum class Kind { kDtype, kFp8, kFloat32 };
struct Output {
  uint8_t* data;
  size_t bytes;
  Kind kind;
};

struct RankBuffers {
  std::vector<std::unique_ptr<Aligned>> owned;
  uint8_t* input = nullptr;  // rows, allreduce: input; qk: qkv
  uint8_t* residual = nullptr;
  uint8_t* gamma = nullptr;
  uint8_t* k_gamma = nullptr;
  uint8_t* residual_out = nullptr;
  uint8_t* norm_out = nullptr;  // allreduce: out; qk: q_out
  uint8_t* k_out = nullptr;
  uint8_t* quant_out = nullptr;
  float* scales = nullptr;
  float* static_scale = nullptr;
  int64_t* positions = nullptr;  // qk with rope: CallData's, copied here with every argument
  float* cos_sin = nullptr;
  std::vector<Output> outputs;

  uint8_t* allocate(size_t bytes) {
    owned.push_back(std::make_unique<Aligned>(bytes));
    return owned.back()->data;
  }
};

inline size_t scale_count(const Call& c) {
  if (c.quant == QuantMode::kPerToken) return size_t(c.tokens);
  if (c.quant == QuantMode::kPerTokenGroup128) return size_t(c.tokens * (c.hidden / 128));
  return 0;
}

// Inputs of rank `rank` filled, outputs poisoned (0x5a), for call c.
inline void prepare(RankBuffers& b, const Call& c, const CallData& d, int rank) {
  const int64_t tokens = std::max<int64_t>(c.tokens, 0);
  const size_t elements = size_t(tokens * row_elements(c));
  const size_t element = dtype_size(c.dtype);
  b.input = b.allocate(elements * element);
  for (size_t i = 0; i < elements; ++i) store(c.dtype, b.input, i, d.inputs[size_t(rank)][i]);
  b.gamma = b.allocate(d.gamma.size() * element);
  for (size_t i = 0; i < d.gamma.size(); ++i) store(c.dtype, b.gamma, i, d.gamma[i]);
  if (c.op == Op::kQkNorm) {
    b.k_gamma = b.allocate(d.k_gamma.size() * element);
    for (size_t i = 0; i < d.k_gamma.size(); ++i) store(c.dtype, b.k_gamma, i, d.k_gamma[i]);
    if (!d.positions.empty()) {
      b.positions = reinterpret_cast<int64_t*>(b.allocate(d.positions.size() * 8));
      std::memcpy(b.positions, d.positions.data(), d.positions.size() * 8);
      b.cos_sin = reinterpret_cast<float*>(b.allocate(d.cos_sin.size() * 4));
      std::memcpy(b.cos_sin, d.cos_sin.data(), d.cos_sin.size() * 4);
    }
    b.norm_out = b.allocate(size_t(tokens * q_size(c)) * element);
    b.k_out = b.allocate(size_t(tokens * kv_size(c)) * element);
    b.outputs = {{b.norm_out, size_t(tokens * q_size(c)) * element, Kind::kDtype},
                 {b.k_out, size_t(tokens * kv_size(c)) * element, Kind::kDtype}};
    return;
  }
  const size_t bytes = elements * element;
  b.norm_out = b.allocate(bytes);
  if (c.op == Op::kAllreduce) {
    b.outputs = {{b.norm_out, bytes, Kind::kDtype}};
    return;
  }
  b.residual = b.allocate(bytes);
  for (size_t i = 0; i < elements; ++i) store(c.dtype, b.residual, i, d.residual[i]);
  b.outputs.clear();
  if (c.residual || c.residual_out) {
    b.residual_out = b.allocate(bytes);
    b.outputs.push_back({b.residual_out, bytes, Kind::kDtype});
  }
  if (c.quant == QuantMode::kNone || c.norm_out)
    b.outputs.push_back({b.norm_out, bytes, Kind::kDtype});
  if (c.quant != QuantMode::kNone) {
    b.quant_out = b.allocate(elements);
    b.outputs.push_back({b.quant_out, elements, Kind::kFp8});
    if (c.quant == QuantMode::kStatic) {
      b.static_scale = reinterpret_cast<float*>(b.allocate(4));
      *b.static_scale = 0.0625f;
    } else {
      b.scales = reinterpret_cast<float*>(b.allocate(scale_count(c) * 4));
      b.outputs.push_back(
          {reinterpret_cast<uint8_t*>(b.scales), scale_count(c) * 4, Kind::kFloat32});
    }
  }
}

inline AddRmsNormArgs rows_args(const RankBuffers& b, const Call& c) {
  AddRmsNormArgs a;
  a.input = b.input;
  a.residual = c.residual ? b.residual : nullptr;
  a.gamma = b.gamma;
  a.residual_out = b.residual_out;
  a.norm_out = c.quant == QuantMode::kNone || c.norm_out ? b.norm_out : nullptr;
  a.quant = c.quant;
  a.quant_out = b.quant_out;
  a.quant_scale = b.static_scale;
  a.scales_out = b.scales;
  a.tokens = c.tokens;
  a.hidden = c.hidden;
  a.dtype = c.dtype;
  a.eps = c.eps;
  a.norm_weight = c.weight;
  a.algorithm = c.algorithm;
  return a;
}

inline QkNormArgs qk_args(const RankBuffers& b, const Call& c, const CallData& d, int world) {
  QkNormArgs a;
  a.qkv = b.input;
  a.q_out = b.norm_out;
  a.k_out = b.k_out;
  a.q_gamma = b.gamma;
  a.k_gamma = b.k_gamma;
  a.tokens = c.tokens;
  a.q_size = q_size(c);
  a.kv_size = kv_size(c);
  a.kv_replicas = c.kv_replicated ? world : 1;
  a.q_global_size = q_size(c) * world;
  a.k_global_size = kv_size(c) * world / a.kv_replicas;
  a.dtype = c.dtype;
  a.eps = c.eps;
  a.algorithm = c.algorithm;
  if (c.rope != RopeStyle::kNone) {
    a.rope = c.rope;
    a.head_dim = c.head_dim;
    a.rotary_dim = c.half_rotary ? c.head_dim / 2 : c.head_dim;
    a.positions = b.positions;
    a.cos_sin_cache = b.cos_sin;
    a.max_position = d.max_position;
  }
  return a;
}

// --- where the library sees a rank's buffers ---

// A rank's buffers are made in host memory (prepare); a backend whose calls take its own memory
// (CUDA: device pointers) mirrors them there. The host's is the identity: nothing copied.
class Memory {
 public:
  virtual ~Memory() = default;
  virtual Backend backend() const { return Backend::kCpu; }
  virtual Stream stream() const { return {}; }
  // Copies every block of b (inputs filled, outputs poisoned) to the backend's memory, in place
  // of what the last upload copied.
  virtual void upload(const RankBuffers&) {}
  // The backend's address of host address p inside an uploaded block (null stays null).
  virtual void* at(const void* p) const { return const_cast<void*>(p); }
  // After a call that returned: waits for its work and throws its tpfuse::Error, if any.
  virtual void finish(const Team&) {}
  // Waits for the queued work, then copies the uploaded blocks back into b.
  virtual void download(RankBuffers&) {}
};

inline void to_backend(AddRmsNormArgs& a, const Memory& m) {
  a.input = m.at(a.input);
  a.residual = m.at(a.residual);
  a.gamma = m.at(a.gamma);
  a.residual_out = m.at(a.residual_out);
  a.norm_out = m.at(a.norm_out);
  a.quant_out = m.at(a.quant_out);
  a.quant_scale = static_cast<const float*>(m.at(a.quant_scale));
  a.scales_out = static_cast<float*>(m.at(a.scales_out));
}

inline void to_backend(QkNormArgs& a, const Memory& m) {
  a.qkv = m.at(a.qkv);
  a.q_out = m.at(a.q_out);
  a.k_out = m.at(a.k_out);
  a.q_gamma = m.at(a.q_gamma);
  a.k_gamma = m.at(a.k_gamma);
  a.positions = static_cast<const int64_t*>(m.at(a.positions));
  a.cos_sin_cache = static_cast<const float*>(m.at(a.cos_sin_cache));
}

// --- what a rank saw ---

struct Outcome {
  bool threw = false;      // a tpfuse::Error
  bool foreign = false;    // another exception (always a failure)
  bool all_nan = false;    // every element of every output NaN
  bool untouched = false;  // every output byte still the poison
  uint64_t hash = 0;       // of the outputs' bits
  double seconds = 0;
  std::string message;
};

inline uint64_t hash_outputs(const std::vector<Output>& outputs) {
  uint64_t h = 1469598103934665603ull;
  for (const Output& o : outputs) {
    for (size_t i = 0; i < o.bytes; ++i) h = (h ^ o.data[i]) * 1099511628211ull;
    h = (h ^ 0xff) * 1099511628211ull;
  }
  return h;
}

inline bool is_nan(const Output& o, size_t i, DType dtype) {
  if (o.kind == Kind::kFp8) return (o.data[i] & 0x7f) == 0x7f;
  if (o.kind == Kind::kFloat32 || dtype == DType::kFloat32) {
    uint32_t bits;
    std::memcpy(&bits, o.data + 4 * i, 4);
    return (bits & 0x7f800000u) == 0x7f800000u && (bits & 0x7fffffu) != 0;
  }
  uint16_t bits;
  std::memcpy(&bits, o.data + 2 * i, 2);
  if (dtype == DType::kBFloat16) return (bits & 0x7f80u) == 0x7f80u && (bits & 0x7fu) != 0;
  return (bits & 0x7c00u) == 0x7c00u && (bits & 0x3ffu) != 0;
}

inline void summarize(Outcome& out, const std::vector<Output>& outputs, DType dtype) {
  out.hash = hash_outputs(outputs);
  out.all_nan = true;
  out.untouched = true;
  for (const Output& o : outputs) {
    const size_t size = o.kind == Kind::kFp8                                   ? 1
                        : o.kind == Kind::kFloat32 || dtype == DType::kFloat32 ? 4
                                                                               : 2;
    for (size_t i = 0; i < o.bytes / size; ++i) out.all_nan = out.all_nan && is_nan(o, i, dtype);
    for (size_t i = 0; i < o.bytes; ++i) out.untouched = out.untouched && o.data[i] == 0x5a;
  }
}

template <typename Body>
Outcome timed(Body&& body) {
  Outcome out;
  const auto start = std::chrono::steady_clock::now();
  try {
    body(out);
  } catch (const Error& error) {
    out.threw = true;
    out.message = error.what();
  } catch (const std::exception& error) {
    out.foreign = true;
    out.message = error.what();
  }
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

// Rank `rank`'s part of one call: c (its own, already changed if it disagrees), with bad
// argument `bad` (or -1), or reject_call instead of the call; its buffers in `memory`.
inline Outcome execute(const Team& team, const Call& c, int rank, int world, int bad, bool reject,
                       double sleep_seconds, Memory& memory) {
  const CallData data = make_data(c, world);
  RankBuffers b;
  prepare(b, c, data, rank);
  memory.upload(b);
  if (sleep_seconds > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(sleep_seconds));
  }
  Outcome out = timed([&](Outcome&) {
    if (reject) {
      reject_call(team, memory.stream());
      memory.finish(team);
      return;
    }
    if (c.op == Op::kRows) {
      AddRmsNormArgs a = rows_args(b, c);
      switch (bad) {
        case 0:
          a.gamma = nullptr;
          break;
        case 1:
          a.input = nullptr;
          break;
        case 2:
          a.tokens = -1;
          break;
        case 3:
          a.hidden += 4;
          break;
        case 4:
          a.eps = -1.0f;
          break;
        case 5:
          a.dtype = DType(7);
          break;
        case 6:
          a.algorithm = Algorithm(9);
          break;
        case 7:
          a.input = b.input + 2;
          break;
        case 8:
          a.algorithm = Algorithm::kOneShot;
          a.tokens = int64_t(team.packet_bytes() / (size_t(a.hidden) * dtype_size(a.dtype))) + 1;
          break;
        default:
          break;
      }
      to_backend(a, memory);
      allreduce_add_rmsnorm(team, a, memory.stream());
    } else if (c.op == Op::kAllreduce) {
      const void* input = b.input;
      int64_t count = c.tokens * c.hidden;
      DType dtype = c.dtype;
      Algorithm algorithm = c.algorithm;
      switch (bad) {
        case 0:
          count -= 4;
          break;
        case 1:
          input = nullptr;
          break;
        case 2:
          dtype = DType(7);
          break;
        case 3:
          algorithm = Algorithm(9);
          break;
        case 4:
          input = b.input + 2;
          break;
        default:
          break;
      }
      allreduce(team, memory.at(input), memory.at(b.norm_out), count, dtype, memory.stream(),
                algorithm);
    } else {
      QkNormArgs a = qk_args(b, c, data, world);
      switch (bad) {
        case 0:
          a.q_gamma = nullptr;
          break;
        case 1:
          a.qkv = nullptr;
          break;
        case 2:
          a.tokens = -1;
          break;
        case 3:
          a.eps = -1.0f;
          break;
        case 4:
          a.algorithm = Algorithm::kTwoShot;
          break;
        case 5:
          a.kv_replicas = world + 1;
          break;
        default:
          break;
      }
      to_backend(a, memory);
      allreduce_qk_rmsnorm(team, a, memory.stream());
    }
    memory.finish(team);
  });
  memory.download(b);
  summarize(out, b.outputs, c.dtype);
  return out;
}

// The call made after a failure: 64 fp32 of rank + 1, out = W (W + 1) / 2 everywhere.
inline Outcome probe(const Team& team, int rank, Memory& memory) {
  RankBuffers b;
  uint8_t* input = b.allocate(256);
  for (size_t i = 0; i < 64; ++i) store(DType::kFloat32, input, i, float(rank + 1));
  uint8_t* out = b.allocate(256);
  memory.upload(b);
  Outcome o = timed([&](Outcome&) {
    allreduce(team, memory.at(input), memory.at(out), 64, DType::kFloat32, memory.stream());
    memory.finish(team);
  });
  memory.download(b);
  summarize(o, {{out, 256, Kind::kDtype}}, DType::kFloat32);
  return o;
}

inline Outcome check_outcome(const Team& team) {
  return timed([&](Outcome&) { team.check(); });
}

// --- running a sequence on one rank ---

inline TeamOptions options_of(const TeamConfig& config, double timeout) {
  TeamOptions options;
  options.peer_stores = config.peer_stores;
  options.packet_bytes = config.packet_bytes;
  options.peer_timeout_seconds = timeout;
  options.handshake_timeout_seconds = 5.0;
  return options;
}

// How the ranks meet: a barrier and a new team (every rank calls make() with the same index).
class TeamSource {
 public:
  virtual ~TeamSource() = default;
  // Team number `index` of the sequence; throws tpfuse::Error if it cannot be made.
  virtual Team make(int index, int rank, const TeamOptions& options) = 0;
  // Where the ranks of a sequence that went wrong agree to stop (see run_rank).
  virtual std::atomic<int>& stop_before() = 0;
  // Where this rank's buffers go (the host's, unless the backend has its own).
  virtual Memory& memory() { return host_; }
  // After each collective call of the rank, whatever its outcome. A backend whose calls report
  // their errors in Team::check() after them (CUDA) waits here for every rank, so that a check
  // reports that call and never a peer's next one (which may fail the team first); the CPU's
  // calls throw their own errors, and its ranks run up to a call apart.
  virtual void after_call() {}

 private:
  Memory host_;
};

// A barrier in memory every rank maps (a process's shared mapping, or plain memory for threads).
struct SharedBarrier {
  std::atomic<uint32_t> count{0};
  std::atomic<uint32_t> generation{0};
  std::atomic<uint32_t> abort{0};
  std::atomic<int> stop_before{1 << 30};

  void wait(int world) {
    const uint32_t generation_seen = generation.load();
    if (count.fetch_add(1) + 1 == uint32_t(world)) {
      count.store(0);
      generation.fetch_add(1);
      return;
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (generation.load() == generation_seen) {
      if (abort.load() != 0) throw std::runtime_error("another rank gave up");
      if (std::chrono::steady_clock::now() > deadline) {
        abort.store(1);
        throw std::runtime_error("a rank did not reach the barrier in 60 s");
      }
      std::this_thread::yield();
    }
  }
};

// Each rank's record of a sequence: one outcome per part, in the order of parts_of() below.
using Record = std::vector<Outcome>;

// What the runner records for a step, in order; the verifier reads them in the same order.
enum class Part { kCreate, kWarmup, kCall, kCheck, kProbe };
inline std::vector<Part> parts_of(const Step& step) {
  switch (step.kind) {
    case Step::kNewTeam:
      return {Part::kCreate};
    case Step::kLate: {
      std::vector<Part> parts = {Part::kCreate};
      for (int i = 0; i < step.warmup; ++i) parts.push_back(Part::kWarmup);
      parts.insert(parts.end(), {Part::kCall, Part::kCheck, Part::kProbe, Part::kCreate});
      return parts;
    }
    case Step::kCall:
      if (step.fault == Fault::kDisagree) {
        return {Part::kCall, Part::kCheck, Part::kProbe, Part::kCreate};
      }
      return {Part::kCall};
  }
  return {};
}

inline void run_rank(const Sequence& s, int rank, TeamSource& source,
                     const std::function<void(const Outcome&)>& record) {
  int team_index = 0;
  TeamConfig config = s.first;
  const auto make = [&](const TeamConfig& c, double timeout, Team& team) {
    Outcome o =
        timed([&](Outcome&) { team = source.make(team_index, rank, options_of(c, timeout)); });
    ++team_index;
    record(o);
  };
  Team team;
  {
    Outcome o = timed(
        [&](Outcome&) { team = source.make(team_index, rank, options_of(config, kLongTimeout)); });
    ++team_index;
    if (o.threw || o.foreign) {
      o.foreign = true;
      o.message = "the first team could not be made: " + o.message;
      record(o);
      return;
    }
  }
  // A call that waited out a timeout where no peer was late means the ranks no longer make the
  // same calls (a lost turn): every later call would wait its timeout too. The verifier reports
  // the first failure, at or before this step; the ranks stop a few steps later (they are at
  // most a call or two apart), so that a broken run ends in seconds.
  const auto note_timeout = [&](const Outcome& o, size_t position) {
    if (o.threw && o.seconds >= 0.9 * kLongTimeout) {
      int expected = source.stop_before().load();
      const int stop = int(position) + 3;
      while (stop < expected && !source.stop_before().compare_exchange_weak(expected, stop)) {
      }
    }
  };
  for (size_t position = 0; position < s.steps.size(); ++position) {
    if (int(position) >= source.stop_before().load()) return;
    const Step& step = s.steps[position];
    switch (step.kind) {
      case Step::kNewTeam:
        config = step.config;
        make(config, kLongTimeout, team);
        break;
      case Step::kLate: {
        make(config, step.timeout, team);
        for (int i = 0; i < step.warmup; ++i) {
          record(execute(team, step.call, rank, s.world, -1, false, 0, source.memory()));
          source.after_call();
        }
        const bool late = rank == step.fault_rank % s.world;
        record(execute(team, step.call, rank, s.world, -1, false, late ? 3 * step.timeout : 0,
                       source.memory()));
        source.after_call();
        record(check_outcome(team));
        record(probe(team, rank, source.memory()));
        source.after_call();
        make(config, kLongTimeout, team);
        break;
      }
      case Step::kCall: {
        const bool faulty = rank == step.fault_rank % s.world;
        const auto& bad = bad_arguments(step.call.op);
        const int bad_index = faulty && step.fault == Fault::kBadArgument
                                  ? int(size_t(step.variant) % bad.size())
                                  : -1;
        const bool reject = faulty && step.fault == Fault::kRejectCall;
        const Outcome outcome = execute(team, call_of(step, rank, s), rank, s.world, bad_index,
                                        reject, 0, source.memory());
        note_timeout(outcome, position);
        record(outcome);
        source.after_call();
        if (step.fault == Fault::kDisagree) {
          record(check_outcome(team));
          const Outcome next = probe(team, rank, source.memory());
          note_timeout(next, position);
          record(next);
          source.after_call();
          make(config, kLongTimeout, team);
        }
        break;
      }
    }
  }
}

// --- teams of threads ---

class ThreadTeams : public TeamSource {
 public:
  explicit ThreadTeams(int world) : world_(world) {}
  Team make(int, int rank, const TeamOptions& options) override {
    barrier_.wait(world_);
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(mutex_);
      error_.clear();
      current_.clear();
      try {
        current_ = create_cpu_team(world_, options);
      } catch (const Error& error) {
        error_ = error.what();
      }
    }
    barrier_.wait(world_);
    Team team;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_.empty()) throw Error(error_);
      team = current_[size_t(rank)];
    }
    barrier_.wait(world_);  // every rank has its handle before rank 0 makes the next team
    return team;
  }
  std::atomic<int>& stop_before() override { return barrier_.stop_before; }
  SharedBarrier barrier_;

 private:
  int world_;
  std::mutex mutex_;
  std::vector<Team> current_;
  std::string error_;
};

inline std::vector<Record> run_threads(const Sequence& s) {
  ThreadTeams source(s.world);
  std::vector<Record> records(static_cast<size_t>(s.world));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < s.world; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        run_rank(s, rank, source, [&](const Outcome& o) { records[size_t(rank)].push_back(o); });
      } catch (const std::exception& error) {
        source.barrier_.abort.store(1);
        Outcome o;
        o.foreign = true;
        o.message = std::string("the rank stopped: ") + error.what();
        records[size_t(rank)].push_back(o);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return records;
}

// --- teams of processes ---

inline int teams_of(const Sequence& s) {
  int teams = 1;
  for (const Step& step : s.steps) {
    teams += step.kind == Step::kNewTeam      ? 1
             : step.kind == Step::kLate       ? 2
             : step.fault == Fault::kDisagree ? 1
                                              : 0;
  }
  return teams;
}

// The barrier, then teams_of(s) ids (made before the fork, one a team).
struct ProcessShared {
  SharedBarrier barrier;
  CpuTeamId* ids() { return reinterpret_cast<CpuTeamId*>(this + 1); }
};

// A CPU team of processes (a backend's team of processes overrides make).
class ProcessTeams : public TeamSource {
 public:
  ProcessTeams(ProcessShared* shared, int world) : shared_(shared), world_(world) {}
  Team make(int index, int rank, const TeamOptions& options) override {
    shared_->barrier.wait(world_);
    return create_cpu_team(shared_->ids()[index], rank, world_, options);
  }
  std::atomic<int>& stop_before() override { return shared_->barrier.stop_before; }

 protected:
  ProcessShared* shared_;
  int world_;
};

inline void put_outcome(std::string& out, const Outcome& o) {
  const uint8_t flags = uint8_t(o.threw | o.foreign << 1 | o.all_nan << 2 | o.untouched << 3);
  const uint32_t length = uint32_t(o.message.size());
  out.append(reinterpret_cast<const char*>(&flags), 1);
  out.append(reinterpret_cast<const char*>(&o.hash), 8);
  out.append(reinterpret_cast<const char*>(&o.seconds), 8);
  out.append(reinterpret_cast<const char*>(&length), 4);
  out.append(o.message);
}

inline Record parse_outcomes(const std::string& bytes) {
  Record record;
  size_t at = 0;
  while (at + 21 <= bytes.size()) {
    Outcome o;
    const uint8_t flags = uint8_t(bytes[at]);
    o.threw = flags & 1;
    o.foreign = flags & 2;
    o.all_nan = flags & 4;
    o.untouched = flags & 8;
    std::memcpy(&o.hash, &bytes[at + 1], 8);
    std::memcpy(&o.seconds, &bytes[at + 9], 8);
    uint32_t length;
    std::memcpy(&length, &bytes[at + 17], 4);
    if (at + 21 + length > bytes.size()) break;
    o.message = bytes.substr(at + 21, length);
    at += 21 + length;
    record.push_back(std::move(o));
  }
  return record;
}

// Made in each forked rank, before its first team: how it makes teams and where its buffers go.
using RankSource = std::function<std::unique_ptr<TeamSource>(ProcessShared* shared, int world)>;

inline std::unique_ptr<TeamSource> cpu_processes(ProcessShared* shared, int world) {
  return std::make_unique<ProcessTeams>(shared, world);
}

inline std::vector<Record> run_processes(const Sequence& s,
                                         const RankSource& make_source = cpu_processes) {
  const int teams = teams_of(s);
  const size_t bytes = sizeof(ProcessShared) + sizeof(CpuTeamId) * size_t(teams);
  void* area = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (area == MAP_FAILED) throw std::runtime_error("mmap failed");
  auto* shared = new (area) ProcessShared();
  for (int i = 0; i < teams; ++i) shared->ids()[i] = create_cpu_team_id();
  // A bound on the whole sequence: every call ends within a timeout, and most at once.
  const unsigned limit = unsigned(60 + 3 * s.steps.size());
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> children;
  std::vector<int> pipes;
  for (int rank = 0; rank < s.world; ++rank) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error("fork failed");
    if (pid == 0) {
      ::close(fds[0]);
      for (int fd : pipes) ::close(fd);
      ::alarm(limit);
      const auto write_all = [&](const std::string& text) {
        size_t done = 0;
        while (done < text.size()) {
          const ssize_t n = ::write(fds[1], text.data() + done, text.size() - done);
          if (n <= 0) ::_exit(3);
          done += size_t(n);
        }
      };
      try {
        const std::unique_ptr<TeamSource> source = make_source(shared, s.world);
        run_rank(s, rank, *source, [&](const Outcome& o) {
          std::string text;
          put_outcome(text, o);
          write_all(text);
        });
      } catch (const std::exception& error) {
        shared->barrier.abort.store(1);
        Outcome o;
        o.foreign = true;
        o.message = std::string("the rank stopped: ") + error.what();
        std::string text;
        put_outcome(text, o);
        write_all(text);
      }
      ::close(fds[1]);
      ::_exit(0);
    }
    ::close(fds[1]);
    children.push_back(pid);
    pipes.push_back(fds[0]);
  }
  std::vector<std::string> received(static_cast<size_t>(s.world));
  std::vector<bool> open(size_t(s.world), true);
  int still_open = s.world;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(limit + 10);
  while (still_open > 0 && std::chrono::steady_clock::now() < deadline) {
    std::vector<pollfd> fds;
    std::vector<int> ranks;
    for (int r = 0; r < s.world; ++r) {
      if (open[size_t(r)]) {
        fds.push_back({pipes[size_t(r)], POLLIN, 0});
        ranks.push_back(r);
      }
    }
    if (::poll(fds.data(), fds.size(), 1000) <= 0) continue;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      char buffer[65536];
      const ssize_t n = ::read(fds[i].fd, buffer, sizeof(buffer));
      if (n > 0) {
        received[size_t(ranks[i])].append(buffer, size_t(n));
      } else {
        open[size_t(ranks[i])] = false;
        --still_open;
      }
    }
  }
  std::vector<Record> records(static_cast<size_t>(s.world));
  for (int r = 0; r < s.world; ++r) {
    if (open[size_t(r)]) ::kill(children[size_t(r)], SIGKILL);
    int status = 0;
    ::waitpid(children[size_t(r)], &status, 0);
    ::close(pipes[size_t(r)]);
    records[size_t(r)] = parse_outcomes(received[size_t(r)]);
    if (WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0)) {
      Outcome o;
      o.foreign = true;
      o.message = WIFSIGNALED(status)
                      ? "the process died of signal " + std::to_string(WTERMSIG(status)) +
                            (WTERMSIG(status) == SIGALRM ? " (its alarm: it hung)" : "")
                      : "the process exited with " + std::to_string(WEXITSTATUS(status));
      records[size_t(r)].push_back(o);
    }
  }
  ::munmap(area, bytes);
  return records;
}

// --- the reference and the rules ---

// A thread team of each configuration, never called: what it would run (Team::choose) and carry.
class Oracle {
 public:
  const Team& team(const TeamConfig& config, int world) {
    const auto key = std::make_tuple(config.peer_stores, config.packet_bytes, world);
    auto found = teams_.find(key);
    if (found == teams_.end()) {
      found =
          teams_.emplace(key, create_cpu_team(world, options_of(config, kLongTimeout))[0]).first;
    }
    return found->second;
  }

  // nccl: whether the backend's teams have an NCCL path. A CPU team (the oracle's, never
  // called) chooses as such a team would with the same options and selection table, but with
  // its stand-in for NCCL: where that is NCCL and the team has none, the call is refused.
  explicit Oracle(bool nccl = true) : nccl_(nccl) {}

  // The algorithm a well-formed call runs, or false if the team refuses it (capacity, or a
  // fused algorithm on a team without peer stores, or NCCL on a team without it).
  bool resolve(const Call& c, const TeamConfig& config, int world, Algorithm& ran) {
    const Team& t = team(config, world);
    if (c.op == Op::kQkNorm) {
      const bool fits = size_t(c.tokens) * 16 <= config.packet_bytes;
      if (c.algorithm == Algorithm::kNccl) {
        ran = Algorithm::kNccl;
        return nccl_;
      }
      if (c.algorithm == Algorithm::kOneShot) {
        ran = Algorithm::kOneShot;
        return config.peer_stores && fits;
      }
      ran = config.peer_stores && fits ? Algorithm::kOneShot : Algorithm::kNccl;
      return ran != Algorithm::kNccl || nccl_;
    }
    int64_t tokens = c.tokens, hidden = c.hidden;
    if (c.op == Op::kAllreduce) {  // allreduce's rows (api.cc)
      const int64_t count = c.tokens * c.hidden;
      tokens = 1;
      hidden = count;
      if (count > 2048) {
        int64_t row = 2048;
        while (count % row != 0) row -= 8;
        hidden = row;
        tokens = count / row;
      }
    }
    try {
      ran = t.choose(tokens, hidden, c.dtype, c.algorithm);
    } catch (const Error&) {
      return false;
    }
    return ran != Algorithm::kNccl || nccl_;
  }

 private:
  bool nccl_;
  std::map<std::tuple<bool, size_t, int>, Team> teams_;
};

// What a call's header carries: ranks whose keys differ disagree.
inline std::string signature_key(const Call& c, Algorithm ran, int world) {
  std::ostringstream key;
  key << int(c.op) << "/" << int(ran) << "/" << int(c.dtype) << "/" << c.tokens << "/";
  if (c.op == Op::kQkNorm) {
    key << q_size(c) * world << "/" << kv_size(c) << "/" << c.kv_replicated << "/" << int(c.rope)
        << "/" << c.half_rotary << "/" << c.head_dim << "/" << c.eps;
  } else if (c.op == Op::kAllreduce) {
    key << c.tokens * c.hidden;
  } else {
    key << c.hidden << "/" << c.residual << "/" << int(c.weight) << "/" << int(c.quant) << "/"
        << c.eps;
  }
  return key.str();
}

// The exact outputs' hash of each rank for call c (every rank making it).
inline std::vector<uint64_t> reference_hashes(const Call& c, int world, Memory& memory) {
  const CallData d = make_data(c, world);
  std::vector<uint64_t> hashes(static_cast<size_t>(world));
  const int64_t tokens = c.tokens;
  if (c.op == Op::kQkNorm) {
    // Each rank's sums, summed (exact: small integers), then each rank's local norm.
    std::vector<float> total(size_t(2 * std::max<int64_t>(tokens, 1)), 0.0f);
    std::vector<RankBuffers> buffers(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      RankBuffers& b = buffers[size_t(r)];
      prepare(b, c, d, r);
      if (tokens == 0) continue;
      float* sums = reinterpret_cast<float*>(b.allocate(size_t(2 * tokens) * 4));
      memory.upload(b);
      QkNormArgs a = qk_args(b, c, d, world);
      to_backend(a, memory);
      qk_sum_squares(memory.backend(), a, !c.kv_replicated || r == 0,
                     static_cast<float*>(memory.at(sums)), memory.stream());
      memory.download(b);
      for (size_t i = 0; i < size_t(2 * tokens); ++i) total[i] += sums[i];
    }
    for (int r = 0; r < world; ++r) {
      RankBuffers& b = buffers[size_t(r)];
      if (tokens > 0) {
        float* sums = reinterpret_cast<float*>(b.allocate(total.size() * 4));
        std::memcpy(sums, total.data(), total.size() * 4);
        memory.upload(b);
        QkNormArgs a = qk_args(b, c, d, world);
        to_backend(a, memory);
        qk_rmsnorm_from_sums(memory.backend(), a, static_cast<const float*>(memory.at(sums)),
                             memory.stream());
        memory.download(b);
      }
      hashes[size_t(r)] = hash_outputs(b.outputs);
    }
    return hashes;
  }
  RankBuffers b;
  prepare(b, c, d, 0);
  const size_t count = size_t(tokens * c.hidden), bytes = count * dtype_size(c.dtype);
  uint8_t* sum = b.allocate(bytes);
  uint8_t* zeros = b.allocate(bytes);
  for (size_t i = 0; i < count; ++i) {
    float x = 0;
    for (int r = 0; r < world; ++r) x += d.inputs[size_t(r)][i];
    store(c.dtype, sum, i, x);
    store(c.dtype, zeros, i, 0.0f);
  }
  if (c.op == Op::kAllreduce) {
    std::memcpy(b.norm_out, sum, bytes);
  } else if (tokens > 0) {
    AddRmsNormArgs a = rows_args(b, c);
    a.input = sum;
    a.algorithm = Algorithm::kAuto;
    if (!c.residual) {
      a.residual = zeros;
      if (a.residual_out == nullptr) a.residual_out = b.allocate(bytes);
    }
    memory.upload(b);
    to_backend(a, memory);
    add_rmsnorm(memory.backend(), a, memory.stream());
    memory.download(b);
  }
  const uint64_t h = hash_outputs(b.outputs);
  for (auto& x : hashes) x = h;
  return hashes;
}

// The reference a backend gives: the exact outputs' hash of each rank for call c on world ranks.
using Reference = std::function<std::vector<uint64_t>(const Call& c, int world)>;

inline std::vector<uint64_t> cpu_reference(const Call& c, int world) {
  Memory host;
  return reference_hashes(c, world, host);
}

inline uint64_t probe_hash(int world) {
  std::vector<float> out(64, float(world * (world + 1) / 2));
  return hash_outputs({{reinterpret_cast<uint8_t*>(out.data()), 256, Kind::kDtype}});
}

// Whether an error message names rank `peer` (beyond its "rank R:" prefix).
inline bool names_rank(const std::string& message, int peer) {
  const std::string word = "rank " + std::to_string(peer);
  for (size_t at = message.find(word, 1); at != std::string::npos;
       at = message.find(word, at + 1)) {
    const size_t end = at + word.size();
    if (end >= message.size() || !std::isdigit(static_cast<unsigned char>(message[end]))) {
      return true;
    }
  }
  return false;
}

struct Failure {
  std::string rule;  // a short tag: shrinking keeps a candidate that fails the same rule
  std::string detail;
  int step = -1;  // position in the sequence
};

class Verifier {
 public:
  Verifier(const Sequence& s, const std::vector<Record>& records, Reference reference)
      : s_(s),
        records_(records),
        next_(size_t(s.world), 0),
        oracle_(s.limits.nccl),
        reference_(std::move(reference)) {}

  std::vector<Failure> run() {
    config_ = s_.first;
    for (position_ = 0; position_ < int(s_.steps.size()) && failures_.empty(); ++position_) {
      const Step& step = s_.steps[size_t(position_)];
      std::vector<size_t> start = next_;
      switch (step.kind) {
        case Step::kNewTeam:
          config_ = step.config;
          expect_created();
          break;
        case Step::kLate:
          verify_late(step);
          break;
        case Step::kCall:
          verify_call(step);
          break;
      }
      // Every part of the step read, whichever rule applied (some mixes have none).
      for (int r = 0; r < s_.world; ++r) {
        next_[size_t(r)] =
            std::min(records_[size_t(r)].size(), start[size_t(r)] + parts_of(step).size());
      }
    }
    // A rank that stopped early, or recorded something after the end.
    for (int r = 0; r < s_.world && failures_.empty(); ++r) {
      const Record& record = records_[size_t(r)];
      if (next_[size_t(r)] < record.size()) {
        fail("record", "rank " + std::to_string(r) +
                           " recorded more than its sequence: " + record[next_[size_t(r)]].message);
      }
    }
    return failures_;
  }

 private:
  void fail(const std::string& rule, const std::string& detail) {
    failures_.push_back({rule, detail, position_});
  }

  // Each rank's next outcome (false, and a failure, if a rank has none: it stopped).
  bool take(std::vector<Outcome>& out) {
    out.assign(size_t(s_.world), Outcome{});
    bool complete = true;
    for (int r = 0; r < s_.world; ++r) {
      const Record& record = records_[size_t(r)];
      if (next_[size_t(r)] >= record.size()) {
        complete = false;
        continue;
      }
      out[size_t(r)] = record[next_[size_t(r)]++];
      if (out[size_t(r)].foreign) {
        fail("stopped", "rank " + std::to_string(r) + ": " + out[size_t(r)].message);
        complete = false;
      }
    }
    if (!complete && failures_.empty()) fail("stopped", "a rank's record ends early");
    return complete;
  }

  static std::string what(const Outcome& o) {
    if (o.threw) return "threw '" + o.message + "'";
    return std::string("returned") + (o.all_nan ? " all-NaN outputs" : "") +
           (o.untouched ? " untouched outputs" : "");
  }

  void expect_created() {
    std::vector<Outcome> o;
    if (!take(o)) return;
    for (int r = 0; r < s_.world; ++r) {
      if (o[size_t(r)].threw) {
        fail("create",
             "rank " + std::to_string(r) + " could not make a team: " + o[size_t(r)].message);
      }
    }
  }

  // After a team failed: check() and the next call throw at once on every rank.
  void expect_failed_team(double timeout) {
    std::vector<Outcome> check, next;
    if (!take(check) || !take(next)) return;
    for (int r = 0; r < s_.world; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      if (!check[size_t(r)].threw) fail("failed team", rank + ": Team::check() did not throw");
      if (!next[size_t(r)].threw) {
        fail("failed team", rank + ": the next call on the failed team " + what(next[size_t(r)]));
      } else if (next[size_t(r)].seconds > 0.5 * timeout) {
        fail("failed team", rank + ": the next call on the failed team threw only after " +
                                std::to_string(next[size_t(r)].seconds) + " s: '" +
                                next[size_t(r)].message + "'");
      }
    }
  }

  // Team::check() quiet and the next call exact: the team went on.
  void expect_working_team() {
    std::vector<Outcome> check, next;
    if (!take(check) || !take(next)) return;
    const uint64_t expected = probe_hash(s_.world);
    for (int r = 0; r < s_.world; ++r) {
      const std::string rank = "rank " + std::to_string(r);
      if (check[size_t(r)].threw) {
        fail("team went on", rank + ": Team::check() threw '" + check[size_t(r)].message + "'");
      }
      if (next[size_t(r)].threw || next[size_t(r)].hash != expected) {
        fail("team went on", rank + ": the next call " + what(next[size_t(r)]));
      }
    }
  }

  void expect_exact(const std::vector<Outcome>& o, const Call& c, const std::string& context) {
    const std::vector<uint64_t> expected = reference_(c, s_.world);
    for (int r = 0; r < s_.world; ++r) {
      const Outcome& x = o[size_t(r)];
      if (x.threw) {
        fail("valid call", context + ": rank " + std::to_string(r) + " threw '" + x.message + "'");
      } else if (x.hash != expected[size_t(r)]) {
        fail("valid call", context + ": rank " + std::to_string(r) +
                               " returned outputs whose bits are not the exact result's" +
                               (x.all_nan     ? " (all NaN)"
                                : x.untouched ? " (untouched)"
                                              : ""));
      }
    }
  }

  void verify_call(const Step& step) {
    std::vector<Outcome> o;
    if (!take(o)) return;
    const int world = s_.world;
    const int f = step.fault_rank % world;
    std::vector<Call> calls;
    std::vector<bool> refused(size_t(world), false);  // the rank's own call is refused
    std::vector<std::string> keys(static_cast<size_t>(world));
    for (int r = 0; r < world; ++r) {
      calls.push_back(call_of(step, r, s_));
      Algorithm ran = Algorithm::kAuto;
      const bool fits = oracle_.resolve(calls.back(), config_, world, ran);
      const bool own_fault =
          r == f && (step.fault == Fault::kBadArgument || step.fault == Fault::kRejectCall);
      refused[size_t(r)] = own_fault || !fits;
      keys[size_t(r)] = signature_key(calls.back(), ran, world);
    }
    std::vector<int> valid, rejecting;
    for (int r = 0; r < world; ++r) (refused[size_t(r)] ? rejecting : valid).push_back(r);
    bool agree = true;
    for (int r : valid) agree = agree && keys[size_t(r)] == keys[size_t(valid.front())];
    const std::string context = describe(step, s_);
    // Rejecting ranks: their own error (reject_call returns), nothing written.
    for (int r : rejecting) {
      const Outcome& x = o[size_t(r)];
      const std::string rank = context + ": rank " + std::to_string(r);
      if (r == f && step.fault == Fault::kRejectCall) {
        if (x.threw) fail("reject_call", rank + ": reject_call threw '" + x.message + "'");
        continue;
      }
      if (!x.threw) {
        fail("own rejection", rank + " did not throw for its own refused call: " + what(x));
        continue;
      }
      const bool own_fits = !(r == f && step.fault == Fault::kBadArgument);
      const auto& bad = bad_arguments(step.call.op);
      const std::string expected = own_fits ? "" : bad[size_t(step.variant) % bad.size()].expected;
      bool fits_anyway = true;
      {
        Algorithm ran;
        fits_anyway = oracle_.resolve(calls[size_t(r)], config_, world, ran);
      }
      if (!expected.empty() && fits_anyway && x.message.find(expected) == std::string::npos) {
        fail("own rejection", rank + "'s error does not name its bad argument ('" + expected +
                                  "'): '" + x.message + "'");
      }
      if (!x.untouched) fail("own rejection", rank + " wrote into its outputs of a refused call");
    }
    const bool zero_tokens =
        std::any_of(calls.begin(), calls.end(), [](const Call& c) { return c.tokens == 0; });
    if (valid.empty()) return;  // every rank refused: each threw its own error, checked above
    if (!rejecting.empty()) {
      if (!agree || (zero_tokens && step.fault != Fault::kNone)) return;  // no rule for this mix
      for (int r : valid) {
        const Outcome& x = o[size_t(r)];
        const std::string rank = context + ": rank " + std::to_string(r);
        bool named = false;
        // Its peers rejected; where this rank's own call also differs from theirs (a disagreement
        // its peers refused), an error naming the difference is as good.
        for (int p : rejecting) {
          named = named ||
                  (names_rank(x.message, p) && (x.message.find("rejected") != std::string::npos ||
                                                keys[size_t(r)] != keys[size_t(p)]));
        }
        if (!x.threw || !named) {
          fail("peer rejected",
               rank + " should throw saying a rejecting rank rejected its part; " + what(x));
        } else if (!x.all_nan) {
          fail("peer rejected", rank + " threw as it should, but its outputs are not all NaN");
        }
      }
      return;
    }
    if (agree) {
      expect_exact(o, calls.front(), context);
      if (step.fault == Fault::kDisagree) {
        // The change made no difference (say auto resolved to the algorithm asked): a good call.
        expect_working_team();
        expect_created();
      }
      return;
    }
    // Disagreeing ranks.
    for (int r = 0; r < world; ++r) {
      const Outcome& x = o[size_t(r)];
      const std::string rank = context + ": rank " + std::to_string(r);
      bool named = false;
      for (int p = 0; p < world; ++p) {
        named = named || (p != r && keys[size_t(p)] != keys[size_t(r)] && names_rank(x.message, p));
      }
      if (!x.threw || !named) {
        fail("disagreement", rank + " should throw naming a rank whose call differs; " + what(x));
      } else if (!x.all_nan && !x.untouched) {
        // NaN everywhere, or nothing written: a rank that starts after a peer marked the team
        // failed is refused before it writes (tpfuse.h).
        fail("disagreement", rank + " threw as it should, but its outputs are not all NaN");
      }
    }
    if (!failures_.empty()) return;
    expect_failed_team(kLongTimeout);
    expect_created();
  }

  void verify_late(const Step& step) {
    const int world = s_.world;
    const int late = step.fault_rank % world;
    const std::string context = describe(step, s_);
    expect_created();
    Algorithm ran;
    const bool fits = oracle_.resolve(step.call, config_, world, ran);
    for (int i = 0; i < step.warmup; ++i) {
      std::vector<Outcome> o;
      if (!take(o)) return;
      if (fits) expect_exact(o, step.call, context + " (good call " + std::to_string(i) + ")");
    }
    std::vector<Outcome> o;
    if (!take(o)) return;
    if (!failures_.empty()) return;
    if (!fits) {
      // Refused everywhere: every rank throws its own error, on time or not.
      for (int r = 0; r < world; ++r) {
        if (!o[size_t(r)].threw) fail("own rejection", context + ": a refused call returned");
      }
      std::vector<Outcome> skip;
      take(skip);
      take(skip);
      expect_created();
      return;
    }
    const std::vector<uint64_t> expected = reference_(step.call, world);
    bool any_threw = false;
    for (int r = 0; r < world; ++r) any_threw = any_threw || o[size_t(r)].threw;
    for (int r = 0; r < world; ++r) {
      const Outcome& x = o[size_t(r)];
      const std::string rank = context + ": rank " + std::to_string(r);
      const bool exact = !x.threw && x.hash == expected[size_t(r)];
      if (r == late) {
        if (!x.threw && !exact) {
          fail("late peer", rank +
                                " (the late one) returned outputs that are not the exact "
                                "result's" +
                                (x.all_nan ? " (all NaN)" : ""));
        } else if (exact && any_threw) {
          fail("late peer", rank +
                                " (the late one) returned a result although a peer had given "
                                "up on it (the team is failed)");
        }
        continue;
      }
      if (!x.threw && !exact) {
        fail("late peer", rank + " returned outputs that are not the exact result's" +
                              (x.all_nan ? " (all NaN)" : ""));
      } else if (x.threw && !names_rank(x.message, late)) {
        fail("late peer", rank + " threw without naming the late rank: '" + x.message + "'");
      }
    }
    if (!failures_.empty()) return;
    if (any_threw) {
      expect_failed_team(step.timeout);
    } else {
      expect_working_team();
    }
    expect_created();
  }

  const Sequence& s_;
  const std::vector<Record>& records_;
  std::vector<size_t> next_;
  std::vector<Failure> failures_;
  TeamConfig config_;
  int position_ = 0;
  Oracle oracle_;
  Reference reference_;
};

// --- running, shrinking, reporting ---

// How a backend runs a sequence on its teams (every rank's record) and what its reference is.
struct FaultBackend {
  const char* name;  // in the report: "threads", "processes", ...
  std::function<std::vector<Record>(const Sequence&)> run;
  Reference reference;
};

inline std::vector<Failure> run_sequence(const Sequence& s, const FaultBackend& backend) {
  const std::vector<Record> records = backend.run(s);
  return Verifier(s, records, backend.reference).run();
}

// Keeps the steps of `s` at `positions`, on `world` ranks.
inline Sequence restrict(const Sequence& s, const std::vector<size_t>& positions, int world) {
  Sequence out = s;
  out.world = world;
  out.steps.clear();
  for (size_t p : positions) out.steps.push_back(s.steps[p]);
  return out;
}

// Delta debugging: the fewest steps and the lowest world that still fail `rule`.
inline Sequence shrink(const Sequence& failing, const FaultBackend& backend, const Failure& first,
                       int min_world) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  int trials = 0;
  const auto still_fails = [&](const Sequence& candidate) {
    if (trials++ > 300 || std::chrono::steady_clock::now() > deadline) return false;
    for (const Failure& f : run_sequence(candidate, backend)) {
      if (f.rule == first.rule) return true;
    }
    return false;
  };
  // Nothing after the failing step matters.
  Sequence best = failing;
  best.steps.resize(size_t(first.step) + 1);
  std::vector<size_t> keep(best.steps.size());
  for (size_t i = 0; i < keep.size(); ++i) keep[i] = i;
  const Sequence base = best;
  const auto lower_world = [&] {
    for (int w = min_world; w < best.world; ++w) {
      const Sequence candidate = restrict(base, keep, w);
      if (still_fails(candidate)) {
        best = candidate;
        return;
      }
    }
  };
  lower_world();
  size_t parts = 2;
  while (keep.size() >= 2) {
    const size_t chunk = (keep.size() + parts - 1) / parts;
    bool reduced = false;
    for (size_t start = 0; start < keep.size(); start += chunk) {
      std::vector<size_t> candidate(keep.begin(), keep.begin() + long(start));
      candidate.insert(candidate.end(), keep.begin() + long(std::min(keep.size(), start + chunk)),
                       keep.end());
      if (candidate.empty()) continue;
      if (still_fails(restrict(base, candidate, best.world))) {
        keep = candidate;
        best = restrict(base, keep, best.world);
        parts = std::max<size_t>(parts - 1, 2);
        reduced = true;
        break;
      }
    }
    if (!reduced) {
      if (parts >= keep.size()) break;
      parts = std::min(keep.size(), parts * 2);
    }
  }
  lower_world();
  return best;
}

inline int64_t env_int(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && value[0] != '\0' ? std::strtoll(value, nullptr, 10) : fallback;
}

// What a crash of this process (thread teams) prints: the sequence it was in.
inline char crash_note[512];

inline void print_crash_note(int signal) {
  const ssize_t ignored = ::write(2, crash_note, std::strlen(crash_note));
  (void)ignored;
  ::signal(signal, SIG_DFL);
  ::raise(signal);
}

// "test_fault_random" of "build/dev/tests/test_fault_random".
inline const char* program_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash != nullptr ? slash + 1 : path;
}

inline void install_crash_note() {
  for (int signal : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL}) ::signal(signal, print_crash_note);
}

struct RunShape {
  int min_world, max_world;
  int64_t default_calls;
  const char* test_name;
  const char* program;  // the test binary, as its re-run command names it
  Limits limits;
};

inline void report(const Sequence& generated, const Sequence& s,
                   const std::vector<Failure>& failures, const FaultBackend& backend,
                   const RunShape& shape) {
  std::ostringstream out;
  out << "seed " << generated.seed << " (world " << generated.world << ", "
      << generated.steps.size() << " steps, " << backend.name
      << ") fails: " << failures.front().rule << "\n  " << failures.front().detail << "\n";
  out << "shortest failing sequence found: world " << s.world
      << ", team peer_stores=" << s.first.peer_stores << " packet_bytes=" << s.first.packet_bytes
      << ", " << s.steps.size() << " step(s):\n";
  std::string keep;
  for (const Step& step : s.steps) {
    out << "  " << describe(step, s) << "\n";
    keep += (keep.empty() ? "" : ",") + std::to_string(step.index);
  }
  const std::vector<Failure> again = run_sequence(s, backend);
  if (!again.empty()) out << "  which fails with: " << again.front().detail << "\n";
  out << "re-run it: TPFUSE_FAULT_SEED=" << generated.seed
      << " TPFUSE_FAULT_STEPS=" << generated.steps.size() << " TPFUSE_FAULT_WORLD=" << s.world
      << " TPFUSE_FAULT_KEEP=" << keep << " " << shape.program << " --gtest_filter='*"
      << shape.test_name << "'\n"
      << "(the whole sequence: TPFUSE_FAULT_SEED=" << generated.seed
      << " TPFUSE_FAULT_STEPS=" << generated.steps.size() << ")";
  ADD_FAILURE() << out.str();
}

inline void run_faults(const FaultBackend& backend, const RunShape& shape, uint64_t base_seed) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Sequence> sequences;
  const int64_t seed = env_int("TPFUSE_FAULT_SEED", -1);
  if (seed >= 0) {
    Sequence s = generate(uint64_t(seed), int(env_int("TPFUSE_FAULT_STEPS", kStepsPerSequence)),
                          shape.min_world, shape.max_world, shape.limits);
    s.world = int(env_int("TPFUSE_FAULT_WORLD", s.world));
    if (const char* keep = std::getenv("TPFUSE_FAULT_KEEP"); keep != nullptr && keep[0] != 0) {
      std::vector<size_t> positions;
      std::stringstream list(keep);
      std::string item;
      while (std::getline(list, item, ',')) positions.push_back(size_t(std::stoll(item)));
      s = restrict(s, positions, s.world);
    }
    sequences.push_back(s);
  } else {
    const int64_t calls = env_int("TPFUSE_FAULT_CALLS", shape.default_calls);
    int64_t total = 0;
    for (uint64_t i = 0; total < calls; ++i) {
      Sequence s = generate(base_seed + i, kStepsPerSequence, shape.min_world, shape.max_world,
                            shape.limits);
      total += calls_of(s);
      sequences.push_back(std::move(s));
    }
  }
  int64_t calls = 0, rank_calls = 0;
  install_crash_note();
  for (const Sequence& s : sequences) {
    if (env_int("TPFUSE_FAULT_PRINT", 0) != 0) {
      for (const Step& step : s.steps) std::fprintf(stderr, "  %s\n", describe(step, s).c_str());
    }
    std::snprintf(crash_note, sizeof(crash_note),
                  "\n%s: crashed in the sequence of seed %llu (world %d, %zu "
                  "steps); TPFUSE_FAULT_SEED=%llu TPFUSE_FAULT_STEPS=%zu re-runs it, "
                  "TPFUSE_FAULT_PRINT=1 lists its steps, and the process test shrinks crashes\n",
                  program_name(shape.program), static_cast<unsigned long long>(s.seed), s.world,
                  s.steps.size(), static_cast<unsigned long long>(s.seed), s.steps.size());
    const std::vector<Failure> failures = run_sequence(s, backend);
    calls += calls_of(s);
    rank_calls += int64_t(calls_of(s)) * s.world;
    if (failures.empty()) continue;
    if (env_int("TPFUSE_FAULT_SURVEY", 0) != 0) {  // every sequence's first failure, no shrink
      ADD_FAILURE() << "seed " << s.seed << " (world " << s.world << "): " << failures.front().rule
                    << ": " << failures.front().detail;
      continue;
    }
    const Sequence generated = generate(
        s.seed,
        int(seed >= 0 ? env_int("TPFUSE_FAULT_STEPS", kStepsPerSequence) : kStepsPerSequence),
        shape.min_world, shape.max_world, shape.limits);
    const Sequence shortest =
        env_int("TPFUSE_FAULT_NO_SHRINK", 0) != 0 ? s : shrink(s, backend, failures.front(), 2);
    report(generated, shortest, failures, backend, shape);
    return;
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("%zu sequence(s), %lld collective calls (%lld rank calls) in %.1f s\n",
              sequences.size(), static_cast<long long>(calls), static_cast<long long>(rank_calls),
              seconds);
}

}  // namespace tpfuse::testing::fault_random
