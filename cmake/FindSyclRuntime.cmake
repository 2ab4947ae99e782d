# FindSyclRuntime: Intel's SYCL runtime (DPC++'s libsycl), without its compiler.
#
# tpfuse's SYCL code is host code built by the ordinary C++ compiler against the runtime's
# headers; the device code is compiled at run time by the runtime's kernel compiler
# (libsycl-jit, the sycl_ext_oneapi_kernel_compiler extension). So a runtime is enough: PyPI's
# intel-sycl-rt wheel (scripts/fetch-sycl.sh puts it in .deps/sycl-venv), a oneAPI install, or
# an open-source DPC++ build.
#
# Looked for, first found wins (each a root with include/sycl/sycl.hpp and lib/libsycl.so):
#   SYCL_RUNTIME_ROOT (CMake or environment variable): there and nowhere else;
#   <source>/.deps/sycl-venv (scripts/fetch-sycl.sh), the active virtual or conda environment
#   ($VIRTUAL_ENV, $CONDA_PREFIX), $CMPLR_ROOT, $ONEAPI_ROOT/compiler/latest,
#   /opt/intel/oneapi/compiler/latest.
# No system directory is searched: a sycl/sycl.hpp there may be another implementation's
# (AdaptiveCpp), which has no kernel compiler.
#
# Defines:
#   SyclRuntime_FOUND, SyclRuntime_ROOT, SyclRuntime_INCLUDE_DIR, SyclRuntime_LIBRARY,
#   SyclRuntime_LIBRARY_DIR, SyclRuntime_JIT_LIBRARY (libsycl-jit: required, it is the kernel
#   compiler), SyclRuntime_OPENCL_CPU_LIBRARY (libintelocl.so, Intel's OpenCL CPU device, if the
#   root has it), SyclRuntime_VERSION (the package's version where a wheel's metadata says it,
#   else libsycl's major.minor.patch), SyclRuntime_COMPILER_VERSION (__SYCL_COMPILER_VERSION)
#   and the imported target SyclRuntime::sycl (headers, libsycl, and
#   SYCL_DISABLE_FSYCL_SYCLHPP_WARNING: sycl.hpp warns when a compiler without -fsycl includes it,
#   which is exactly how tpfuse uses it).

set(_sycl_roots)
if(DEFINED SYCL_RUNTIME_ROOT AND NOT SYCL_RUNTIME_ROOT STREQUAL "")
  list(APPEND _sycl_roots "${SYCL_RUNTIME_ROOT}")
elseif(DEFINED ENV{SYCL_RUNTIME_ROOT} AND NOT "$ENV{SYCL_RUNTIME_ROOT}" STREQUAL "")
  list(APPEND _sycl_roots "$ENV{SYCL_RUNTIME_ROOT}")
else()
  list(APPEND _sycl_roots "${PROJECT_SOURCE_DIR}/.deps/sycl-venv")
  foreach(_sycl_variable VIRTUAL_ENV CONDA_PREFIX CMPLR_ROOT)
    if(DEFINED ENV{${_sycl_variable}} AND NOT "$ENV{${_sycl_variable}}" STREQUAL "")
      list(APPEND _sycl_roots "$ENV{${_sycl_variable}}")
    endif()
  endforeach()
  if(DEFINED ENV{ONEAPI_ROOT} AND NOT "$ENV{ONEAPI_ROOT}" STREQUAL "")
    list(APPEND _sycl_roots "$ENV{ONEAPI_ROOT}/compiler/latest")
  endif()
  list(APPEND _sycl_roots /opt/intel/oneapi/compiler/latest)
endif()

# The first root that has both the headers and the library (a root with one but not the other is
# not mixed with another root's).
set(_sycl_seen "")
foreach(_sycl_root IN LISTS _sycl_roots)
  if(EXISTS "${_sycl_root}/include/sycl/sycl.hpp")
    foreach(_sycl_libdir lib lib64)
      if(EXISTS "${_sycl_root}/${_sycl_libdir}/libsycl.so")
        get_filename_component(SyclRuntime_ROOT "${_sycl_root}" REALPATH)
        set(SyclRuntime_INCLUDE_DIR "${SyclRuntime_ROOT}/include")
        set(SyclRuntime_LIBRARY_DIR "${SyclRuntime_ROOT}/${_sycl_libdir}")
        set(SyclRuntime_LIBRARY "${SyclRuntime_LIBRARY_DIR}/libsycl.so")
        break()
      endif()
    endforeach()
    if(SyclRuntime_ROOT)
      break()
    endif()
    string(APPEND _sycl_seen " ${_sycl_root} has include/sycl/sycl.hpp but no lib/libsycl.so.")
  endif()
endforeach()

if(SyclRuntime_ROOT)
  if(EXISTS "${SyclRuntime_LIBRARY_DIR}/libsycl-jit.so")
    set(SyclRuntime_JIT_LIBRARY "${SyclRuntime_LIBRARY_DIR}/libsycl-jit.so")
  endif()
  if(EXISTS "${SyclRuntime_LIBRARY_DIR}/libintelocl.so")
    set(SyclRuntime_OPENCL_CPU_LIBRARY "${SyclRuntime_LIBRARY_DIR}/libintelocl.so")
  endif()
  set(SyclRuntime_COMPILER_VERSION "")
  if(EXISTS "${SyclRuntime_INCLUDE_DIR}/sycl/version.hpp")
    file(STRINGS "${SyclRuntime_INCLUDE_DIR}/sycl/version.hpp" _sycl_version_lines
      REGEX "#define (__SYCL_COMPILER_VERSION|__LIBSYCL_(MAJOR|MINOR|PATCH)_VERSION) ")
    foreach(_sycl_line IN LISTS _sycl_version_lines)
      if(_sycl_line MATCHES "#define ([A-Z_]+) ([0-9]+)")
        set(_sycl_${CMAKE_MATCH_1} ${CMAKE_MATCH_2})
      endif()
    endforeach()
    if(DEFINED _sycl___SYCL_COMPILER_VERSION)
      set(SyclRuntime_COMPILER_VERSION ${_sycl___SYCL_COMPILER_VERSION})
    endif()
    if(DEFINED _sycl___LIBSYCL_MAJOR_VERSION)
      set(SyclRuntime_VERSION "libsycl ${_sycl___LIBSYCL_MAJOR_VERSION}.\
${_sycl___LIBSYCL_MINOR_VERSION}.${_sycl___LIBSYCL_PATCH_VERSION}")
    endif()
  endif()
  # A pip environment says which wheel it holds.
  file(GLOB _sycl_wheel_metadata LIST_DIRECTORIES true
    "${SyclRuntime_ROOT}/lib/python*/site-packages/intel_sycl_rt-*.dist-info")
  if(_sycl_wheel_metadata)
    list(GET _sycl_wheel_metadata 0 _sycl_wheel_metadata)
    if(_sycl_wheel_metadata MATCHES "intel_sycl_rt-([^/]+)\\.dist-info$")
      set(SyclRuntime_VERSION "intel-sycl-rt ${CMAKE_MATCH_1}")
    endif()
  endif()
endif()

string(REPLACE ";" ", " _sycl_looked "${_sycl_roots}")
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(SyclRuntime
  REQUIRED_VARS SyclRuntime_ROOT SyclRuntime_INCLUDE_DIR SyclRuntime_LIBRARY
                SyclRuntime_JIT_LIBRARY
  REASON_FAILURE_MESSAGE "looked in ${_sycl_looked}.${_sycl_seen} A root needs \
include/sycl/sycl.hpp, lib/libsycl.so and lib/libsycl-jit.so (the kernel compiler): \
scripts/fetch-sycl.sh installs one from PyPI")

if(SyclRuntime_FOUND AND NOT TARGET SyclRuntime::sycl)
  add_library(SyclRuntime::sycl SHARED IMPORTED)
  set_target_properties(SyclRuntime::sycl PROPERTIES
    IMPORTED_LOCATION "${SyclRuntime_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${SyclRuntime_INCLUDE_DIR}"
    INTERFACE_COMPILE_DEFINITIONS SYCL_DISABLE_FSYCL_SYCLHPP_WARNING)
endif()
mark_as_advanced(SyclRuntime_INCLUDE_DIR SyclRuntime_LIBRARY)
