// What a build of the CUDA backend without NCCL says (compiled instead of src/cuda/nccl.cu and
// src/cuda/team/nccl_team.cu): no NCCL path, and no team over NCCL.
#include "core/error.h"
#include "cuda/team_state.h"
#include "tpfuse/cuda.h"

namespace tpfuse {
namespace impl {
namespace {

[[noreturn]] void no_nccl(const char* op) {
  TPF_FAIL(op << ": this build of tpfuse has no NCCL (configure with NCCL_ROOT)");
}

}  // namespace

const NcclSupport* nccl_support() {
  return nullptr;
}

}  // namespace impl

bool nccl_available() {
  return false;
}

UniqueId create_unique_id() {
  impl::no_nccl("create_unique_id");
}

Team create_nccl_team(ncclComm_t, const TeamOptions&) {
  impl::no_nccl("create_nccl_team");
}

Team create_nccl_team(const UniqueId&, int, int, int, const TeamOptions&) {
  impl::no_nccl("create_nccl_team");
}

}  // namespace tpfuse
