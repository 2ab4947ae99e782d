# ctest's example_quickstart_cpp: examples/ built as a user builds it, a project of its own that
# finds this build's tpfuse installed into a prefix (find_package(tpfuse), tpfuse::tpfuse), and
# its quickstart run. cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DGENERATOR=... -DCXX=...
# [-DCUDA_ROOT=...] [-DNCCL_ROOT=...] -P quickstart_cpp.cmake
set(work ${BUILD_DIR}/example_quickstart_cpp)
set(prefix ${work}/install)
file(REMOVE_RECURSE ${work})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix}
                        --component development
                COMMAND_ERROR_IS_FATAL ANY)
set(hints "")
if(CUDA_ROOT)
  list(APPEND hints -DCUDAToolkit_ROOT=${CUDA_ROOT})
endif()
if(NCCL_ROOT)
  list(APPEND hints -DNCCL_ROOT=${NCCL_ROOT})
endif()
execute_process(COMMAND ${CMAKE_COMMAND} -S ${SOURCE_DIR}/examples -B ${work}/build
                        -G ${GENERATOR} -DCMAKE_CXX_COMPILER=${CXX} -DCMAKE_BUILD_TYPE=Release
                        -DCMAKE_PREFIX_PATH=${prefix} ${hints}
                COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${CMAKE_COMMAND} --build ${work}/build COMMAND_ERROR_IS_FATAL ANY)
execute_process(COMMAND ${work}/build/quickstart COMMAND_ERROR_IS_FATAL ANY)
