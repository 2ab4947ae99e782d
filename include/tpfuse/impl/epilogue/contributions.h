// The Contribution policies: what a rank adds to the sum. A row epilogue's kMoe picks one
// (RowEpilogue::Contribution, epilogue.h).
#pragma once

#include <type_traits>

#include "tpfuse/impl/epilogue/contribution_input.h"
#include "tpfuse/impl/epilogue/contribution_moe.h"

namespace tpfuse::impl {

template <bool kMoe>
using ContributionOf = std::conditional_t<kMoe, MoeContribution, InputContribution>;

}  // namespace tpfuse::impl
