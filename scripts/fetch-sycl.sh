#!/usr/bin/env bash
# Installs Intel's SYCL runtime from PyPI into a virtual environment (no compiler: kernels are
# compiled at run time by the runtime's kernel compiler, libsycl-jit), then prints the variables
# that make Intel's OpenCL CPU device visible. About 460 MB to download, 1.5 GB installed.
#
#   scripts/fetch-sycl.sh [ENV_DIR]      (default: .deps/sycl-venv, or $TPFUSE_SYCL_VENV)
#
# CMake finds the result without help when it is .deps/sycl-venv; elsewhere pass
# -DSYCL_RUNTIME_ROOT=ENV_DIR. Re-running it is cheap: an environment that already has these
# versions is left alone.
set -euo pipefail
cd "$(dirname "$0")/.."
env_dir="${1:-${TPFUSE_SYCL_VENV:-.deps/sycl-venv}}"
sycl_version="2026.2.0"
packages=("intel-sycl-rt==${sycl_version}" "intel-opencl-rt==${sycl_version}")
python="${PYTHON:-python3}"

if [ ! -x "${env_dir}/bin/python" ]; then
  echo "fetch-sycl: creating ${env_dir}"
  "${python}" -m venv "${env_dir}"
fi
env_dir="$(cd "${env_dir}" && pwd)"
installed() {
  "${env_dir}/bin/python" -m pip show intel-sycl-rt intel-opencl-rt 2>/dev/null |
    grep -c "^Version: ${sycl_version}$" || true
}
if [ "$(installed)" = "2" ] && [ -f "${env_dir}/include/sycl/sycl.hpp" ]; then
  echo "fetch-sycl: ${packages[*]} already in ${env_dir}"
else
  echo "fetch-sycl: installing ${packages[*]} into ${env_dir} (about 460 MB)"
  "${env_dir}/bin/python" -m pip install --disable-pip-version-check --no-input "${packages[@]}"
fi

# The wheels put headers in <env>/include and libraries in <env>/lib (not site-packages).
for file in include/sycl/sycl.hpp lib/libsycl.so lib/libintelocl.so; do
  if [ ! -e "${env_dir}/${file}" ]; then
    echo "fetch-sycl: ${env_dir}/${file} is missing after the install" >&2
    exit 1
  fi
done
# The wheel's OpenCL ICD file names a placeholder path, so the loader is pointed at the CPU
# device's library directly; <env>/lib/libOpenCL.so.1 has no RUNPATH, hence LD_LIBRARY_PATH.
cat <<MSG
fetch-sycl: ready ($(du -sh "${env_dir}" | cut -f1) in ${env_dir})
To run SYCL programs on Intel's OpenCL CPU device:
  export OCL_ICD_FILENAMES=${env_dir}/lib/libintelocl.so
  export LD_LIBRARY_PATH=${env_dir}/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
MSG
if [ "${env_dir}" = "$(pwd)/.deps/sycl-venv" ]; then
  echo "CMake (TPFUSE_SYCL=AUTO) finds it there without help."
else
  echo "To build tpfuse's SYCL parts: cmake -DSYCL_RUNTIME_ROOT=${env_dir} ..."
fi
