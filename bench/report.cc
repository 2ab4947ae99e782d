// Output of tpfuse-bench: the JSON results file (a list of flat records, one a line, so that
// results diff well when committed) and the table on stdout.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench.h"

namespace tpfuse::bench {
namespace {

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char escaped[8];
          std::snprintf(escaped, sizeof(escaped), "\\u%04x", c);
          out += escaped;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

// JSON has no NaN or Inf: a figure that was not measured is null.
std::string json_number(double value) {
  if (!std::isfinite(value)) return "null";
  char text[32];
  std::snprintf(text, sizeof(text), "%.6g", value);
  return text;
}

class JsonObject {
 public:
  void add(const char* key, const std::string& json_value) {
    text_ += text_.empty() ? "{" : ", ";
    text_ += json_string(key) + ": " + json_value;
  }
  void add_string(const char* key, const std::string& value) {
    if (!value.empty()) add(key, json_string(value));
  }
  void add_number(const char* key, double value) { add(key, json_number(value)); }
  void add_integer(const char* key, int64_t value) { add(key, std::to_string(value)); }
  std::string str() const { return text_ + "}"; }

 private:
  std::string text_;
};

struct Column {
  const char* label;
  const char* op;
  const char* impl;
};

// Table columns in display order; a column shows when its (op, impl) was measured. The speedup
// (the baseline column over the first: the selector's choice, or the CPU backend's one-shot)
// goes after the first three columns, where it reads as their conclusion.
constexpr Column kColumns[] = {
    {"tpfuse", "allreduce_add_rmsnorm", "tpfuse_auto"},
    {"nccl_ar+local", "allreduce_add_rmsnorm", "nccl_ar+local_add_rmsnorm"},
    {"nccl_ar", "allreduce", "nccl"},
    {"oneshot", "allreduce_add_rmsnorm", "tpfuse_oneshot"},
    {"twoshot", "allreduce_add_rmsnorm", "tpfuse_twoshot"},
    {"tpfuse_ar", "allreduce", "tpfuse_auto"},
    {"local_norm", "add_rmsnorm", "tpfuse_local"},
    {"tpfuse_cpu", "allreduce_add_rmsnorm", "tpfuse_oneshot_cpu"},
    {"cpu_local", "add_rmsnorm", "cpu_local_add_rmsnorm"},
};
constexpr int kSpeedupAfterColumn = 2;

bool in_table(const std::string& op, const std::string& impl) {
  for (const Column& column : kColumns) {
    if (op == column.op && impl == column.impl) return true;
  }
  return false;
}

std::string format_us(double us) {
  if (!std::isfinite(us)) return "-";
  char text[32];
  std::snprintf(text, sizeof(text), us < 100.0 ? "%.2f" : "%.1f", us);
  return text;
}

}  // namespace

void write_json(const std::string& path, const RunInfo& info, const std::vector<Record>& records) {
  std::ostringstream out;
  out << "[\n";
  for (size_t i = 0; i < records.size(); ++i) {
    const Record& record = records[i];
    JsonObject object;
    object.add_string("op", record.op);
    object.add_string("impl", record.impl);
    object.add_string("dtype", info.dtype);
    object.add_integer("hidden", record.hidden);
    object.add_integer("tokens", record.tokens);
    object.add_integer("world_size", record.world_size);
    object.add_number("us", record.us);
    if (record.us_max_rank) object.add_number("us_max_rank", *record.us_max_rank);
    if (record.gbps) object.add_number("GBps", *record.gbps);
    if (record.bytes) object.add_integer("bytes", *record.bytes);
    if (record.pdl) object.add("pdl", *record.pdl ? "true" : "false");
    object.add_string("chosen", record.chosen);
    object.add_string("gpu", info.gpu);
    object.add_string("host_cpu", info.host_cpu);
    object.add_string("driver", info.driver);
    object.add_string("cuda", info.cuda);
    object.add_string("nccl", info.nccl);
    object.add_string("commit", info.commit);
    object.add_string("date", info.date);
    object.add_string("backend", info.backend);
    object.add_string("method", record.method.empty() ? info.method : record.method);
    out << "  " << object.str() << (i + 1 < records.size() ? ",\n" : "\n");
  }
  out << "]\n";
  std::ofstream file(path);
  if (!file) throw Error("tpfuse-bench: cannot open " + path + " for writing");
  file << out.str();
  file.close();
  if (!file) throw Error("tpfuse-bench: failed writing " + path);
}

void print_table(const RunInfo& info, const std::vector<Record>& records) {
  // (op, impl) -> hidden -> tokens -> us
  std::map<std::pair<std::string, std::string>, std::map<int64_t, std::map<int64_t, double>>>
      figures;
  std::map<int64_t, std::set<int64_t>> tokens_by_hidden;
  std::map<int64_t, int> world_by_hidden;
  for (const Record& record : records) {
    if (!in_table(record.op, record.impl)) continue;  // floors and the QK norm: printed below
    figures[{record.op, record.impl}][record.hidden][record.tokens] = record.us;
    tokens_by_hidden[record.hidden].insert(record.tokens);
    world_by_hidden[record.hidden] = std::max(world_by_hidden[record.hidden], record.world_size);
  }
  auto lookup = [&](const Column& column, int64_t hidden, int64_t tokens) {
    const auto by_impl = figures.find({column.op, column.impl});
    if (by_impl == figures.end()) return std::nan("");
    const auto by_hidden = by_impl->second.find(hidden);
    if (by_hidden == by_impl->second.end()) return std::nan("");
    const auto found = by_hidden->second.find(tokens);
    return found == by_hidden->second.end() ? std::nan("") : found->second;
  };
  std::vector<const Column*> shown;
  for (const Column& column : kColumns) {
    if (figures.count({column.op, column.impl}) != 0) shown.push_back(&column);
  }
  // The speedup's numerator and denominator: the first two columns (GPU), or the CPU pair.
  const Column* fused = &kColumns[0];
  if (figures.count({fused->op, fused->impl}) == 0) fused = &kColumns[7];
  const bool show_speedup = figures.count({fused->op, fused->impl}) != 0 &&
                            figures.count({kColumns[1].op, kColumns[1].impl}) != 0;

  for (const auto& [hidden, token_counts] : tokens_by_hidden) {
    std::printf("\nhidden %lld, %s, world %d (%s): us per op, rank 0%s\n",
                static_cast<long long>(hidden), info.dtype.c_str(), world_by_hidden[hidden],
                info.backend.c_str(), show_speedup ? "; speedup = nccl_ar+local / tpfuse" : "");
    std::printf("%8s", "tokens");
    for (size_t c = 0; c < shown.size(); ++c) {
      std::printf(" %14s", shown[c]->label);
      if (show_speedup && shown[c] == &kColumns[kSpeedupAfterColumn]) {
        std::printf(" %9s", "speedup");
      }
    }
    std::printf("\n");
    for (const int64_t tokens : token_counts) {
      std::printf("%8lld", static_cast<long long>(tokens));
      for (size_t c = 0; c < shown.size(); ++c) {
        std::printf(" %14s", format_us(lookup(*shown[c], hidden, tokens)).c_str());
        if (show_speedup && shown[c] == &kColumns[kSpeedupAfterColumn]) {
          const double ratio = lookup(kColumns[1], hidden, tokens) / lookup(*fused, hidden, tokens);
          char text[32];
          std::snprintf(text, sizeof(text), "%.2fx", ratio);
          std::printf(" %9s", std::isfinite(ratio) ? text : "-");
        }
      }
      std::printf("\n");
    }
  }

  bool floors_header = false;
  for (const Record& record : records) {
    if (record.op != "floor") continue;
    if (!floors_header) {
      std::printf("\nfloors (same run):\n");
      floors_header = true;
    }
    if (record.gbps && record.tokens > 0) {
      std::printf("  %-32s %6lld tokens %10.2f us  %8.1f GB/s\n", record.impl.c_str(),
                  static_cast<long long>(record.tokens), record.us, *record.gbps);
    } else if (record.gbps) {
      std::printf("  %-26s %10.1f us  %8.1f GB/s\n", record.impl.c_str(), record.us, *record.gbps);
    } else {
      std::printf("  %-26s %10.3f us\n", record.impl.c_str(), record.us);
    }
  }
  std::fflush(stdout);
}

}  // namespace tpfuse::bench
