# Finds the Python interpreter and the torch it has installed, and makes the
# whole build use torch's C++ ABI. Included from the top-level CMakeLists.txt
# before the core libraries when SPILLWAY_BUILD_PYTHON is ON.
#
# Sets:
#   SPILLWAY_TORCH_VERSION   torch.__version__
#   SPILLWAY_TORCH_CUDA      ON when this torch was built with CUDA
#                            (torch.version.cuda is not None)
#   kineto_LIBRARY (cache)   where this torch links kineto into libtorch_cpu
#                            (see below)

find_package(Python 3.10 REQUIRED COMPONENTS Interpreter Development.Module)

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
          "import os, torch; print(torch.utils.cmake_prefix_path); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.version.cuda or 'none'); print(torch.__version__); print(int(torch.autograd.kineto_available())); print(os.path.join(os.path.dirname(torch.__file__), 'lib'))"
  OUTPUT_VARIABLE _spillway_torch_info
  RESULT_VARIABLE _spillway_torch_rc
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _spillway_torch_rc EQUAL 0)
  message(FATAL_ERROR "spillway: SPILLWAY_BUILD_PYTHON needs torch importable by ${Python_EXECUTABLE}")
endif()
string(REPLACE "\n" ";" _spillway_torch_info "${_spillway_torch_info}")
list(GET _spillway_torch_info 0 _spillway_torch_prefix)
list(GET _spillway_torch_info 1 _spillway_torch_abi)
list(GET _spillway_torch_info 2 _spillway_torch_cuda)
list(GET _spillway_torch_info 3 SPILLWAY_TORCH_VERSION)
list(GET _spillway_torch_info 4 _spillway_torch_kineto)
list(GET _spillway_torch_info 5 _spillway_torch_lib)

list(APPEND CMAKE_PREFIX_PATH "${_spillway_torch_prefix}")
# Every translation unit, the core included, agrees with libtorch on the
# std::string / std::list layout.
add_compile_definitions(_GLIBCXX_USE_CXX11_ABI=${_spillway_torch_abi})

# torch's wheels build kineto (the profiler's tracing library) into
# libtorch_cpu, yet TorchConfig.cmake looks for a separate libkineto and warns
# "library kineto not found" on every configure when there is none. When this
# torch has kineto and no separate library, tell that lookup where kineto is:
# libtorch_cpu, which the extension links anyway. A torch without kineto, or
# with a libkineto of its own, is left to TorchConfig.cmake and its warning.
set(_spillway_torch_cpu "${_spillway_torch_lib}/${CMAKE_SHARED_LIBRARY_PREFIX}torch_cpu${CMAKE_SHARED_LIBRARY_SUFFIX}")
if(_spillway_torch_kineto AND EXISTS "${_spillway_torch_cpu}")
  find_library(_spillway_kineto kineto PATHS "${_spillway_torch_lib}" NO_DEFAULT_PATH NO_CACHE)
  # FORCE replaces a NOTFOUND left by an earlier configure, never a real path.
  if(NOT _spillway_kineto AND NOT kineto_LIBRARY)
    set(kineto_LIBRARY "${_spillway_torch_cpu}" CACHE FILEPATH
        "kineto, built into this torch's libtorch_cpu (torch_setup.cmake)" FORCE)
  endif()
endif()

if(NOT _spillway_torch_cuda STREQUAL "none")
  set(SPILLWAY_TORCH_CUDA ON)
else()
  set(SPILLWAY_TORCH_CUDA OFF)
  # The ops could not use the CUDA backend; do not link cudart for nothing.
  set(SPILLWAY_CUDA OFF)
endif()
message(STATUS "spillway: torch ${SPILLWAY_TORCH_VERSION} (CUDA: ${_spillway_torch_cuda}, "
               "_GLIBCXX_USE_CXX11_ABI=${_spillway_torch_abi})")
