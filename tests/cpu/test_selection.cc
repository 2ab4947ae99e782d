// Algorithm selection: the table's format and matching, and Team::choose's fallbacks.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "core/selection.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse {
namespace {

std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const Error& error) {
    return error.what();
  }
  return "";
}

TEST(SelectionTable, ParsesRowsCommentsAndWildcards) {
  const auto rules = impl::parse_selection_table(
      "# comment\n"
      "device,world_size,max_bytes,algorithm\n"
      "NVIDIA H200, 2, 1024, oneshot\n"
      "\n"
      "*,*,inf,twoshot\n",
      "test");
  ASSERT_EQ(rules.size(), 2u);
  EXPECT_EQ(rules[0].device, "NVIDIA H200");
  EXPECT_EQ(rules[0].world_size, 2);
  EXPECT_EQ(rules[0].max_bytes, 1024u);
  EXPECT_EQ(rules[0].algorithm, Algorithm::kOneShot);
  EXPECT_EQ(rules[1].world_size, 0);
  EXPECT_EQ(rules[1].max_bytes, ~uint64_t{0});
  EXPECT_EQ(rules[1].algorithm, Algorithm::kTwoShot);
}

TEST(SelectionTable, MalformedRowsAreNamedByLine) {
  EXPECT_NE(error_of([] { impl::parse_selection_table("a,b,c\n", "t"); }).find("line 1"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              impl::parse_selection_table("x,2,10,fastest\n", "t");
            }).find("algorithm not oneshot, twoshot or nccl"),
            std::string::npos);
  EXPECT_NE(error_of([] {
              impl::parse_selection_table("#\nx,99,10,nccl\n", "t");
            }).find("line 2: world_size"),
            std::string::npos);
  EXPECT_NE(error_of([] { impl::parse_selection_table("x,2,-5,nccl\n", "t"); }).find("max_bytes"),
            std::string::npos);
}

TEST(SelectionTable, BuiltInTableMatchesDeviceWorldAndSize) {
  // data/algorithms.csv: measured rows for the H200 pair, defaults for the rest.
  EXPECT_EQ(impl::table_algorithm("NVIDIA H200", 2, 6144), Algorithm::kOneShot);
  EXPECT_EQ(impl::table_algorithm("NVIDIA H200", 2, 1572864), Algorithm::kOneShot);
  EXPECT_EQ(impl::table_algorithm("NVIDIA H200", 2, 1572864 + 1), Algorithm::kTwoShot);
  EXPECT_EQ(impl::table_algorithm("NVIDIA H200", 2, 96u << 20), Algorithm::kTwoShot);
  EXPECT_EQ(impl::table_algorithm("NVIDIA H200", 2, (96u << 20) + 1), Algorithm::kNccl);
  EXPECT_EQ(impl::table_algorithm("NVIDIA H200", 4, 6144), Algorithm::kOneShot);
  EXPECT_EQ(impl::table_algorithm("some GPU", 4, 1024), Algorithm::kOneShot);
  EXPECT_EQ(impl::table_algorithm("some GPU", 4, 64u << 20), Algorithm::kNccl);
  // CPU teams (device "cpu"): one-shot for one token at 2 and 4 ranks, two-shot beyond (and at 8
  // ranks from one token on).
  EXPECT_EQ(impl::table_algorithm("cpu", 2, 6144), Algorithm::kOneShot);
  EXPECT_EQ(impl::table_algorithm("cpu", 4, 6144), Algorithm::kOneShot);
  EXPECT_EQ(impl::table_algorithm("cpu", 8, 6144), Algorithm::kTwoShot);
  for (const int world : {2, 3, 4, 8}) {
    EXPECT_EQ(impl::table_algorithm("cpu", world, 4u << 20), Algorithm::kTwoShot) << world;
  }
}

TEST(TeamChoose, FallsBackToWhatCarriesTheMessage) {
  TeamOptions options;
  options.packet_bytes = 1 << 20;
  const std::vector<Team> team = create_cpu_team(4, options);
  // 1 token of 3072 bf16: the CPU rows' one-shot.
  EXPECT_EQ(team[0].choose(1, 3072, DType::kBFloat16), Algorithm::kOneShot);
  // 1 MiB + 1 row: over one-shot's capacity; the CPU rows say two-shot for large messages.
  EXPECT_EQ(team[0].choose(171, 3072, DType::kBFloat16), Algorithm::kTwoShot);
  // Over two-shot's capacity too: the NCCL path's stand-in.
  EXPECT_EQ(team[0].choose(341, 3072, DType::kBFloat16), Algorithm::kNccl);
  // Forced algorithms run as asked, within their capacity.
  EXPECT_EQ(team[0].choose(1, 3072, DType::kBFloat16, Algorithm::kTwoShot), Algorithm::kTwoShot);
  EXPECT_EQ(team[0].choose(5000, 3072, DType::kBFloat16, Algorithm::kNccl), Algorithm::kNccl);
  EXPECT_EQ(team[0].max_tokens(3072, DType::kBFloat16, Algorithm::kOneShot), 170);
  EXPECT_EQ(team[0].max_tokens(3072, DType::kBFloat16, Algorithm::kTwoShot), 4 * 85);
  EXPECT_NE(error_of([&] {
              team[0].choose(341, 3072, DType::kBFloat16, Algorithm::kTwoShot);
            }).find("at most 340 tokens"),
            std::string::npos);
  EXPECT_TRUE(team[0].fallback_reason().empty());
  EXPECT_EQ(team[0].peer_memory(), "host memory");
}

TEST(TeamChoose, TeamWithoutPeerStoresRunsEverythingThroughNccl) {
  TeamOptions options;
  options.peer_stores = false;
  const std::vector<Team> team = create_cpu_team(2, options);
  EXPECT_NE(team[0].fallback_reason().find("peer_stores is false"), std::string::npos);
  EXPECT_EQ(team[0].choose(1, 3072, DType::kBFloat16), Algorithm::kNccl);
  EXPECT_NE(error_of([&] {
              team[0].choose(1, 3072, DType::kBFloat16, Algorithm::kOneShot);
            }).find("needs peer stores"),
            std::string::npos);
  EXPECT_EQ(team[0].max_tokens(3072, DType::kBFloat16, Algorithm::kOneShot), 0);
}

}  // namespace
}  // namespace tpfuse
