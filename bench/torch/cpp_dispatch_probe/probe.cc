// A probe for issue 12's dispatch overhead (bench/torch/cpp_dispatch_probe/probe.py):
// can a TorchDispatchMode's ops be handled in C++, with no Python per op?
//
// The Python key's fallback hands each op to the interpreter of the mode on top
// of the mode stack: `mode->pyinterpreter()->dispatch(op, stack)`. Spillway
// cannot give its mode an interpreter of its own (torch asserts, in many
// places, that a mode's interpreter is the process's). Instead install()
// points the process's PyInterpreter at a vtable that forwards every call to
// torch's own, except dispatch: when the mode on top is the one named by
// handle(), the op runs below the Python key from C++ (counted); otherwise, and
// for every op while forward_all is set, it goes to torch's dispatch, that is
// to the mode's __torch_dispatch__, as before.
//
// Written against torch 2.13's PyInterpreterVTable (every pure virtual must be
// forwarded, so another torch may not compile it). Not part of the build.

#include <torch/extension.h>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/SafePyObject.h>
#include <c10/core/impl/PyInterpreter.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>

#include <cstdint>
#include <utility>

namespace {

using c10::impl::PyInterpreter;
using c10::impl::PyInterpreterVTable;
using c10::impl::TorchDispatchModeTLS;

PyInterpreter* interpreter = nullptr;  // the process's, once installed
PyObject* handled = nullptr;            // the mode whose ops run in C++
bool forward_all = false;
std::int64_t in_cpp = 0, forwarded = 0;

struct Forwarding final : PyInterpreterVTable {
  const PyInterpreterVTable* torch = nullptr;

  void dispatch(const c10::OperatorHandle& op, torch::jit::Stack* stack) const override {
    const auto depth = TorchDispatchModeTLS::stack_len();
    const bool ours = depth > 0 && TorchDispatchModeTLS::get_stack_at(depth - 1)->ptr(interpreter) == handled;
    if (!ours || forward_all) {
      ++forwarded;
      torch->dispatch(op, stack);
      return;
    }
    ++in_cpp;
    // What __torch_dispatch__'s func(*args) does: the op again, below the Python key.
    c10::impl::ExcludeDispatchKeyGuard below(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    op.callBoxed(stack);
  }

  std::string name() const override { return torch->name(); }
  void incref(PyObject* o) const override { torch->incref(o); }
  void decref(PyObject* o) const override { torch->decref(o); }
  bool try_incref(const c10::impl::PyObjectSlot& s) const override { return torch->try_incref(s); }
  size_t refcnt(PyObject* o) const override { return torch->refcnt(o); }
  c10::intrusive_ptr<c10::TensorImpl> detach(const c10::TensorImpl* s) const override { return torch->detach(s); }
  void reportErrorCallback(PyObject* c, c10::DispatchKey k) const override { torch->reportErrorCallback(c, k); }
  void python_op_registration_trampoline(const c10::OperatorHandle& op, c10::DispatchKey k, c10::DispatchKeySet ks,
                                         torch::jit::Stack* s, bool with_keyset, bool with_op) const override {
    torch->python_op_registration_trampoline(op, k, ks, s, with_keyset, with_op);
  }
  void throw_abstract_impl_not_imported_error(std::string n, const char* m, const char* c) const override {
    torch->throw_abstract_impl_not_imported_error(std::move(n), m, c);
  }
  void python_dispatcher(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* s) const override {
    torch->python_dispatcher(op, ks, s);
  }
  bool is_contiguous(const c10::TensorImpl* s, at::MemoryFormat f) const override { return torch->is_contiguous(s, f); }
  c10::SymBool sym_is_contiguous(const c10::TensorImpl* s, at::MemoryFormat f) const override {
    return torch->sym_is_contiguous(s, f);
  }
  bool is_strides_like(const c10::TensorImpl* s, at::MemoryFormat f) const override {
    return torch->is_strides_like(s, f);
  }
  bool is_non_overlapping_and_dense(const c10::TensorImpl* s) const override {
    return torch->is_non_overlapping_and_dense(s);
  }
  c10::Device device(const c10::TensorImpl* s) const override { return torch->device(s); }
  int64_t dim(const c10::TensorImpl* s) const override { return torch->dim(s); }
  c10::IntArrayRef strides(const c10::TensorImpl* s) const override { return torch->strides(s); }
  c10::IntArrayRef sizes(const c10::TensorImpl* s) const override { return torch->sizes(s); }
  c10::SymIntArrayRef sym_sizes(const c10::TensorImpl* s) const override { return torch->sym_sizes(s); }
  c10::Layout layout(const c10::TensorImpl* s) const override { return torch->layout(s); }
  int64_t numel(const c10::TensorImpl* s) const override { return torch->numel(s); }
  c10::SymInt sym_numel(const c10::TensorImpl* s) const override { return torch->sym_numel(s); }
  c10::SymIntArrayRef sym_strides(const c10::TensorImpl* s) const override { return torch->sym_strides(s); }
  c10::SymInt sym_storage_offset(const c10::TensorImpl* s) const override { return torch->sym_storage_offset(s); }
  void trace_gpu_event_creation(c10::DeviceType d, uintptr_t e) const override { torch->trace_gpu_event_creation(d, e); }
  void trace_gpu_event_deletion(c10::DeviceType d, uintptr_t e) const override { torch->trace_gpu_event_deletion(d, e); }
  void trace_gpu_event_record(c10::DeviceType d, uintptr_t e, uintptr_t s) const override {
    torch->trace_gpu_event_record(d, e, s);
  }
  void trace_gpu_event_wait(c10::DeviceType d, uintptr_t e, uintptr_t s) const override {
    torch->trace_gpu_event_wait(d, e, s);
  }
  void trace_gpu_memory_allocation(c10::DeviceType d, uintptr_t p) const override {
    torch->trace_gpu_memory_allocation(d, p);
  }
  void trace_gpu_memory_deallocation(c10::DeviceType d, uintptr_t p) const override {
    torch->trace_gpu_memory_deallocation(d, p);
  }
  void trace_gpu_stream_creation(c10::DeviceType d, uintptr_t s) const override { torch->trace_gpu_stream_creation(d, s); }
  void trace_gpu_device_synchronization(c10::DeviceType d) const override { torch->trace_gpu_device_synchronization(d); }
  void trace_gpu_stream_synchronization(c10::DeviceType d, uintptr_t s) const override {
    torch->trace_gpu_stream_synchronization(d, s);
  }
  void trace_gpu_event_synchronization(c10::DeviceType d, uintptr_t e) const override {
    torch->trace_gpu_event_synchronization(d, e);
  }
  void reset_backward_hooks(const c10::TensorImpl* s) const override { torch->reset_backward_hooks(s); }
};

Forwarding forwarding;

// Call with the mode to handle on top of the mode stack (entered).
void handle_top_mode() {
  const auto depth = TorchDispatchModeTLS::stack_len();
  TORCH_CHECK(depth > 0, "cpp_dispatch_probe: enter the mode first");
  const auto& top = TorchDispatchModeTLS::get_stack_at(depth - 1);
  if (interpreter == nullptr) {
    interpreter = &top->pyinterpreter();
    forwarding.torch = interpreter->vtable_;
    interpreter->vtable_ = &forwarding;
  }
  handled = top->ptr(interpreter);
}

void uninstall() {
  if (interpreter != nullptr) interpreter->vtable_ = forwarding.torch;
  interpreter = nullptr;
  handled = nullptr;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("handle_top_mode", &handle_top_mode);
  m.def("uninstall", &uninstall);
  m.def("set_forward_all", [](bool on) { forward_all = on; });
  m.def("counts", [] { return std::make_pair(in_cpp, forwarded); });
}
