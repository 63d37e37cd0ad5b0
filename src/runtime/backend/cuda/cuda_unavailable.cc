// Built instead of cuda_backend.cc when the CUDA backend is off.

#include "runtime/backend/backend.h"
#include "spillway/error.h"

namespace spillway::runtime {

std::unique_ptr<Backend> make_cuda_backend(int) {
  throw InvalidArgument("runtime",
                        "backend 'cuda' requested but this build has no CUDA backend "
                        "(configure with SPILLWAY_CUDA=ON)");
}

bool cuda_backend_built() { return false; }

}  // namespace spillway::runtime
