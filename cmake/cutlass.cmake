# cutlass.cmake: finds the CUTLASS 4.2 C++ headers for the fused FP8 QKV GEMM (src/cuda/fused_qkv_*).
#
# Sets QKVFUSE_CUTLASS_INCLUDE to the folder holding cute/ and cutlass/, or to "" when there is
# none. Looks at
#   1. QKVFUSE_CUTLASS_INCLUDE_DIR as given (-D...), which must then be usable;
#   2. otherwise .deps/cutlass-4.2.0/include, where scripts/fetch_cutlass.sh unpacks the headers
#      of PyPI's pinned nvidia-cutlass==4.2.0.0 wheel (git-ignored; nothing fetches it at
#      configure time, so a fresh checkout builds without the fused GEMM).
# Only CUTLASS 4.2.x is accepted (cutlass:include/cutlass/version.h): the kernels are written against its
# collective and kernel interfaces, which change between minor versions. Whether the fused GEMM
# is built is QKVFUSE_ENABLE_CUTLASS's decision (CMakeLists.txt): AUTO, the default, builds it
# exactly when this finds the headers.
set(QKVFUSE_CUTLASS_VERSION_REQUIRED "4.2")

function(qkvfuse_cutlass_version dir out)
  set(${out} "" PARENT_SCOPE)
  if(NOT EXISTS "${dir}/cutlass/version.h" OR NOT EXISTS "${dir}/cute/tensor.hpp")
    return()
  endif()
  file(STRINGS "${dir}/cutlass/version.h" lines REGEX "^#define CUTLASS_(MAJOR|MINOR|PATCH) ")
  set(major "")
  set(minor "")
  set(patch "")
  foreach(line IN LISTS lines)
    if(line MATCHES "CUTLASS_MAJOR ([0-9]+)")
      set(major ${CMAKE_MATCH_1})
    elseif(line MATCHES "CUTLASS_MINOR ([0-9]+)")
      set(minor ${CMAKE_MATCH_1})
    elseif(line MATCHES "CUTLASS_PATCH ([0-9]+)")
      set(patch ${CMAKE_MATCH_1})
    endif()
  endforeach()
  set(${out} "${major}.${minor}.${patch}" PARENT_SCOPE)
endfunction()

set(QKVFUSE_CUTLASS_INCLUDE "")
if(QKVFUSE_CUTLASS_INCLUDE_DIR)
  set(_qkvfuse_cutlass_dir "${QKVFUSE_CUTLASS_INCLUDE_DIR}")
else()
  set(_qkvfuse_cutlass_dir "${PROJECT_SOURCE_DIR}/.deps/cutlass-4.2.0/include")
endif()
qkvfuse_cutlass_version("${_qkvfuse_cutlass_dir}" _qkvfuse_cutlass_version)
if(_qkvfuse_cutlass_version MATCHES "^4\\.2\\.")
  set(QKVFUSE_CUTLASS_INCLUDE "${_qkvfuse_cutlass_dir}")
elseif(QKVFUSE_CUTLASS_INCLUDE_DIR)
  message(FATAL_ERROR "qkvfuse: QKVFUSE_CUTLASS_INCLUDE_DIR=${QKVFUSE_CUTLASS_INCLUDE_DIR} holds no "
                      "CUTLASS ${QKVFUSE_CUTLASS_VERSION_REQUIRED}.x headers (expected "
                      "${_qkvfuse_cutlass_dir}/cute/tensor.hpp and "
                      "${_qkvfuse_cutlass_dir}/cutlass/version.h of version "
                      "${QKVFUSE_CUTLASS_VERSION_REQUIRED}.x; found version "
                      "'${_qkvfuse_cutlass_version}')")
elseif(_qkvfuse_cutlass_version)
  message(WARNING "qkvfuse: CUTLASS ${_qkvfuse_cutlass_version} at ${_qkvfuse_cutlass_dir} is not "
                  "${QKVFUSE_CUTLASS_VERSION_REQUIRED}.x; ignored (scripts/fetch_cutlass.sh fetches "
                  "the pinned 4.2.0 headers)")
endif()
