# The SYCL backend (docs/sycl.md): TPFUSE_SYCL (AUTO, ON or OFF) finds Intel's SYCL runtime
# (cmake/FindSyclRuntime.cmake) and builds src/sycl/ into tpfuse: the backend, the run-time kernel
# compiler (src/sycl/compiler.h) and the library's headers embedded as text, from which the SYCL
# device code is compiled when a program runs. No SYCL compiler is needed to build: the host code is
# ordinary C++ against the runtime's headers. AUTO builds it where a runtime is found; a
# machine without one builds exactly what it built before.
set(TPFUSE_SYCL "AUTO" CACHE STRING "Build the SYCL parts: ON, OFF or AUTO (if Intel's SYCL \
runtime is found: SYCL_RUNTIME_ROOT, .deps/sycl-venv from scripts/fetch-sycl.sh, oneAPI)")
set_property(CACHE TPFUSE_SYCL PROPERTY STRINGS AUTO ON OFF)

set(TPFUSE_HAVE_SYCL OFF)
string(TOUPPER "${TPFUSE_SYCL}" tpfuse_sycl_mode)
if(tpfuse_sycl_mode MATCHES "^(ON|1|YES|Y|TRUE)$")
  set(tpfuse_sycl_mode ON)
elseif(tpfuse_sycl_mode MATCHES "^(OFF|0|NO|N|FALSE)$")
  set(tpfuse_sycl_mode OFF)
elseif(NOT tpfuse_sycl_mode STREQUAL "AUTO")
  message(FATAL_ERROR "TPFUSE_SYCL must be AUTO, ON or OFF, got '${TPFUSE_SYCL}'")
endif()

if(tpfuse_sycl_mode STREQUAL "OFF")
  set(tpfuse_sycl_why "TPFUSE_SYCL=OFF")
else()
  list(APPEND CMAKE_MODULE_PATH ${CMAKE_CURRENT_LIST_DIR})
  find_package(SyclRuntime QUIET)
  if(SyclRuntime_FOUND)
    set(TPFUSE_HAVE_SYCL ON)
    set(tpfuse_sycl_why "TPFUSE_SYCL=${tpfuse_sycl_mode}: ${SyclRuntime_VERSION} in \
${SyclRuntime_ROOT}")
    if(SyclRuntime_OPENCL_CPU_LIBRARY)
      string(APPEND tpfuse_sycl_why ", with Intel's OpenCL CPU device")
    else()
      string(APPEND tpfuse_sycl_why ", without Intel's OpenCL CPU device (no libintelocl.so)")
    endif()
  elseif(tpfuse_sycl_mode STREQUAL "ON")
    find_package(SyclRuntime REQUIRED)  # fails, with what it looked for
  else()
    set(tpfuse_sycl_why "TPFUSE_SYCL=AUTO and no SYCL runtime found (scripts/fetch-sycl.sh \
installs one into .deps/sycl-venv; or -DSYCL_RUNTIME_ROOT=...)")
  endif()
endif()
message(STATUS "tpfuse: SYCL ${TPFUSE_HAVE_SYCL} (${tpfuse_sycl_why})")

# tpfuse_embed_texts(target symbol NAME=FILE ...): a generated source in `target` that defines
# `tpfuse::sycl_backend::EmbeddedTexts symbol()` (src/sycl/embedded.h) with each FILE's text under
# NAME, regenerated when a FILE changes (cmake/embed_texts.cmake writes it at build time).
function(tpfuse_embed_texts target symbol)
  set(output ${CMAKE_CURRENT_BINARY_DIR}/generated/sycl/${symbol}.cc)
  set(files)
  foreach(entry IN LISTS ARGN)
    string(FIND "${entry}" "=" split)
    math(EXPR after "${split} + 1")
    string(SUBSTRING "${entry}" ${after} -1 file)
    list(APPEND files ${file})
  endforeach()
  string(REPLACE ";" "|" entries "${ARGN}")
  add_custom_command(OUTPUT ${output}
    COMMAND ${CMAKE_COMMAND} -DOUTPUT=${output} -DSYMBOL=${symbol} "-DENTRIES=${entries}"
            -P ${PROJECT_SOURCE_DIR}/cmake/embed_texts.cmake
    DEPENDS ${files} ${PROJECT_SOURCE_DIR}/cmake/embed_texts.cmake
    COMMENT "Embedding ${symbol}" VERBATIM)
  target_sources(${target} PRIVATE ${output})
endfunction()

if(TPFUSE_HAVE_SYCL)
  # The headers device code includes, as the kernel compiler sees them: include/tpfuse's
  # under their include names, src/sycl/device's as tpfuse/sycl/<name>.
  file(GLOB tpfuse_sycl_library_headers CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}/include
    ${PROJECT_SOURCE_DIR}/include/tpfuse/*.h ${PROJECT_SOURCE_DIR}/include/tpfuse/impl/*.h
    ${PROJECT_SOURCE_DIR}/include/tpfuse/impl/*/*.h)
  set(tpfuse_sycl_embedded)
  foreach(header IN LISTS tpfuse_sycl_library_headers)
    list(APPEND tpfuse_sycl_embedded "${header}=${PROJECT_SOURCE_DIR}/include/${header}")
  endforeach()
  file(GLOB tpfuse_sycl_device_headers CONFIGURE_DEPENDS RELATIVE ${PROJECT_SOURCE_DIR}/src/sycl/device
    ${PROJECT_SOURCE_DIR}/src/sycl/device/*.h)
  foreach(header IN LISTS tpfuse_sycl_device_headers)
    list(APPEND tpfuse_sycl_embedded
      "tpfuse/sycl/${header}=${PROJECT_SOURCE_DIR}/src/sycl/device/${header}")
  endforeach()
  # The generated version header (tpfuse/version.h), for device code that wants it.
  list(APPEND tpfuse_sycl_embedded
    "tpfuse/version.h=${PROJECT_BINARY_DIR}/generated/include/tpfuse/version.h")

  # The SYCL backend is part of tpfuse (its registry line needs it): src/sycl/'s host code, the
  # kernel compiler and the embedded headers its kernels are compiled from. tpfuse_sycl is what
  # the SYCL tests link: tpfuse with the runtime and src/ on the include path.
  target_sources(tpfuse PRIVATE src/sycl/backend.cc src/sycl/compiler.cc src/sycl/team.cc
                              src/sycl/process_team.cc)
  tpfuse_embed_texts(tpfuse library_headers ${tpfuse_sycl_embedded})
  # Installed, the package's config file makes tpfuse::sycl from the runtime found again.
  target_link_libraries(tpfuse PUBLIC $<BUILD_INTERFACE:SyclRuntime::sycl>
                                      $<INSTALL_INTERFACE:tpfuse::sycl>)
  add_library(tpfuse_sycl INTERFACE)
  target_include_directories(tpfuse_sycl INTERFACE $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/src>)
  target_link_libraries(tpfuse_sycl INTERFACE tpfuse SyclRuntime::sycl)
  # Where the runtime's libraries are, for a program that runs on Intel's OpenCL CPU device: the
  # ICD loader is pointed at the CPU device's library (the wheel's .icd file names a placeholder
  # path) and <root>/lib goes on the loader path (its libOpenCL.so.1 has no RUNPATH).
  set(TPFUSE_SYCL_RUN_ENVIRONMENT "LD_LIBRARY_PATH=${SyclRuntime_LIBRARY_DIR}")
  if(SyclRuntime_OPENCL_CPU_LIBRARY)
    list(APPEND TPFUSE_SYCL_RUN_ENVIRONMENT "OCL_ICD_FILENAMES=${SyclRuntime_OPENCL_CPU_LIBRARY}")
  endif()
else()
  # Without the runtime: no SYCL backend, and its entry points say so (src/sycl/not_built.cc).
  target_sources(tpfuse PRIVATE src/sycl/not_built.cc)
endif()
