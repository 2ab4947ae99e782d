// Texts embedded into the library at build time (cmake/embed_texts.cmake): the headers that SYCL
// device code includes, compiled when a program runs (src/sycl/compiler.h).
#pragma once

#include <cstddef>

namespace tpfuse::sycl_backend {

struct EmbeddedText {
  const char* name;  // the include name: "tpfuse/impl/lamport.h"
  const char* text;
  size_t size;
};

struct EmbeddedTexts {
  const EmbeddedText* first;
  size_t count;
  const EmbeddedText* begin() const { return first; }
  const EmbeddedText* end() const { return first + count; }
};

// include/tpfuse/*.h, include/tpfuse/impl/*.h and include/tpfuse/impl/*/*.h under their include
// names, src/sycl/device/*.h as tpfuse/sycl/<name>, and the generated tpfuse/version.h.
EmbeddedTexts library_headers();

}  // namespace tpfuse::sycl_backend
