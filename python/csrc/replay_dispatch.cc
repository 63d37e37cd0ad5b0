// spillway._C.ReplayDispatch: the replay's quiet ops, run in C++ (Note [Replay
// dispatch in C++]). spillway/trace/_replay.py owns the plan and every action it
// takes; this file runs only the ops at which the plan does nothing, and keeps the
// step's storage numbering, which both sides share.

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/SafePyObject.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/PyInterpreter.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <pybind11/stl.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#ifdef SPILLWAY_TORCH_CUDA
#include <cuda_runtime_api.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bindings.h"

// Note [Replay dispatch in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The replay is a TorchDispatchMode: torch hands every op of a step to its Python
// __torch_dispatch__. Most ops of a step need nothing from the plan (T3: 5 of 6)
// but its checks: the op is the trace's next, its inputs are on the device, its
// storages take the trace's numbers. In Python the checks and torch's mode
// machinery cost 13 us an op on the CI machine's CPU, and an empty plan doubled
// T3's step on the H200's host (bench/results/2026-12-04-t3-h200-host.md).
//
// Torch sends an op under a mode to the mode's interpreter: the Python key's
// fallback calls PyInterpreter::vtable_->dispatch(op, stack), every key above
// Python (autograd, autocast) excluded. install() points the process's
// PyInterpreter at a copy of torch's vtable whose `dispatch` entry is
// hooked_dispatch(); every other entry is torch's own. The hook runs an op in C++
// when the replay is the only mode on the stack and the op is quiet (below);
// otherwise it calls torch's dispatch, and the op reaches __torch_dispatch__ as
// before. A quiet op runs as __torch_dispatch__'s func(*args) would: the same
// operator called boxed below the Python key, so the same kernels and the same bits.
//
// An op is quiet when, under mu_:
//   1. the step follows the trace, outside opaque regions and memory watching
//      (Python sets `enabled`), and no poll is due: no storage died and no host
//      update finished since Python last looked (Python's queues, mirrored here
//      as a count), and no write-back Python waits for has landed (the events of
//      the first one leaving on the D2H stream and of those on other streams,
//      queried here; where Python knows none, as on a CPU device, any storage
//      leaving sends the op to Python);
//   2. the plan does nothing before or after op k, and no output of op k in the
//      trace is a moved storage (Python binds those to their host copies);
//   3. the operator is the trace's op k;
//   4. no input storage is away, and numbering a new input storage does not reach
//      a moved storage's number.
// After the op its outputs are numbered. If they are the trace's (numbers and
// sizes), k advances; if not, they go unnumbered to Python (on_mismatch), which
// says how the step diverged and numbers them.
//
// Torch versions: only the entry's position comes from the installed headers (the
// Itanium C++ ABI's pointer to a virtual member holds it), so the hook needs no
// list of the other entries, which change between versions. The copy takes
// kSlots entries, more than any version has (2.13: 40), and dladdr() checks that
// they lie inside one loaded library; torch's vtable object holds nothing but its
// vtable pointer, and kObjectWords of it are copied all the same. Where any of
// this cannot hold (another C++ ABI) available() says why, and the replay stays
// in Python.

namespace py = pybind11;

namespace spillway::python {
namespace {

using c10::impl::PyInterpreter;
using c10::impl::PyInterpreterVTable;
using c10::impl::TorchDispatchModeTLS;

constexpr std::size_t kSlots = 128;
constexpr std::size_t kObjectWords = 8;

// What one trace output of op k must be: its sizes and its storage number.
struct ExpectedOutput {
  std::vector<std::int64_t> sizes;
  std::int64_t storage;
};

// One numbered storage: its number, and a weak reference that keeps its address
// from being reused while the entry lives (a new storage at the address would
// otherwise take the dead one's number).
struct Numbered {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::int64_t sid;
};

// The Python name of an operator, as str(OpOverload) spells it: aten.mm.default.
std::string python_name(const c10::OperatorName& name) {
  std::string out = name.name;
  if (const auto colons = out.find("::"); colons != std::string::npos) out.replace(colons, 2, ".");
  out += '.';
  out += name.overload_name.empty() ? "default" : name.overload_name;
  return out;
}

// Whether __torch_dispatch__ sees `value` as a tensor: defined, and not a Python
// number the dispatcher wrapped (torch hands those to Python as numbers again).
bool seen_as_tensor(const c10::IValue& value) {
  if (!value.isTensor()) return false;
  const auto& tensor = value.toTensor();
  return tensor.defined() && !tensor.unsafeGetTensorImpl()->is_wrapped_number();
}

// Calls visit(tensor) for each tensor __torch_dispatch__ would see among
// `values`, in order, lists element by element (as the recorder walks args);
// stops at the first false.
template <typename Visit>
bool for_each_tensor(c10::ArrayRef<c10::IValue> values, Visit&& visit) {
  for (const auto& value : values) {
    if (value.isTensor()) {
      if (seen_as_tensor(value) && !visit(value.toTensor())) return false;
    } else if (value.isList()) {
      for (const auto& element : value.toListRef()) {
        if (seen_as_tensor(element) && !visit(element.toTensor())) return false;
      }
    }
  }
  return true;
}

class ReplayDispatch;

// The process's interpreter and the hooked copy of its vtable (Note [Replay
// dispatch in C++]). Written under the GIL by install_hook/uninstall_hook.
struct Hook {
  PyInterpreter* interpreter = nullptr;
  const PyInterpreterVTable* torch = nullptr;  // torch's own vtable object
  alignas(16) std::array<void*, kSlots + 2> table{};  // offset-to-top, typeinfo, entries
  alignas(16) std::array<void*, kObjectWords> object{};
  std::atomic<ReplayDispatch*> replay{nullptr};
};
Hook hook;

class ReplayDispatch {
 public:
  ReplayDispatch() = default;
  ReplayDispatch(const ReplayDispatch&) = delete;
  ReplayDispatch& operator=(const ReplayDispatch&) = delete;
  // A replay dropped while installed (entered and never left) takes the hook with it.
  ~ReplayDispatch() {
    ReplayDispatch* self = this;
    if (hook.replay.compare_exchange_strong(self, nullptr)) uninstall_hook();
  }

  // The plan, per op k of the trace: its target, whether C++ may run it, and its
  // outputs; the storages the plan moves. The numbering and k are left as they are.
  void load(const std::vector<std::string>& targets, const std::vector<bool>& quiet,
            const std::vector<std::vector<std::pair<std::vector<std::int64_t>, std::int64_t>>>& outputs,
            const std::vector<std::int64_t>& moved) {
    if (quiet.size() != targets.size() || outputs.size() != targets.size())
      throw py::value_error("[replay] ReplayDispatch.load: targets, quiet and outputs differ in length");
    std::lock_guard lock(mu_);
    target_.clear();
    for (const auto& name : targets) target_.push_back(target_ids_.try_emplace(name, target_ids_.size()).first->second);
    quiet_.assign(quiet.begin(), quiet.end());
    outputs_.clear();
    for (const auto& op_outputs : outputs) {
      auto& expected = outputs_.emplace_back();
      for (const auto& [sizes, sid] : op_outputs) expected.push_back(ExpectedOutput{sizes, sid});
    }
    issued_ns_.assign(targets.size(), -1);
    moved_.clear();
    for (const auto sid : moved) {
      if (sid < 0) continue;
      if (static_cast<std::size_t>(sid) >= moved_.size()) moved_.resize(sid + 1, false);
      moved_[sid] = true;
    }
    op_ids_.clear();  // an operator unknown to the last plan may be in this one
  }

  std::int64_t k() const {
    std::lock_guard lock(mu_);
    return k_;
  }
  // Python's op k is issued when it sets k + 1 (its ops count one by one); k = 0
  // starts a step.
  void set_k(std::int64_t k) {
    std::lock_guard lock(mu_);
    if (k == 0) {
      step_began_ns_ = now_ns();
      std::fill(issued_ns_.begin(), issued_ns_.end(), -1);
    } else if (k == k_ + 1) {
      mark_issued(k_);
    }
    k_ = k;
  }

  // Per op of the step under way (or the last), ms from the op before it (op 0: from
  // the step's start) until it was issued, that is launched and returned: the host's
  // time on the op, the program's own work before it included. None for an op not
  // reached, or reached out of turn.
  std::vector<std::optional<double>> host_times_ms() const {
    std::lock_guard lock(mu_);
    std::vector<std::optional<double>> out(issued_ns_.size());
    std::int64_t before = step_began_ns_;
    for (std::size_t k = 0; k < issued_ns_.size(); ++k) {
      const std::int64_t at = issued_ns_[k];
      if (at >= 0 && before >= 0 && at >= before) out[k] = static_cast<double>(at - before) / 1e6;
      before = at;
    }
    return out;
  }
  void set_enabled(bool on) {
    std::lock_guard lock(mu_);
    enabled_ = on;
  }
  // Whether storages are leaving, and the CUDA events (cudaEvent_t) of the write-
  // backs whose landing gives Python's poll work; the caller keeps them alive until
  // the next call.
  void set_leaving(bool leaving, std::vector<std::uintptr_t> events) {
    std::lock_guard lock(mu_);
    leaving_ = leaving;
    leaving_events_ = std::move(events);
  }
  // Python queued work for its next poll (any thread; no lock: a weakref callback
  // may run while a hook holds mu_ on this thread), and took `n` items off.
  void note_pending() { pending_.fetch_add(1, std::memory_order_acq_rel); }
  void settle_pending(std::int64_t n) { pending_.fetch_sub(n, std::memory_order_acq_rel); }

  void away_add(std::uintptr_t key) {
    std::lock_guard lock(mu_);
    away_.insert(reinterpret_cast<const c10::StorageImpl*>(key));
  }
  void away_remove(std::uintptr_t key) {
    std::lock_guard lock(mu_);
    away_.erase(reinterpret_cast<const c10::StorageImpl*>(key));
  }
  void away_clear() {
    std::lock_guard lock(mu_);
    away_.clear();
  }

  // The tensor's storage number in this step, numbering it if new: (sid, new), or
  // (-1, false) for a tensor without storage.
  std::pair<std::int64_t, bool> number(py::handle tensor) {
    if (!THPVariable_Check(tensor.ptr())) throw py::type_error("[replay] number: expected a tensor");
    const at::Tensor& t = THPVariable_Unpack(tensor.ptr());
    if (!t.has_storage()) return {-1, false};
    std::lock_guard lock(mu_);
    const auto* key = t.storage().unsafeGetStorageImpl();
    if (const auto it = numbers_.find(key); it != numbers_.end()) return {it->second.sid, false};
    const auto sid = next_sid_++;
    numbers_.emplace(key, Numbered{t.storage().getWeakStorageImpl(), sid});
    return {sid, true};
  }

  void reset_numbering() {
    std::lock_guard lock(mu_);
    numbers_.clear();
    next_sid_ = 0;
  }

  std::int64_t quiet_ops() const {
    std::lock_guard lock(mu_);
    return quiet_ops_;
  }

  // From now on the hook runs this replay's quiet ops while `mode` is the only mode
  // on the stack; on_mismatch(k, outputs) gets a quiet op's outputs unlike the trace's.
  void install(py::object mode, py::object on_mismatch) {
    std::string why;
    if (!install_hook(&why)) throw std::runtime_error("[replay] C++ dispatch unavailable: " + why);
    {
      std::lock_guard lock(mu_);
      mode_ = mode.ptr();
    }
    on_mismatch_ = std::move(on_mismatch);
    ReplayDispatch* expected = nullptr;
    if (!hook.replay.compare_exchange_strong(expected, this) && expected != this)
      throw std::runtime_error("[replay] another replay's dispatch is installed");
  }

  void uninstall() {
    ReplayDispatch* self = this;
    hook.replay.compare_exchange_strong(self, nullptr);
    {
      std::lock_guard lock(mu_);
      mode_ = nullptr;
    }
    on_mismatch_ = py::none();
    if (hook.replay.load() == nullptr) uninstall_hook();
  }

  // The hook's body: true when this ran the op (its outputs are on the stack).
  bool run(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    if (TorchDispatchModeTLS::stack_len() != 1) return false;
    const auto& schema = op.schema();
    std::int64_t k = 0;
    {
      std::lock_guard lock(mu_);
      if (!enabled_ || pending_.load(std::memory_order_acquire) != 0 || mode_ == nullptr || poll_due()) return false;
      if (TorchDispatchModeTLS::get_stack_at(0)->ptr(hook.interpreter) != mode_) return false;
      k = k_;
      if (k < 0 || static_cast<std::size_t>(k) >= quiet_.size() || !quiet_[k] || op_id(op) != target_[k])
        return false;
      fresh_.clear();
      const bool quiet_inputs =
          for_each_tensor(torch::jit::last(*stack, schema.arguments().size()), [&](const at::Tensor& t) {
            if (!t.has_storage()) return true;
            const auto* key = t.storage().unsafeGetStorageImpl();
            if (away_.count(key) != 0) return false;
            return number_ahead(t) >= 0;
          });
      if (!quiet_inputs) return false;
      commit_fresh();
    }
    {
      c10::impl::ExcludeDispatchKeyGuard below_python(
          c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
      op.callBoxed(stack);
    }
    const auto returned = torch::jit::last(*stack, schema.returns().size());
    {
      std::lock_guard lock(mu_);
      if (k_ == k && enabled_ && outputs_match(k, returned)) {
        commit_fresh();
        mark_issued(k);
        k_ = k + 1;
        ++quiet_ops_;
        return true;
      }
    }
    report_mismatch(k, returned);
    return true;
  }

 private:
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  void mark_issued(std::int64_t k) {
    if (k >= 0 && static_cast<std::size_t>(k) < issued_ns_.size()) issued_ns_[k] = now_ns();
  }

  // Whether a write-back Python waits for has landed (see set_leaving). The events
  // are queried under mu_, which set_leaving takes before the caller lets them go; a
  // query does not block.
  bool poll_due() const {
    if (!leaving_) return false;
    if (leaving_events_.empty()) return true;
#ifdef SPILLWAY_TORCH_CUDA
    for (const auto event : leaving_events_) {
      const cudaError_t status = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
      if (status == cudaErrorNotReady) {
        (void)cudaGetLastError();  // not an error: clears it, as torch's CUDAEvent::query does
        continue;
      }
      return true;  // landed, or an error Python's own query reports
    }
    return false;
#else
    return true;
#endif
  }

  // Operator -> the id of its Python name among the plan's targets (-1: none).
  int op_id(const c10::OperatorHandle& op) {
    const auto* key = &op.operator_name();
    if (const auto it = op_ids_.find(key); it != op_ids_.end()) return it->second;
    const auto target = target_ids_.find(python_name(op.operator_name()));
    const int id = target == target_ids_.end() ? -1 : target->second;
    op_ids_.emplace(key, id);
    return id;
  }

  // The number t's storage has, or would take were it numbered now after those
  // this op numbered already (fresh_); -1 where that is a moved storage's number.
  std::int64_t number_ahead(const at::Tensor& t) {
    const auto* key = t.storage().unsafeGetStorageImpl();
    if (const auto it = numbers_.find(key); it != numbers_.end()) return it->second.sid;
    for (const auto& fresh : fresh_)
      if (fresh.key == key) return fresh.sid;
    const auto sid = next_sid_ + static_cast<std::int64_t>(fresh_.size());
    if (static_cast<std::size_t>(sid) < moved_.size() && moved_[sid]) return -1;
    fresh_.push_back(Fresh{key, t.storage().getWeakStorageImpl(), sid});
    return sid;
  }

  void commit_fresh() {
    for (auto& fresh : fresh_) numbers_.emplace(fresh.key, Numbered{std::move(fresh.storage), fresh.sid});
    next_sid_ += static_cast<std::int64_t>(fresh_.size());
    fresh_.clear();
  }

  // Whether op k's outputs are the trace's, numbered ahead into fresh_.
  bool outputs_match(std::int64_t k, c10::ArrayRef<c10::IValue> returned) {
    fresh_.clear();
    const auto& expected = outputs_[k];
    std::size_t i = 0;
    const bool same = for_each_tensor(returned, [&](const at::Tensor& t) {
      if (i == expected.size() || !t.has_storage()) return false;
      const auto& e = expected[i++];
      const auto sid = number_ahead(t);
      return sid >= 0 && sid == e.storage && t.sizes().equals(e.sizes);
    });
    if (same && i == expected.size()) return true;
    fresh_.clear();
    return false;
  }

  // Op k's outputs, unnumbered, to Python, which says how the step diverged.
  void report_mismatch(std::int64_t k, c10::ArrayRef<c10::IValue> returned) {
    py::gil_scoped_acquire gil;
    py::list outputs;
    for_each_tensor(returned, [&](const at::Tensor& t) {
      PyObject* wrapped = THPVariable_Wrap(t);
      if (wrapped == nullptr) throw py::error_already_set();
      outputs.append(py::reinterpret_steal<py::object>(wrapped));
      return true;
    });
    if (on_mismatch_ && !on_mismatch_.is_none()) on_mismatch_(k, outputs);
  }

  static bool install_hook(std::string* why);
  static void uninstall_hook();

  mutable std::mutex mu_;
  // The plan (guarded by mu_).
  std::vector<int> target_;
  std::vector<bool> quiet_;
  std::vector<std::vector<ExpectedOutput>> outputs_;
  std::vector<bool> moved_;  // by storage number
  std::unordered_map<std::string, int> target_ids_;
  std::unordered_map<const c10::OperatorName*, int> op_ids_;
  // The step (guarded by mu_, but pending_).
  std::int64_t k_ = 0;
  bool enabled_ = false;
  bool leaving_ = false;
  std::vector<std::uintptr_t> leaving_events_;
  std::atomic<std::int64_t> pending_{0};
  std::unordered_set<const c10::StorageImpl*> away_;
  std::unordered_map<const c10::StorageImpl*, Numbered> numbers_;
  std::int64_t next_sid_ = 0;
  // Storages the op under way numbers ahead, committed once the op is quiet.
  struct Fresh {
    const c10::StorageImpl* key;
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    std::int64_t sid;
  };
  std::vector<Fresh> fresh_;
  std::int64_t quiet_ops_ = 0;
  std::int64_t step_began_ns_ = -1;
  std::vector<std::int64_t> issued_ns_;  // per op, when it was issued this step (-1: not yet)
  PyObject* mode_ = nullptr;  // borrowed: the Replay, which owns this object
  py::object on_mismatch_;    // touched under the GIL only
};

// The vtable entry of PyInterpreterVTable::dispatch, from the Itanium C++ ABI's
// pointer to a virtual member (x86-64: its offset in bytes plus one; AArch64: the
// offset, the virtual flag in the adjustment's low bit).
std::optional<std::size_t> dispatch_entry(std::string* why) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__aarch64__))
  using Dispatch = void (PyInterpreterVTable::*)(const c10::OperatorHandle&, torch::jit::Stack*) const;
  Dispatch member = &PyInterpreterVTable::dispatch;
  struct {
    std::uintptr_t ptr;
    std::ptrdiff_t adj;
  } bits{};
  static_assert(sizeof(member) == sizeof(bits));
  std::memcpy(&bits, &member, sizeof bits);
#if defined(__aarch64__)
  const bool is_virtual = (bits.adj & 1) != 0;
  const std::uintptr_t offset = bits.ptr;
#else
  const bool is_virtual = (bits.ptr & 1) != 0;
  const std::uintptr_t offset = bits.ptr - 1;
#endif
  if (!is_virtual || offset % sizeof(void*) != 0 || offset / sizeof(void*) >= kSlots) {
    *why = "PyInterpreterVTable::dispatch is not a virtual entry this build can find";
    return std::nullopt;
  }
  return offset / sizeof(void*);
#else
  *why = "this compiler does not follow the Itanium C++ ABI";
  return std::nullopt;
#endif
}

void hooked_dispatch(const PyInterpreterVTable* /*self*/, const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  ReplayDispatch* replay = hook.replay.load(std::memory_order_acquire);
  if (replay == nullptr || !replay->run(op, stack)) hook.torch->dispatch(op, stack);
}

const PyInterpreterVTable* hooked_object() { return reinterpret_cast<const PyInterpreterVTable*>(hook.object.data()); }

// Builds the hooked copy of torch's vtable, once (under the GIL). False, with the
// reason, where this build or this torch does not allow it.
bool prepare_hook(std::string* why) {
  if (hook.interpreter != nullptr) return true;
  const auto entry = dispatch_entry(why);
  if (!entry) return false;
  PyInterpreter* interpreter = getPyInterpreter();
  if (interpreter == nullptr || interpreter->vtable_ == nullptr) {
    *why = "torch has no Python interpreter object";
    return false;
  }
  const PyInterpreterVTable* torch_vtable = interpreter->vtable_;
  void* const* entries = *reinterpret_cast<void* const* const*>(torch_vtable);
  const auto* object_words = reinterpret_cast<void* const*>(torch_vtable);
  Dl_info first{}, last{}, object_end{};
  if (dladdr(entries - 2, &first) == 0 || dladdr(entries + kSlots - 1, &last) == 0 ||
      first.dli_fbase != last.dli_fbase || dladdr(object_words + kObjectWords - 1, &object_end) == 0) {
    *why = "torch's interpreter vtable does not lie inside one loaded library";
    return false;
  }
  std::memcpy(hook.table.data(), entries - 2, sizeof(void*) * hook.table.size());
  hook.table[2 + *entry] = reinterpret_cast<void*>(&hooked_dispatch);
  std::memcpy(hook.object.data(), object_words, sizeof(void*) * kObjectWords);
  hook.object[0] = &hook.table[2];
  hook.torch = torch_vtable;
  hook.interpreter = interpreter;
  return true;
}

bool ReplayDispatch::install_hook(std::string* why) {
  if (!prepare_hook(why)) return false;
  if (hook.interpreter->vtable_ == hooked_object()) return true;
  if (hook.interpreter->vtable_ != hook.torch) {
    *why = "torch's interpreter vtable changed since the hook was made";
    return false;
  }
  hook.interpreter->vtable_ = hooked_object();
  return true;
}

void ReplayDispatch::uninstall_hook() {
  if (hook.interpreter != nullptr && hook.interpreter->vtable_ == hooked_object())
    hook.interpreter->vtable_ = hook.torch;
}

}  // namespace

void init_replay(py::module_& m) {
  py::class_<ReplayDispatch>(m, "ReplayDispatch",
                             "The replay's quiet ops run in C++, and its storage numbering "
                             "(Note [Replay dispatch in C++], python/csrc/replay_dispatch.cc)")
      .def(py::init<>())
      .def_static(
          "available",
          [] {
            std::string why;
            const bool ok = prepare_hook(&why);
            return std::make_pair(ok, why);
          },
          "(True, '') when quiet ops can run in C++ with this torch; else (False, why).")
      .def("load", &ReplayDispatch::load, py::arg("targets"), py::arg("quiet"), py::arg("outputs"),
           py::arg("moved"))
      .def_property("k", &ReplayDispatch::k, &ReplayDispatch::set_k)
      .def("set_enabled", &ReplayDispatch::set_enabled)
      .def("set_leaving", &ReplayDispatch::set_leaving, py::arg("leaving"), py::arg("events"))
      .def("note_pending", &ReplayDispatch::note_pending)
      .def("settle_pending", &ReplayDispatch::settle_pending)
      .def("away_add", &ReplayDispatch::away_add)
      .def("away_remove", &ReplayDispatch::away_remove)
      .def("away_clear", &ReplayDispatch::away_clear)
      .def("number", &ReplayDispatch::number,
           "(storage number, whether new) of the tensor's storage in this step; (-1, False) "
           "for a tensor without storage.")
      .def("reset_numbering", &ReplayDispatch::reset_numbering)
      .def("host_times_ms", &ReplayDispatch::host_times_ms)
      .def_property_readonly("quiet_ops", &ReplayDispatch::quiet_ops)
      .def("install", &ReplayDispatch::install, py::arg("mode"), py::arg("on_mismatch"))
      .def("uninstall", &ReplayDispatch::uninstall);
}

}  // namespace spillway::python
