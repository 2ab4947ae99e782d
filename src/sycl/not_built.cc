// What a build without the SYCL backend says (compiled instead of src/sycl/, where TPFUSE_SYCL
// found no runtime): no SYCL backend in the registry, and an error naming it from every SYCL
// entry point (core/registry.cc's message).
#include "core/backend.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse {
namespace impl {

const BackendOps* sycl_backend_ops() {
  return nullptr;
}

}  // namespace impl

bool sycl_available() {
  return false;
}

std::vector<Team> create_sycl_team(int, const TeamOptions&) {
  impl::missing_backend(Backend::kSycl, "create_sycl_team");
}

}  // namespace tpfuse
