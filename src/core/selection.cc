// Algorithm selection: the measured table (data/algorithms.csv, built in; or the file named by
// TPFUSE_ALGORITHM_TABLE), then what the team and its workspace allow.
#include <cstdlib>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "core/selection.h"

#include "core/backend.h"
#include "core/error.h"
#include "core/validate.h"
#include "tpfuse/impl/lamport.h"

namespace tpfuse {

const char* algorithm_name(Algorithm algorithm) {
  return impl::enumerator_name(algorithm);
}

namespace impl {

extern const char* const kBuiltinAlgorithmTable;

namespace {

std::string trim(const std::string& text) {
  const size_t first = text.find_first_not_of(" \t\r");
  if (first == std::string::npos) return "";
  const size_t last = text.find_last_not_of(" \t\r");
  return text.substr(first, last - first + 1);
}

const std::vector<SelectionRule>& selection_table() {
  static std::once_flag once;
  static std::vector<SelectionRule> table;
  std::call_once(once, [] {
    const char* path = std::getenv("TPFUSE_ALGORITHM_TABLE");
    if (path != nullptr && path[0] != '\0') {
      std::ifstream file(path);
      if (!file) TPF_FAIL("TPFUSE_ALGORITHM_TABLE names " << path << ", which cannot be read");
      std::stringstream text;
      text << file.rdbuf();
      table = parse_selection_table(text.str(), path);
    } else {
      table = parse_selection_table(kBuiltinAlgorithmTable, "data/algorithms.csv (built in)");
    }
  });
  return table;
}

}  // namespace

std::vector<SelectionRule> parse_selection_table(const std::string& text,
                                                 const std::string& origin) {
  std::vector<SelectionRule> rules;
  std::stringstream lines(text);
  std::string line;
  int number = 0;
  bool header_seen = false;
  while (std::getline(lines, line)) {
    ++number;
    line = trim(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> fields;
    std::stringstream row(line);
    std::string field;
    while (std::getline(row, field, ',')) fields.push_back(trim(field));
    const auto bad = [&](const std::string& why) {
      TPF_FAIL("selection table " << origin << " line " << number << ": " << why << " in '" << line
                                  << "' (expected device,world_size,max_bytes,algorithm)");
    };
    if (fields.size() != 4) bad("4 fields expected, got " + std::to_string(fields.size()));
    if (!header_seen && fields[0] == "device") {
      header_seen = true;
      continue;
    }
    SelectionRule rule{};
    rule.device = fields[0];
    if (rule.device.empty()) bad("empty device");
    if (fields[1] == "*") {
      rule.world_size = 0;
    } else {
      char* end = nullptr;
      const long world = std::strtol(fields[1].c_str(), &end, 10);
      if (*end != '\0' || world < 1 || world > kMaxWorldSize) bad("world_size not in 1..16 or *");
      rule.world_size = int(world);
    }
    if (fields[2] == "inf") {
      rule.max_bytes = std::numeric_limits<uint64_t>::max();
    } else {
      char* end = nullptr;
      const unsigned long long bytes = std::strtoull(fields[2].c_str(), &end, 10);
      if (fields[2].empty() || *end != '\0' || fields[2][0] == '-') bad("max_bytes not a number");
      rule.max_bytes = bytes;
    }
    if (fields[3] == "oneshot") {
      rule.algorithm = Algorithm::kOneShot;
    } else if (fields[3] == "twoshot") {
      rule.algorithm = Algorithm::kTwoShot;
    } else if (fields[3] == "nccl") {
      rule.algorithm = Algorithm::kNccl;
    } else {
      bad("algorithm not oneshot, twoshot or nccl");
    }
    rules.push_back(rule);
  }
  return rules;
}

std::vector<SelectionStep> selection_for(const std::string& device_name, int world_size) {
  std::vector<SelectionStep> steps;
  for (const SelectionRule& rule : selection_table()) {
    if (rule.device != "*" && rule.device != device_name) continue;
    if (rule.world_size != 0 && rule.world_size != world_size) continue;
    steps.push_back({rule.max_bytes, rule.algorithm});
  }
  return steps;
}

namespace {
Algorithm first_step(const std::vector<SelectionStep>& steps, uint64_t bytes) {
  for (const SelectionStep& step : steps) {
    if (bytes <= step.max_bytes) return step.algorithm;
  }
  return Algorithm::kNccl;  // a table without a catch-all row
}
}  // namespace

Algorithm table_algorithm(const std::string& device_name, int world_size, uint64_t bytes) {
  return first_step(selection_for(device_name, world_size), bytes);
}

Algorithm choose_algorithm(const TeamState& team, int64_t tokens, int64_t hidden, DType dtype,
                           Algorithm requested, const char* op) {
  TPF_CHECK_ARG(is_known(requested), op, "algorithm " << int(requested) << " is not an Algorithm");
  const size_t row_bytes = size_t(hidden) * dtype_size(dtype);
  const uint64_t bytes = uint64_t(tokens) * row_bytes;
  const bool has_nccl = team.ops->has_nccl_path(team);
  const bool oneshot_fits = bytes <= team.packet_bytes();
  const bool twoshot_fits =
      tokens <= twoshot_max_tokens(team.world_size(), team.packet_bytes(), row_bytes);
  const auto capacity_error = [&](Algorithm algorithm, int64_t most) {
    TPF_CHECK_ARG(
        false, op,
        "tokens " << tokens << " x hidden " << hidden << " of " << dtype_name(dtype) << " needs "
                  << bytes << " bytes, more than " << algorithm_name(algorithm)
                  << " carries in the team's packet capacity of " << team.packet_bytes()
                  << " bytes (at most " << most << " tokens; raise TeamOptions::packet_bytes)");
    return Algorithm::kNccl;  // not reached
  };
  switch (requested) {
    case Algorithm::kOneShot:
    case Algorithm::kTwoShot:
      TPF_CHECK_ARG(team.fused, op,
                    "algorithm " << algorithm_name(requested)
                                 << " needs peer stores, which this team does not use: "
                                 << team.fallback_reason);
      if (requested == Algorithm::kOneShot && !oneshot_fits) {
        capacity_error(requested, int64_t(team.packet_bytes() / row_bytes));
      }
      if (requested == Algorithm::kTwoShot && !twoshot_fits) {
        capacity_error(requested,
                       twoshot_max_tokens(team.world_size(), team.packet_bytes(), row_bytes));
      }
      return requested;
    case Algorithm::kNccl:
      TPF_CHECK_ARG(has_nccl, op,
                    "algorithm nccl needs NCCL, which this build or team does not have");
      return requested;
    case Algorithm::kAuto:
      break;
  }
  if (!team.fused) {
    TPF_CHECK_ARG(
        has_nccl, op,
        "the team cannot use peer stores (" << team.fallback_reason << ") and has no NCCL path");
    return Algorithm::kNccl;
  }
  Algorithm choice =
      team.world_size() == 1 ? Algorithm::kOneShot : first_step(team.selection, bytes);
  if (choice == Algorithm::kOneShot && !oneshot_fits) choice = Algorithm::kTwoShot;
  if (choice == Algorithm::kTwoShot && !twoshot_fits) {
    choice = oneshot_fits ? Algorithm::kOneShot : Algorithm::kNccl;
  }
  if (choice == Algorithm::kNccl && !has_nccl) {
    if (oneshot_fits) return Algorithm::kOneShot;
    if (twoshot_fits) return Algorithm::kTwoShot;
    capacity_error(Algorithm::kTwoShot,
                   twoshot_max_tokens(team.world_size(), team.packet_bytes(), row_bytes));
  }
  return choice;
}

}  // namespace impl
}  // namespace tpfuse
