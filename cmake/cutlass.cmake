# cutlass.cmake: finds the CUTLASS 4.2 C++ headers for the fused FP8 QKV GEMM (src/cuda/fused_qkv_*).
#
# Sets QKVFUSE_HAS_CUTLASS and QKVFUSE_CUTLASS_INCLUDE (the folder holding cute/ and cutlass/).
# Looks, in order, at
#   1. QKVFUSE_CUTLASS_INCLUDE_DIR as given (-D...), which must then be usable;
#   2. .deps/cutlass-4.2.0/include, where scripts/fetch_cutlass.sh unpacks the pinned wheel;
#   3. the Python package cutlass_library of `pip install --no-deps nvidia-cutlass==4.2.0.0`
#      (its headers are under cutlass_library/source/include).
# Only CUTLASS 4.2.x is accepted (cutlass/version.h): the kernels are written against its
# collective and kernel interfaces, which change between minor versions. Without it the library
# builds without the fused GEMM, whose entry points then throw.
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

set(QKVFUSE_HAS_CUTLASS OFF)
set(_qkvfuse_cutlass_candidates "")
set(_qkvfuse_cutlass_explicit OFF)
if(QKVFUSE_CUTLASS_INCLUDE_DIR)
  set(_qkvfuse_cutlass_explicit ON)
  list(APPEND _qkvfuse_cutlass_candidates "${QKVFUSE_CUTLASS_INCLUDE_DIR}")
else()
  list(APPEND _qkvfuse_cutlass_candidates "${PROJECT_SOURCE_DIR}/.deps/cutlass-4.2.0/include")
  find_package(Python3 QUIET COMPONENTS Interpreter)
  if(Python3_Interpreter_FOUND)
    execute_process(
      COMMAND "${Python3_EXECUTABLE}" -c
              "import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
      OUTPUT_VARIABLE _qkvfuse_cutlass_python_dir
      OUTPUT_STRIP_TRAILING_WHITESPACE
      RESULT_VARIABLE _qkvfuse_cutlass_python_rc
      ERROR_QUIET)
    if(_qkvfuse_cutlass_python_rc EQUAL 0 AND _qkvfuse_cutlass_python_dir)
      list(APPEND _qkvfuse_cutlass_candidates "${_qkvfuse_cutlass_python_dir}")
    endif()
  endif()
endif()

foreach(dir IN LISTS _qkvfuse_cutlass_candidates)
  qkvfuse_cutlass_version("${dir}" version)
  if(version MATCHES "^4\\.2\\.")
    set(QKVFUSE_HAS_CUTLASS ON)
    set(QKVFUSE_CUTLASS_INCLUDE "${dir}")
    message(STATUS "qkvfuse: CUTLASS ${version} headers at ${dir}: building the fused FP8 QKV GEMM")
    break()
  elseif(version)
    message(WARNING "qkvfuse: CUTLASS ${version} at ${dir} is not ${QKVFUSE_CUTLASS_VERSION_REQUIRED}.x; "
                    "ignored (scripts/fetch_cutlass.sh fetches the pinned 4.2.0 headers)")
  endif()
endforeach()

if(NOT QKVFUSE_HAS_CUTLASS)
  if(_qkvfuse_cutlass_explicit)
    message(FATAL_ERROR "qkvfuse: QKVFUSE_CUTLASS_INCLUDE_DIR=${QKVFUSE_CUTLASS_INCLUDE_DIR} holds no "
                        "CUTLASS ${QKVFUSE_CUTLASS_VERSION_REQUIRED}.x headers (cute/tensor.hpp, cutlass/version.h)")
  endif()
  message(STATUS "qkvfuse: CUTLASS ${QKVFUSE_CUTLASS_VERSION_REQUIRED} headers not found "
                 "(run scripts/fetch_cutlass.sh): building without the fused FP8 QKV GEMM")
endif()
