// Where tpfuse-bench writes its results, and the rule that no run overwrites an earlier one.
//
//   default directory  ./tpfuse-results/ (the working directory's; --out-dir DIR picks another)
//   file name          <device>-x<world>-<YYYYMMDD>-<HHMMSS>-<commit>.json, UTC
//   taken already      <stem>-1.json, <stem>-2.json, ... (also for --out PATH): the first free one
//
// The file is created exclusively (O_EXCL), so two runs started in the same second get two files.
#pragma once

#include <ctime>
#include <filesystem>
#include <string>

namespace tpfuse::bench {

constexpr const char* kDefaultResultsDir = "tpfuse-results";

// "nvidia-h200-x2-20261130-233554-81e26ad": device slug, world size, UTC date and time, commit.
std::string results_stem(const std::string& device, int world_size, std::time_t when,
                         const std::string& commit);

// Creates `wanted` if it does not exist, else the first of <stem>-1<ext>, <stem>-2<ext>, ...
// that does not; creates missing parent directories. Returns the path created (empty file).
// Throws tpfuse::Error when nothing can be created.
std::filesystem::path create_unique_file(const std::filesystem::path& wanted);

}  // namespace tpfuse::bench
