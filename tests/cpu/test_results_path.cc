// tpfuse-bench's results naming (bench/results_path.h): the time is in the name, and a name that
// is taken gets the first free numeric suffix; an existing file is never touched.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "results_path.h"

namespace {

std::filesystem::path fresh_dir(const std::string& name) {
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() /
      ("tpfuse-results-test-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  return dir;
}

std::string contents(const std::filesystem::path& path) {
  std::ifstream file(path);
  return std::string(std::istreambuf_iterator<char>(file), {});
}

}  // namespace

TEST(ResultsPath, StemHasDeviceWorldDateTimeAndCommit) {
  // 2026-11-30T23:35:54Z
  EXPECT_EQ(tpfuse::bench::results_stem("nvidia-h200", 2, std::time_t(1796081754), "81e26ad"),
            "nvidia-h200-x2-20261130-233554-81e26ad");
}

TEST(ResultsPath, TakenNamesGetTheFirstFreeSuffixAndAreNeverOverwritten) {
  const std::filesystem::path dir = fresh_dir("suffix");
  const std::filesystem::path wanted = dir / "sub" / "run.json";
  const auto first = tpfuse::bench::create_unique_file(wanted);
  EXPECT_EQ(first, wanted);  // missing directories are made
  { std::ofstream(first) << "earlier run"; }
  const auto second = tpfuse::bench::create_unique_file(wanted);
  EXPECT_EQ(second, dir / "sub" / "run-1.json");
  const auto third = tpfuse::bench::create_unique_file(wanted);
  EXPECT_EQ(third, dir / "sub" / "run-2.json");
  EXPECT_EQ(contents(first), "earlier run");
  std::filesystem::remove(second);  // a freed name is reused, the others stay
  EXPECT_EQ(tpfuse::bench::create_unique_file(wanted), second);
  EXPECT_EQ(contents(first), "earlier run");
  std::filesystem::remove_all(dir);
}
