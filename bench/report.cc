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

// The row ops' table (one per width): these columns in this order when measured, then any other
// (op, impl) of these ops (a peer's impls, say) under its impl name. The speedup (the baseline
// column over the first: the selector's choice, or the CPU backend's one-shot) goes after the
// first three columns, where it reads as their conclusion.
constexpr Column kColumns[] = {
    {"tpfuse", "allreduce_add_rmsnorm", "tpfuse_auto"},
    {"nccl_ar+local", "allreduce_add_rmsnorm", "nccl_ar+local_add_rmsnorm"},
    {"nccl_ar", "allreduce", "nccl"},
    {"oneshot", "allreduce_add_rmsnorm", "tpfuse_oneshot"},
    {"twoshot", "allreduce_add_rmsnorm", "tpfuse_twoshot"},
    {"tpfuse_nccl", "allreduce_add_rmsnorm", "tpfuse_nccl"},
    {"tpfuse_ar", "allreduce", "tpfuse_auto"},
    {"local_norm", "add_rmsnorm", "tpfuse_local"},
    {"fp8_static", "allreduce_add_rmsnorm_fp8", "tpfuse_auto"},
    {"fp8_token", "allreduce_add_rmsnorm_fp8_token", "tpfuse_auto"},
    {"fp8_group128", "allreduce_add_rmsnorm_fp8_group128", "tpfuse_auto"},
    {"tpfuse_cpu", "allreduce_add_rmsnorm", "tpfuse_oneshot_cpu"},
    {"cpu_local", "add_rmsnorm", "cpu_local_add_rmsnorm"},
    {"fp8_static_cpu", "allreduce_add_rmsnorm_fp8", "tpfuse_auto_cpu"},
    {"fp8_token_cpu", "allreduce_add_rmsnorm_fp8_token", "tpfuse_auto_cpu"},
    {"fp8_group128_cpu", "allreduce_add_rmsnorm_fp8_group128", "tpfuse_auto_cpu"},
    // The FP8 output alone (no bf16 norm written).
    {"fp8_static_no_norm", "allreduce_add_rmsnorm_fp8", "tpfuse_auto_no_norm"},
    {"fp8_token_no_norm", "allreduce_add_rmsnorm_fp8_token", "tpfuse_auto_no_norm"},
    {"fp8_group128_no_norm", "allreduce_add_rmsnorm_fp8_group128", "tpfuse_auto_no_norm"},
    {"fp8_static_no_norm_cpu", "allreduce_add_rmsnorm_fp8", "tpfuse_auto_no_norm_cpu"},
    {"fp8_token_no_norm_cpu", "allreduce_add_rmsnorm_fp8_token", "tpfuse_auto_no_norm_cpu"},
    {"fp8_group128_no_norm_cpu", "allreduce_add_rmsnorm_fp8_group128", "tpfuse_auto_no_norm_cpu"},
    // The SYCL mode: the op's time, the host's cost of a call, the local kernel, the FP8 outputs.
    {"oneshot_sycl", "allreduce_add_rmsnorm", "tpfuse_oneshot_sycl"},
    {"twoshot_sycl", "allreduce_add_rmsnorm", "tpfuse_twoshot_sycl"},
    {"oneshot_sycl_host", "allreduce_add_rmsnorm", "tpfuse_oneshot_sycl_host"},
    {"twoshot_sycl_host", "allreduce_add_rmsnorm", "tpfuse_twoshot_sycl_host"},
    {"sycl_local", "add_rmsnorm", "sycl_local_add_rmsnorm"},
    {"fp8_static_sycl", "allreduce_add_rmsnorm_fp8", "tpfuse_auto_sycl"},
    {"fp8_token_sycl", "allreduce_add_rmsnorm_fp8_token", "tpfuse_auto_sycl"},
    {"fp8_group128_sycl", "allreduce_add_rmsnorm_fp8_group128", "tpfuse_auto_sycl"},
};
constexpr int kSpeedupAfterColumn = 2;
constexpr int kCpuFusedColumn = 11;

bool is_row_op(const std::string& op) {
  return op == "allreduce_add_rmsnorm" || op == "allreduce" || op == "add_rmsnorm" ||
         op.rfind("allreduce_add_rmsnorm_fp8", 0) == 0;
}

// One printed table: a group of ops at one width, its columns, and the figures.
struct Table {
  std::string title;
  std::vector<std::pair<std::string, std::string>> columns;  // (op, impl) in display order
  std::vector<std::string> labels;
  std::map<std::pair<std::string, std::string>, std::map<int64_t, double>> us;  // by tokens
  std::set<int64_t> tokens;
  int world = 1;
};

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
    object.add_string("shape", record.shape);
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
  // Tables in the order their first record was measured: the row ops share one per width, every
  // other op (the QK norm) has its own per width, labelled with its shape.
  std::vector<std::string> order;
  std::map<std::string, Table> tables;
  for (const Record& record : records) {
    if (record.op == "floor") continue;  // printed below
    const std::string group = is_row_op(record.op) ? "rows" : record.op;
    const std::string key = group + "/" + std::to_string(record.hidden);
    auto [found, inserted] = tables.try_emplace(key);
    Table& table = found->second;
    if (inserted) {
      order.push_back(key);
      table.title = group == "rows"
                        ? "hidden " + std::to_string(record.hidden)
                        : record.op + ", " +
                              (record.shape.empty() ? "hidden " + std::to_string(record.hidden)
                                                    : record.shape);
    }
    const std::pair<std::string, std::string> column{record.op, record.impl};
    table.us[column][record.tokens] = record.us;
    table.tokens.insert(record.tokens);
    table.world = std::max(table.world, record.world_size);
  }
  for (auto& [key, table] : tables) {
    // Known columns first, in kColumns' order; then the rest in the order they were measured.
    for (const Column& known : kColumns) {
      if (table.us.count({known.op, known.impl}) != 0) {
        table.columns.emplace_back(known.op, known.impl);
        table.labels.push_back(known.label);
      }
    }
    for (const Record& record : records) {
      const std::pair<std::string, std::string> column{record.op, record.impl};
      if (table.us.count(column) == 0 ||
          std::find(table.columns.begin(), table.columns.end(), column) != table.columns.end()) {
        continue;
      }
      table.columns.push_back(column);
      table.labels.push_back(is_row_op(record.op) && record.op != "allreduce_add_rmsnorm"
                                 ? record.op + ":" + record.impl
                                 : record.impl);
    }
  }

  for (const std::string& key : order) {
    const Table& table = tables.at(key);
    auto lookup = [&](const std::pair<std::string, std::string>& column, int64_t tokens) {
      const auto by_column = table.us.find(column);
      if (by_column == table.us.end()) return std::nan("");
      const auto found = by_column->second.find(tokens);
      return found == by_column->second.end() ? std::nan("") : found->second;
    };
    // The speedup: the NCCL baseline over the selector's choice (or the CPU backend's one-shot).
    std::pair<std::string, std::string> fused{kColumns[0].op, kColumns[0].impl};
    if (table.us.count(fused) == 0)
      fused = {kColumns[kCpuFusedColumn].op, kColumns[kCpuFusedColumn].impl};
    const std::pair<std::string, std::string> baseline{kColumns[1].op, kColumns[1].impl};
    const bool show_speedup = table.us.count(fused) != 0 && table.us.count(baseline) != 0;
    std::printf("\n%s, %s, world %d (%s): us per op, rank 0%s\n", table.title.c_str(),
                info.dtype.c_str(), table.world, info.backend.c_str(),
                show_speedup ? "; speedup = nccl_ar+local / tpfuse" : "");
    size_t width = 12;
    for (const std::string& label : table.labels) width = std::max(width, label.size());
    std::printf("%8s", "tokens");
    for (size_t c = 0; c < table.columns.size(); ++c) {
      std::printf(" %*s", int(width), table.labels[c].c_str());
      if (show_speedup && table.labels[c] == kColumns[kSpeedupAfterColumn].label) {
        std::printf(" %9s", "speedup");
      }
    }
    std::printf("\n");
    for (const int64_t tokens : table.tokens) {
      std::printf("%8lld", static_cast<long long>(tokens));
      for (size_t c = 0; c < table.columns.size(); ++c) {
        std::printf(" %*s", int(width), format_us(lookup(table.columns[c], tokens)).c_str());
        if (show_speedup && table.labels[c] == kColumns[kSpeedupAfterColumn].label) {
          const double ratio = lookup(baseline, tokens) / lookup(fused, tokens);
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
