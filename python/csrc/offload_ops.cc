// The custom ops spillway::offload / reload / wait_tensor (schemas below),
// with the semantics of the runtime's residency manager:
//
//   host = spillway::offload(x)                 D2H of x after the compute stream's current point
//                                               (exact=True: a pinned block of x's size rounded
//                                               to a page, for long-lived copies; Note [Exact
//                                               blocks] in src/runtime/pinned_pool.h)
//   host = spillway::wait_tensor(host, x)       compute waits for the D2H; the runtime's
//                                               reference to x's storage is dropped
//   y    = spillway::reload(host, x.device)     y allocated on the compute stream, H2D on the copy stream
//   y    = spillway::wait_tensor(y, host)       compute waits for the H2D
//
// Kernels: offload has a CPU kernel (CPU tensors stand for device memory and
// the fake backend moves them, so CI runs the real runtime) and, when torch
// has CUDA, a CUDA kernel through the CUDA backend's copy engine. reload and
// wait_tensor take tensors of two devices (a host copy and a device tensor),
// so like PyTorch's ao:: ops they have one CompositeExplicitAutograd kernel
// that looks at the devices itself. Fake kernels, the functionalization
// kernel of wait_tensor and its side-effect mark live in spillway/ops.py
// (set_python_module below names it).
//
// Note [Ops schemas]: offload and reload return new tensors and mutate
// nothing. wait_tensor returns an alias of its first argument, declared as
// Tensor(a) -> Tensor(a), so the tensor a consumer reads is the wait's output
// and no consumer can be scheduled before the wait. It is marked as having a
// side effect so dead-code elimination keeps a wait whose output is unused.
// Releasing the source storage is not a mutation the graph can see: the
// runtime drops its own reference, never the graph's (unlike ao::wait_tensor,
// which resizes the keepalive's storage to zero).
//
// Streams: an op is ordered on the current stream of its device. As with
// PyTorch's ao:: ops, a tensor is offloaded under the stream it was allocated
// on: its storage is handed back to the caching allocator after that stream
// waited for the D2H. Tensors of zero bytes move nothing; their wait is a
// no-op.
//
// Errors: misuse raises ValueError (bad argument) or RuntimeError (a wait with
// nothing in flight, a host tensor offload did not make); an exhausted pinned
// budget raises torch.OutOfMemoryError. Messages start with "[ops] " or with
// the runtime component that refused.

#include <ATen/core/Tensor.h>
#include <ATen/ops/alias.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <sstream>
#include <string>

#include "spillway/error.h"
#include "transfer_table.h"

#ifdef SPILLWAY_TORCH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "cuda_allocator.h"
#endif

namespace spillway::python {
namespace {

std::string shape_of(const at::Tensor& t) {
  std::ostringstream out;
  out << "sizes " << t.sizes() << ", strides " << t.strides();
  return out.str();
}

// Runs `body`, turning spillway's exceptions into the matching c10 errors so
// Python sees ValueError / torch.OutOfMemoryError / RuntimeError.
template <typename Body>
auto translate_errors(Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const InvalidArgument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const OutOfMemory& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  } catch (const Error& e) {
    TORCH_CHECK(false, e.what());
  }
}

DeviceKey key_of(const c10::Device& device) {
  if (device.is_cpu()) return DeviceKey{false, 0};
  if (device.is_cuda()) {
#ifdef SPILLWAY_TORCH_CUDA
    return DeviceKey{true, device.has_index() ? device.index() : c10::cuda::current_device()};
#else
    TORCH_CHECK_VALUE(false, "[ops] ", device,
                      ": this spillway._C was built without CUDA (its torch had none, or "
                      "the CUDA backend was not built)");
#endif
  }
  TORCH_CHECK_VALUE(false, "[ops] device ", device,
                    " is not supported: spillway moves tensors of cpu or cuda devices");
  return DeviceKey{};  // unreachable: TORCH_CHECK_VALUE(false, ...) throws
}

// The stream the op is ordered on: the current CUDA stream of the device, or
// the calling thread for the CPU (the fake backend's "run now" stream).
StreamHandle compute_stream(DeviceKey device) {
#ifdef SPILLWAY_TORCH_CUDA
  if (device.cuda) {
    return StreamHandle{c10::cuda::getCurrentCUDAStream(device.index).stream()};
  }
#endif
  (void)device;
  return StreamHandle{};
}

// A release callback that holds `storage` until the runtime lets it go.
ReleaseFn hold(c10::Storage storage) {
  return [storage = std::move(storage)](void*, std::size_t, void*) mutable {
    storage = c10::Storage();
  };
}

at::Tensor offload(const at::Tensor& t, bool exact) {
  TORCH_CHECK_VALUE(t.defined(), "[ops] offload of an undefined tensor");
  TORCH_CHECK_VALUE(t.is_contiguous(), "[ops] offload of a non-contiguous tensor (",
                    shape_of(t),
                    "): the copy engine moves contiguous bytes; call .contiguous() first");
  const DeviceKey device = key_of(t.device());
  const auto host_options = t.options().device(at::kCPU).pinned_memory(false);
  if (t.nbytes() == 0) return at::empty(t.sizes(), host_options);
#ifdef SPILLWAY_TORCH_CUDA
  c10::OptionalDeviceGuard guard(device.cuda ? std::optional<c10::Device>(t.device())
                                             : std::nullopt);
#endif
  return translate_errors([&] {
    HostHandle handle = TransferTable::instance().start_offload(
        device, t.data_ptr(), t.nbytes(), hold(t.storage()), compute_stream(device),
        exact ? HostFit::kExact : HostFit::kSizeClass);
    return at::from_blob(
        handle.data, t.sizes(),
        [device](void* data) { TransferTable::instance().drop_host(device, data); },
        host_options);
  });
}

at::Tensor reload(const at::Tensor& host, c10::Device device) {
  TORCH_CHECK_VALUE(host.defined(), "[ops] reload of an undefined tensor");
  TORCH_CHECK_VALUE(host.device().is_cpu(), "[ops] reload expects the host tensor made by "
                    "spillway::offload, on cpu; got a tensor on ", host.device());
  TORCH_CHECK_VALUE(host.is_contiguous(), "[ops] reload of a non-contiguous host tensor (",
                    shape_of(host), "): spillway::offload makes contiguous copies");
  const DeviceKey key = key_of(device);
  const c10::Device target = key.cuda ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(key.index))
                                      : c10::Device(c10::kCPU);
  const auto options = host.options().device(target).pinned_memory(false);
  if (host.nbytes() == 0) return at::empty(host.sizes(), options);
#ifdef SPILLWAY_TORCH_CUDA
  c10::OptionalDeviceGuard guard(key.cuda ? std::optional<c10::Device>(target) : std::nullopt);
#endif
  // Allocated on the compute stream (the caching allocator's current stream),
  // so the model may reuse the memory in stream order once it is freed.
  at::Tensor dst = at::empty(host.sizes(), options);
  translate_errors([&] {
    TransferTable::instance().start_reload(key, host.data_ptr(), host.nbytes(), dst.data_ptr(),
                                           hold(dst.storage()), compute_stream(key));
  });
  return dst;
}

at::Tensor wait_tensor(const at::Tensor& t, const std::optional<at::Tensor>& keepalive,
                       const std::optional<at::Tensor>& last_use) {
  // keepalive and last_use only order the graph: they keep their storages
  // alive up to this point. The storages the copies use are held by the
  // runtime itself.
  (void)keepalive;
  (void)last_use;
  TORCH_CHECK_VALUE(t.defined(), "[ops] wait_tensor of an undefined tensor");
  if (t.nbytes() > 0) {
    translate_errors([&] {
      TransferTable& table = TransferTable::instance();
      const void* data = t.data_ptr();
      const DeviceKey device = table.pending_device(data);
#ifdef SPILLWAY_TORCH_CUDA
      c10::OptionalDeviceGuard guard(
          device.cuda ? std::optional<c10::Device>(c10::Device(
                            c10::kCUDA, static_cast<c10::DeviceIndex>(device.index)))
                      : std::nullopt);
#endif
      table.wait(data, compute_stream(device));
    });
  }
  // A new TensorImpl over the same storage: an operator below autograd must
  // not return its input object itself.
  return at::alias(t);
}

#ifdef SPILLWAY_TORCH_CUDA
// CUDA runtimes take device memory from PyTorch's caching allocator.
const bool kTorchAllocatorInstalled =
    (TransferTable::instance().set_cuda_allocator(&torch_cuda_allocator()), true);
#endif

}  // namespace

TORCH_LIBRARY(spillway, m) {
  m.set_python_module("spillway.ops");
  // Note [Ops schemas].
  m.def("offload(Tensor t, bool exact=False) -> Tensor", {at::Tag::needs_contiguous_strides});
  m.def("reload(Tensor host, Device device) -> Tensor", {at::Tag::needs_contiguous_strides});
  m.def("wait_tensor(Tensor(a) t, Tensor? keepalive=None, Tensor? last_use=None) -> Tensor(a)",
        {at::Tag::flexible_layout});
}

TORCH_LIBRARY_IMPL(spillway, CPU, m) { m.impl("offload", &offload); }

#ifdef SPILLWAY_TORCH_CUDA
TORCH_LIBRARY_IMPL(spillway, CUDA, m) { m.impl("offload", &offload); }
#endif

TORCH_LIBRARY_IMPL(spillway, CompositeExplicitAutograd, m) {
  m.impl("reload", &reload);
  m.impl("wait_tensor", &wait_tensor);
}

}  // namespace spillway::python
