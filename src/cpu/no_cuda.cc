// Built only without the CUDA toolkit: the CUDA backend's entry points say so.
#include "common/error.h"
#include "common/team_state.h"

namespace tpfuse {
namespace impl {

[[noreturn]] static void no_cuda(const char* what) {
  TPF_FAIL(what << ": this build of tpfuse has no CUDA backend (configured without nvcc)");
}

void cuda_oneshot(const TeamState&, const OneShotParams&, DType, Epilogue, cudaStream_t) {
  no_cuda("allreduce_add_rmsnorm");
}
void cuda_twoshot(const TeamState&, const OneShotParams&, DType, Epilogue, cudaStream_t) {
  no_cuda("allreduce_add_rmsnorm");
}
void cuda_nccl_path(const TeamState&, const OneShotParams&, DType, Epilogue, cudaStream_t) {
  no_cuda("allreduce_add_rmsnorm");
}
void cuda_qk_nccl_path(const TeamState&, const QkNormParams&, DType, cudaStream_t) {
  no_cuda("allreduce_qk_rmsnorm");
}
void cuda_local_epilogue(const OneShotParams&, DType, Epilogue, cudaStream_t) {
  no_cuda("add_rmsnorm");
}
void cuda_check(const TeamState&) {
  no_cuda("Team::check");
}
void cuda_validate_call(const TeamState&, const AddRmsNormArgs&, cudaStream_t, const char*) {
  no_cuda("validate");
}
void cuda_qk_rmsnorm(const TeamState&, const QkNormParams&, DType, cudaStream_t) {
  no_cuda("allreduce_qk_rmsnorm");
}
void cuda_qk_local(const QkNormParams&, DType, QkPass, cudaStream_t) {
  no_cuda("qk_sum_squares / qk_rmsnorm_from_sums");
}
void cuda_validate_pointers(const TeamState&,
                            std::initializer_list<std::pair<const char*, const void*>>,
                            cudaStream_t, const char*) {
  no_cuda("validate");
}

}  // namespace impl

bool cuda_available() {
  return false;
}
int cuda_device_count() {
  return 0;
}
std::vector<Team> create_cuda_team(const std::vector<int>&, const TeamOptions&) {
  impl::no_cuda("create_cuda_team");
}
bool nccl_available() {
  return false;
}
UniqueId create_unique_id() {
  impl::no_cuda("create_unique_id");
}
Team create_nccl_team(ncclComm_t, const TeamOptions&) {
  impl::no_cuda("create_nccl_team");
}
Team create_nccl_team(const UniqueId&, int, int, int, const TeamOptions&) {
  impl::no_cuda("create_nccl_team");
}

}  // namespace tpfuse
