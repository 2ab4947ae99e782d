// What the CUDA teams need from NCCL, with stubs (src/team/no_nccl.cc) for builds without it.
#pragma once

#include <vector>

namespace tpfuse::impl {

// One communicator per device for an in-process team (ncclCommInitAll); empty without NCCL.
std::vector<void*> create_in_process_comms(const std::vector<int>& devices);
void destroy_in_process_comms(std::vector<void*>& comms);

}  // namespace tpfuse::impl
