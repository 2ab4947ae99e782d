// Built for CUDA builds without NCCL: the NCCL path and multi-process teams say so.
#include "common/error.h"
#include "common/team_state.h"
#include "team/nccl_support.h"

namespace tpfuse {
namespace impl {
namespace {
[[noreturn]] void no_nccl(const char* what) {
  TPF_FAIL(what << ": this build of tpfuse has no NCCL (configure with NCCL_ROOT)");
}
}  // namespace

std::vector<void*> create_in_process_comms(const std::vector<int>&) {
  return {};
}
void destroy_in_process_comms(std::vector<void*>&) {}
void cuda_nccl_path(const TeamState&, const OneShotParams&, DType, Epilogue, cudaStream_t) {
  no_nccl("the NCCL path");
}
void cuda_qk_nccl_path(const TeamState&, const QkNormParams&, DType, cudaStream_t) {
  no_nccl("the NCCL path");
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
