// Helpers both modes use.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <sstream>
#include <thread>

#include "bench.h"
#include "core/error.h"
#include "random_values.h"
#include "tpfuse/impl/dispatch.h"
#include "tpfuse/impl/numeric.h"

namespace tpfuse::bench {

std::vector<int64_t> tokens_for_hidden(const Options& options, int64_t hidden, int64_t max_tokens,
                                       int64_t default_max_tokens) {
  std::vector<int64_t> requested = options.tokens;
  if (requested.empty()) {
    for (int64_t tokens = 1; tokens <= default_max_tokens; tokens *= 2) requested.push_back(tokens);
  }
  std::vector<int64_t> kept;
  for (int64_t tokens : requested) {
    if (tokens <= max_tokens) {
      kept.push_back(tokens);
    } else if (!options.tokens.empty()) {
      // Only an explicit request deserves a warning: the default list is meant to be capped.
      std::fprintf(stderr,
                   "tpfuse-bench: skipping %lld tokens at hidden %lld: the one-shot workspace "
                   "holds at most %lld (raise --packet-mib)\n",
                   static_cast<long long>(tokens), static_cast<long long>(hidden),
                   static_cast<long long>(max_tokens));
    }
  }
  return kept;
}

BenchPlan make_plan(const Options& options, const Team& team, int64_t default_max_tokens,
                    int default_ops_per_graph, int default_replays) {
  BenchPlan plan;
  plan.dtype = options.dtype;
  plan.ops_per_graph = options.ops_per_graph > 0 ? options.ops_per_graph : default_ops_per_graph;
  plan.replays = options.replays > 0 ? options.replays : default_replays;
  for (const int64_t hidden : options.hiddens) {
    const int64_t max_tokens = team.max_tokens(hidden, options.dtype, Algorithm::kAuto);
    std::vector<int64_t> tokens =
        tokens_for_hidden(options, hidden, max_tokens, default_max_tokens);
    if (tokens.empty()) continue;
    const int64_t most = *std::max_element(tokens.begin(), tokens.end());
    plan.buffer_bytes =
        std::max(plan.buffer_bytes, size_t(most) * size_t(hidden) * dtype_size(options.dtype));
    plan.max_hidden = std::max(plan.max_hidden, hidden);
    plan.max_tokens = std::max(plan.max_tokens, most);
    plan.shapes.emplace_back(hidden, std::move(tokens));
  }
  return plan;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  const size_t middle = values.size() / 2;
  std::nth_element(values.begin(), values.begin() + middle, values.end());
  if (values.size() % 2 == 1) return values[middle];
  const double upper = values[middle];
  const double lower = *std::max_element(values.begin(), values.begin() + middle);
  return 0.5 * (lower + upper);
}

AddRmsNormArgs row_args(const void* input, const void* residual, const void* gamma,
                        void* residual_out, void* norm_out, int64_t hidden, int64_t tokens,
                        DType dtype) {
  AddRmsNormArgs args;
  args.input = input;
  args.residual = residual;
  args.gamma = gamma;
  args.residual_out = residual_out;
  args.norm_out = norm_out;
  args.tokens = tokens;
  args.hidden = hidden;
  args.dtype = dtype;
  args.eps = kEps;
  return args;
}

void fill_random_host(void* data, int64_t count, DType dtype, uint64_t seed, float low,
                      float high) {
  impl::dispatch_dtype(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    T* out = static_cast<T*>(data);
    for (int64_t i = 0; i < count; ++i) {
      out[i] = impl::from_float<T>(random_value(seed, uint64_t(i), low, high));
    }
  });
}

void run_rank_threads(int world_size, RankBarrier& barrier,
                      const std::function<void(int rank)>& body) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  threads.reserve(size_t(world_size));
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const BarrierAborted&) {
        // Another rank failed first; its error is the one reported.
      } catch (...) {
        errors[size_t(rank)] = std::current_exception();
        barrier.abort();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const auto& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

std::vector<Record> merge_ranks(const std::vector<std::vector<Record>>& per_rank) {
  std::vector<Record> merged = per_rank.at(0);
  for (size_t i = 0; i < merged.size(); ++i) {
    if (merged[i].world_size < 2) continue;
    double slowest = merged[i].us;
    for (const auto& records : per_rank) {
      if (i < records.size() && std::isfinite(records[i].us)) {
        slowest = std::max(slowest, records[i].us);
      }
    }
    merged[i].us_max_rank = slowest;
  }
  return merged;
}

AlignedBuffer::AlignedBuffer(size_t bytes) {
  // 64 bytes: a cache line, so that no two ranks' buffers share one.
  const size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  data = std::aligned_alloc(64, rounded);
  if (data == nullptr) throw Error("tpfuse-bench: out of host memory");
}

AlignedBuffer::~AlignedBuffer() {
  std::free(data);
}

QkShape minimax_qk_shape(int world_size) {
  QkShape shape;
  shape.valid = world_size >= 1 && kQkHeads % world_size == 0;
  if (!shape.valid) return shape;
  shape.kv_replicas = world_size > kQkKvHeads ? int(world_size / kQkKvHeads) : 1;
  shape.q_size = kQkHeads / world_size * kQkHeadDim;
  shape.kv_size = std::max<int64_t>(1, kQkKvHeads / world_size) * kQkHeadDim;
  return shape;
}

std::string qk_shape_label(const QkShape& shape, int world_size) {
  return "MiniMax-M2 q " + std::to_string(shape.q_size) + " + k " + std::to_string(shape.kv_size) +
         " per rank (" + std::to_string(kQkHeads) + " / " + std::to_string(kQkKvHeads) +
         " heads of " + std::to_string(kQkHeadDim) + ", world " + std::to_string(world_size) + ")";
}

QkNormArgs minimax_qk_args(const QkShape& shape, void* qkv, const void* gamma, int64_t tokens,
                           DType dtype, const int64_t* positions, const float* cos_sin) {
  QkNormArgs args;
  args.qkv = qkv;
  args.q_gamma = gamma;
  args.k_gamma = gamma;
  args.tokens = tokens;
  args.q_size = shape.q_size;
  args.kv_size = shape.kv_size;
  args.q_global_size = kQkHeads * kQkHeadDim;
  args.k_global_size = kQkKvHeads * kQkHeadDim;
  args.kv_replicas = shape.kv_replicas;
  args.dtype = dtype;
  args.eps = kEps;
  if (positions != nullptr) {
    args.rope = RopeStyle::kNeox;
    args.head_dim = kQkHeadDim;
    args.rotary_dim = kQkRotaryDim;
    args.positions = positions;
    args.cos_sin_cache = cos_sin;
    args.max_position = kQkMaxPosition;
  }
  return args;
}

std::vector<int64_t> qk_positions(int64_t tokens) {
  std::vector<int64_t> positions(size_t(std::max<int64_t>(tokens, 1)));
  for (size_t t = 0; t < positions.size(); ++t) {
    positions[t] = int64_t((t * 7919) % kQkMaxPosition);
  }
  return positions;
}

std::vector<float> qk_cos_sin_cache() {
  std::vector<float> cos_sin(size_t(kQkMaxPosition * kQkRotaryDim));
  for (int64_t p = 0; p < kQkMaxPosition; ++p) {
    for (int64_t i = 0; i < kQkRotaryDim / 2; ++i) {
      const double angle = double(p) * std::pow(5e6, -2.0 * double(i) / double(kQkRotaryDim));
      cos_sin[size_t(p * kQkRotaryDim + i)] = float(std::cos(angle));
      cos_sin[size_t(p * kQkRotaryDim + kQkRotaryDim / 2 + i)] = float(std::sin(angle));
    }
  }
  return cos_sin;
}

TeamOptions team_options_of(const Options& options) {
  TeamOptions team_options;
  team_options.packet_bytes = options.packet_bytes;
  team_options.peer_timeout_seconds = options.peer_timeout_seconds;
  return team_options;
}

void write_records(const std::string& path, const std::vector<Record>& records) {
  std::FILE* file = std::fopen(path.c_str(), "w");
  if (file == nullptr) TPF_FAIL("cannot write " << path);
  for (const Record& r : records) {
    std::fprintf(file, "%s\t%s\t%lld\t%lld\t%d\t%.17g\t%d\t%s\n", r.op.c_str(), r.impl.c_str(),
                 static_cast<long long>(r.hidden), static_cast<long long>(r.tokens), r.world_size,
                 r.us, r.pdl ? int(*r.pdl) : -1, r.chosen.empty() ? "-" : r.chosen.c_str());
  }
  std::fclose(file);
}

std::vector<Record> read_records(const std::string& path) {
  std::ifstream file(path);
  if (!file) TPF_FAIL("a rank process left no records in " << path);
  std::vector<Record> records;
  std::string line;
  while (std::getline(file, line)) {
    std::istringstream fields(line);
    Record r;
    std::string us, chosen;
    int pdl = -1;
    std::getline(fields, r.op, '\t');
    std::getline(fields, r.impl, '\t');
    fields >> r.hidden >> r.tokens >> r.world_size >> us >> pdl >> chosen;
    r.us = std::strtod(us.c_str(), nullptr);
    if (pdl >= 0) r.pdl = pdl != 0;
    if (chosen != "-") r.chosen = chosen;
    records.push_back(r);
  }
  return records;
}

}  // namespace tpfuse::bench
