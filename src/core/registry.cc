// The backends, one line each. A backend is a folder (src/cpu/, src/cuda/, src/sycl/) that defines
// the function its line names: its BackendOps, or null in a build without it (the folder's
// not_built.cc, compiled instead of the backend). Nothing else in the core names a backend.
#include "core/backend.h"
#include "core/error.h"

namespace tpfuse::impl {

const BackendOps* cpu_backend_ops();   // src/cpu/backend.cc
const BackendOps* cuda_backend_ops();  // src/cuda/backend.cu, or src/cuda/not_built.cc
const BackendOps* sycl_backend_ops();  // src/sycl/backend.cc, or src/sycl/not_built.cc

namespace {

struct RegisteredBackend {
  Backend kind;
  const char* name;
  const char* absence;  // why a build lacks it
  const BackendOps* (*ops)();
};

constexpr RegisteredBackend kBackends[] = {
    {Backend::kCpu, "CPU", "", cpu_backend_ops},
    {Backend::kCuda, "CUDA", "configured without nvcc", cuda_backend_ops},
    {Backend::kSycl, "SYCL", "configured without Intel's SYCL runtime: TPFUSE_SYCL, docs/sycl.md",
     sycl_backend_ops},
};

}  // namespace

const BackendOps* find_backend(Backend kind) {
  for (const RegisteredBackend& backend : kBackends) {
    if (backend.kind == kind) return backend.ops();
  }
  return nullptr;
}

void missing_backend(Backend kind, const char* op) {
  for (const RegisteredBackend& backend : kBackends) {
    if (backend.kind == kind) {
      TPF_FAIL(op << ": this build of tpfuse has no " << backend.name << " backend ("
                  << backend.absence << ")");
    }
  }
  TPF_CHECK_ARG(false, op, "backend " << int(kind) << " is not a Backend");
  throw Error("tpfuse: unreachable");  // TPF_CHECK_ARG(false, ...) has thrown
}

const BackendOps& require_backend(Backend kind, const char* op) {
  const BackendOps* ops = find_backend(kind);
  if (ops == nullptr) missing_backend(kind, op);
  return *ops;
}

}  // namespace tpfuse::impl
