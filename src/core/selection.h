// Algorithm selection (core/selection.cc): the measured table, then what the team allows.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/team_state.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// The algorithm a row call runs (Team::choose): throws naming `op` if a forced one cannot run.
Algorithm choose_algorithm(const TeamState& team, int64_t tokens, int64_t hidden, DType dtype,
                           Algorithm requested, const char* op);
// The rows of the selection table (data/algorithms.csv, or the file named by
// TPFUSE_ALGORITHM_TABLE) for a device and world size; a team keeps them.
std::vector<SelectionStep> selection_for(const std::string& device_name, int world_size);
// The table's choice for a message: the first row whose device, world size and byte bound match.
Algorithm table_algorithm(const std::string& device_name, int world_size, uint64_t bytes);
struct SelectionRule {
  std::string device;  // "*" or a device name
  int world_size;      // 0: any
  uint64_t max_bytes;  // messages of at most this many bytes
  Algorithm algorithm;
};
// Parses a selection table (CSV text); throws naming the line of a malformed row.
std::vector<SelectionRule> parse_selection_table(const std::string& text,
                                                 const std::string& origin);

}  // namespace tpfuse::impl
