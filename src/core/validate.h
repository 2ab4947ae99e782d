// Argument checks shared by every backend (core/validate.cc).
#pragma once

#include "core/team_state.h"
#include "tpfuse/impl/enums.h"
#include "tpfuse/impl/epilogue.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

void validate_add_rmsnorm(const AddRmsNormArgs& args, const RowEpilogueKind& epilogue,
                          const char* op);
void validate_qk_args(const QkNormArgs& args, const char* op);
// After validate_qk_args: what depends on the team (what depends on its backend's path:
// BackendOps::validate_qk).
void validate_qk_rmsnorm(const TeamState& team, const QkNormArgs& args, const char* op);
// Positions in host memory (the CPU backend) checked against [0, max_position) before any work;
// on the GPU the kernel bounds them (a token outside gets NaN outputs, Team::check says which).
void validate_positions_on_host(const QkNormArgs& args, const char* op);
Algorithm choose_qk_algorithm(const TeamState& team, const QkNormArgs& args, const char* op);

}  // namespace tpfuse::impl
