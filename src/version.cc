#include "tpfuse/version.h"

namespace tpfuse {

const char* version() {
  return TPFUSE_VERSION_STRING;
}

}  // namespace tpfuse
