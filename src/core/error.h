// Error macros: each throws tpfuse::Error with the file, line and what was expected. (A
// backend's checks of its own runtime's status codes are in its folder: src/cuda/check.h.)
#pragma once

#include <cstring>
#include <sstream>
#include <string>

#include "tpfuse/tpfuse.h"

namespace tpfuse::impl {

// The source file as a path inside the repository (src/..., include/...): a message names no
// directory of the machine the library was built on.
inline const char* repository_path(const char* file) {
  const char* best = nullptr;
  for (const char* top : {"/src/", "/include/", "/bench/", "/tests/"}) {
    for (const char* at = std::strstr(file, top); at != nullptr; at = std::strstr(at + 1, top)) {
      if (best == nullptr || at > best) best = at;
    }
  }
  return best != nullptr ? best + 1 : file;
}

// A collective call refused before it wrote anything (its team had failed): the backends tell it
// from a call that failed after it began writing (whose outputs they set to NaN).
class RefusedCall : public Error {
 public:
  using Error::Error;
};

[[noreturn]] inline void throw_error(const char* file, int line, const std::string& message) {
  std::ostringstream out;
  out << message << " (" << repository_path(file) << ":" << line << ")";
  throw Error(out.str());
}

}  // namespace tpfuse::impl

// TPF_CHECK_ARG(cond, op, "message" << streamed << values): an argument check.
#define TPF_CHECK_ARG(cond, op, stream_expr)                               \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::ostringstream tpf_message_;                                     \
      tpf_message_ << "tpfuse::" << (op) << ": " << stream_expr;           \
      ::tpfuse::impl::throw_error(__FILE__, __LINE__, tpf_message_.str()); \
    }                                                                      \
  } while (0)

#define TPF_FAIL(stream_expr)                                            \
  do {                                                                   \
    std::ostringstream tpf_message_;                                     \
    tpf_message_ << "tpfuse: " << stream_expr;                           \
    ::tpfuse::impl::throw_error(__FILE__, __LINE__, tpf_message_.str()); \
  } while (0)
