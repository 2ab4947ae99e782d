// The NCCL data type of a tpfuse dtype (the library's NCCL path and tpfuse-bench's baselines).
#pragma once

#include <nccl.h>

#include "core/error.h"
#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

inline ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
  }
  TPF_FAIL("no NCCL type for dtype " << int(dtype));
}

}  // namespace tpfuse::impl
