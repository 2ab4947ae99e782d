// What this build of tpfuse has: the CPU backend always, the CUDA backend and NCCL when they were
// configured (TPFUSE_HAVE_CUDA, TPFUSE_HAVE_NCCL). The one place that asks.
#include "core/backend.h"
#include "core/error.h"

namespace tpfuse {
namespace impl {

const BackendOps* cuda_backend() {
#if TPFUSE_HAVE_CUDA
  return &cuda_backend_ops();
#else
  return nullptr;
#endif
}

const CudaTeams* cuda_teams() {
#if TPFUSE_HAVE_CUDA
  return &cuda_team_factory();
#else
  return nullptr;
#endif
}

const NcclSupport* nccl_support() {
#if TPFUSE_HAVE_NCCL
  return &nccl_support_ops();
#else
  return nullptr;
#endif
}

const BackendOps& require_backend(Backend kind, const char* op) {
  switch (kind) {
    case Backend::kCpu:
      return cpu_backend();
    case Backend::kCuda:
      if (cuda_backend() == nullptr) {
        TPF_FAIL(op << ": this build of tpfuse has no CUDA backend (configured without nvcc)");
      }
      return *cuda_backend();
  }
  TPF_CHECK_ARG(false, op, "backend " << int(kind) << " is not a Backend");
  return cpu_backend();  // not reached
}

namespace {

const CudaTeams& require_cuda_teams(const char* op) {
  if (cuda_teams() == nullptr) {
    TPF_FAIL(op << ": this build of tpfuse has no CUDA backend (configured without nvcc)");
  }
  return *cuda_teams();
}

const NcclSupport& require_nccl(const char* op) {
  require_cuda_teams(op);
  if (nccl_support() == nullptr) {
    TPF_FAIL(op << ": this build of tpfuse has no NCCL (configure with NCCL_ROOT)");
  }
  return *nccl_support();
}

}  // namespace
}  // namespace impl

bool cuda_available() {
  return impl::cuda_teams() != nullptr;
}

int cuda_device_count() {
  return cuda_available() ? impl::cuda_teams()->device_count() : 0;
}

bool nccl_available() {
  return impl::nccl_support() != nullptr;
}

std::vector<Team> create_cuda_team(const std::vector<int>& devices, const TeamOptions& options) {
  return impl::require_cuda_teams("create_cuda_team").in_process(devices, options);
}

Team create_cuda_team(const CpuTeamId& id, int rank, int world_size, int device,
                      const TeamOptions& options) {
  return impl::require_cuda_teams("create_cuda_team")
      .process_team(id, rank, world_size, device, options);
}

UniqueId create_unique_id() {
  return impl::require_nccl("create_unique_id").unique_id();
}

Team create_nccl_team(ncclComm_t comm, const TeamOptions& options) {
  return impl::require_nccl("create_nccl_team").team_over(comm, options);
}

Team create_nccl_team(const UniqueId& id, int rank, int world_size, int device,
                      const TeamOptions& options) {
  return impl::require_nccl("create_nccl_team").team_from_id(id, rank, world_size, device, options);
}

}  // namespace tpfuse
