// What a build without the CUDA backend says (compiled instead of src/cuda/): no CUDA backend in
// the registry, and an error naming it from every CUDA entry point (core/registry.cc's message).
#include "core/backend.h"
#include "tpfuse/cuda.h"

namespace tpfuse {
namespace impl {

const BackendOps* cuda_backend_ops() {
  return nullptr;
}

}  // namespace impl

bool cuda_available() {
  return false;
}

int cuda_device_count() {
  return 0;
}

bool nccl_available() {
  return false;
}

std::vector<Team> create_cuda_team(const std::vector<int>&, const TeamOptions&) {
  impl::missing_backend(Backend::kCuda, "create_cuda_team");
}

Team create_cuda_team(const CpuTeamId&, int, int, int, const TeamOptions&) {
  impl::missing_backend(Backend::kCuda, "create_cuda_team");
}

UniqueId create_unique_id() {
  impl::missing_backend(Backend::kCuda, "create_unique_id");
}

Team create_nccl_team(ncclComm_t, const TeamOptions&) {
  impl::missing_backend(Backend::kCuda, "create_nccl_team");
}

Team create_nccl_team(const UniqueId&, int, int, int, const TeamOptions&) {
  impl::missing_backend(Backend::kCuda, "create_nccl_team");
}

}  // namespace tpfuse
