// RowShard's members (row_launch.cuh), for the shards: translation units that CMakeLists.txt
// generates from kernel_part.cu.in, each including one kernel's .cuh (which includes this file)
// and instantiating one RowShard<Kernel, shard>. The launchers never include it, so a kernel is
// instantiated only in the shard that holds its epilogue.
#pragma once

#include <type_traits>

#include "cuda/row_launch.cuh"
#include "tpfuse/impl/epilogue.h"

namespace tpfuse::impl {

// The epilogues of `List` at positions kShard, kShard + kRowShards, ... of RowEpilogues
// (kPosition: the position of List's first epilogue), appended to `Kept`.
template <int kShard, typename List, int kPosition = 0, typename Kept = EpilogueList<>>
struct ShardEpilogues {
  using type = Kept;  // List is empty
};

template <int kShard, typename First, typename... Rest, int kPosition, typename... Kept>
struct ShardEpilogues<kShard, EpilogueList<First, Rest...>, kPosition, EpilogueList<Kept...>>
    : ShardEpilogues<kShard, EpilogueList<Rest...>, kPosition + 1,
                     std::conditional_t<kPosition % kRowShards == kShard,
                                        EpilogueList<Kept..., First>, EpilogueList<Kept...>>> {};

template <typename Kernel, int kShard>
bool RowShard<Kernel, kShard>::launch(const RowEpilogueKind& epilogue, const RowLaunch& row) {
  using Epilogues = typename ShardEpilogues<kShard, RowEpilogues>::type;
  return dispatch_epilogue_in(Epilogues{}, epilogue, [&](auto epilogue_tag) {
    Kernel::template launch_call<decltype(epilogue_tag)>(row);
  });
}

template <typename Kernel, int kShard>
void RowShard<Kernel, kShard>::preload(int world_size) {
  using Epilogues = typename ShardEpilogues<kShard, RowEpilogues>::type;
  for_each_epilogue_in(Epilogues{}, [&](auto epilogue_tag) {
    Kernel::template preload_kernels<decltype(epilogue_tag)>(world_size);
  });
}

}  // namespace tpfuse::impl
