// spillway._C.FastKeep, FastTable and FastKept: the kept saves of a block call by
// position, packed without Python (Note [Kept saves in C++]).

#include <ATen/ops/empty.h>
#include <c10/core/StorageImpl.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <typeinfo>
#include <unordered_set>
#include <utility>
#include <vector>

#include "bindings.h"

// Note [Kept saves in C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A block call by position (Note [Parts by position], activations/_recipes.py) hands
// each saved tensor to Python's pack hook, which finds its part in the learned table
// and keeps most of them (parameters, small tensors, the parts the plan keeps): ~15 us
// of Python a save on the 2-core CPU host, 3-4x that on the GPU machine's host, 20-30
// saves a T1 block. With eager._FAST_KEEP the pack hook is a FastKeep. Outside a call
// by position it calls Python's hook. In one, the first call of a learned table
// *learns*: every save goes to Python at its position, and Python notes which ones it
// kept and why (note()); each save's *signature* is noted here. A later call of the
// table keeps in C++ a save whose signature equals its learned one at its position
// and that Python kept: the same _Kept Python would have made (a FastKept: the
// detached tensor, its version, the context and the layer), counted under the same
// reason. Everything else goes to Python with its position, as before.
//
// The signature holds all that Python's decision and its reason read of the save,
// the call's policy and part being the table's: its Python type, its grad_fn's C++
// type (a Python-defined autograd function never matches: its node type is PyNode
// for all of them), device, dtype, layout, sizes, strides, storage offset, conj and
// neg bits, its storage's bytes, and whether the storage is a weight's or the call's
// input's. Equal signatures at one position of one table get equal decisions and
// reasons, so the packed values, the bytes moved and the statistics are those of
// Python's hook (tests: test_eager_budget.py). A save seen while a backward runs, or
// after the call departed from its table, goes to Python.

namespace spillway::python {
namespace {

namespace py = pybind11;

struct Signature {
  PyTypeObject* type = nullptr;
  const std::type_info* maker = nullptr;  // the grad_fn's type; nullptr: none
  c10::Device device{c10::kCPU};
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::Layout layout = c10::kStrided;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  int64_t storage_nbytes = 0;
  bool conj = false, neg = false, weight = false, input = false;
  bool usable = true;  // false: never kept here (a Python autograd function, no storage...)

  bool operator==(const Signature& o) const {
    return usable && o.usable && type == o.type && maker == o.maker && device == o.device &&
           dtype == o.dtype && layout == o.layout && offset == o.offset &&
           storage_nbytes == o.storage_nbytes && conj == o.conj && neg == o.neg &&
           weight == o.weight && input == o.input && sizes == o.sizes && strides == o.strides;
  }
};

// What one learned table of one block call keeps: per position, its signature, the
// reason Python kept it and the part it offloaded it as (-1: Python decides at every
// call).
struct FastTable {
  std::vector<Signature> rows;
  std::vector<int> reasons;
  std::vector<int> offloads;
  bool learned = false;
};

// A save kept in C++: what Python's _Kept holds (activations/_eager_store.py).
struct FastKept {
  at::Tensor tensor;
  int64_t version = 0;
  py::object owner, layer;
};

bool is_storage_in(const at::Tensor& t, const std::unordered_set<std::intptr_t>& set) {
  return !set.empty() &&
         set.count(reinterpret_cast<std::intptr_t>(t.storage().unsafeGetStorageImpl())) > 0;
}

class FastKeep {
 public:
  // pack(t): Python's pack hook; pack_at(t, position): the same at a position of the
  // armed call's table; offload_at(t, position, part): Python's offload of a save
  // whose position the table learned as offloaded as `part` (None: never asked).
  FastKeep(py::object pack, py::object pack_at, py::object offload_at)
      : pack_(std::move(pack)),
        pack_at_(std::move(pack_at)),
        offload_at_(std::move(offload_at)) {}

  py::object call(py::handle obj) {
    // Python's hook counts no position for a save made while a backward runs.
    if (!armed_ || !THPVariable_Check(obj.ptr()) ||
        torch::autograd::get_current_graph_task_id() != -1) {
      return pack_(obj);
    }
    const int64_t at = position_++;
    if (departed_) return pack_at_(obj, at);
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (learning_) {
      table_->rows.push_back(signature(obj, t));
      table_->reasons.push_back(-1);
      table_->offloads.push_back(-1);
      return pack_at_(obj, at);
    }
    const auto& rows = table_->rows;
    if (at >= static_cast<int64_t>(rows.size()) ||
        (table_->reasons[at] < 0 && table_->offloads[at] < 0) ||
        !(signature(obj, t) == rows[at])) {
      return pack_at_(obj, at);
    }
    if (table_->reasons[at] < 0) return offload_at_(obj, at, table_->offloads[at]);
    ++kept_[table_->reasons[at]];
    auto kept = std::make_unique<FastKept>();
    kept->tensor = t.detach();
    kept->version = t._version();
    kept->owner = owner_;
    kept->layer = layer_;
    return py::cast(std::move(kept));
  }

  // The storages (StorageWeakRef.cdata) of the model's weights, once a step.
  void set_weights(const std::vector<std::intptr_t>& weights) {
    weights_ = std::unordered_set<std::intptr_t>(weights.begin(), weights.end());
  }

  // Before a call by position: its table (learning: its first call), the context, the
  // call's layer and its inputs' storages (StorageWeakRef.cdata).
  void arm(std::shared_ptr<FastTable> table, py::object owner, py::object layer,
           const std::vector<std::intptr_t>& inputs) {
    table_ = std::move(table);
    learning_ = !table_->learned;
    if (learning_) {
      table_->rows.clear();
      table_->reasons.clear();
      table_->offloads.clear();
    }
    owner_ = std::move(owner);
    layer_ = std::move(layer);
    inputs_ = std::unordered_set<std::intptr_t>(inputs.begin(), inputs.end());
    position_ = 0;
    departed_ = false;
    kept_.assign(kept_.size(), 0);
    armed_ = true;
  }

  // After the call: (saves it saw, kept here per reason index). A learning call that
  // did not depart leaves its table learned.
  std::pair<int64_t, std::vector<int64_t>> disarm() {
    if (armed_ && learning_) table_->learned = !departed_;
    armed_ = false;
    table_.reset();
    owner_ = layer_ = py::none();
    return {position_, kept_};
  }

  // Python kept the save at `position` for reason `reason` (learning), or left the
  // table (depart()).
  void note(int64_t position, int reason) {
    if (!armed_ || !learning_ || position >= static_cast<int64_t>(table_->reasons.size())) return;
    table_->reasons[position] = reason;
    if (reason >= static_cast<int>(kept_.size())) kept_.resize(reason + 1, 0);
  }
  // Python offloaded the save at `position` as part `part` (learning), with nothing
  // else done with it but what offload_at does again (Note [Offloaded saves by
  // position] in _eager_budget.py).
  void note_offload(int64_t position, int part) {
    if (!armed_ || !learning_ || offload_at_.is_none() ||
        position >= static_cast<int64_t>(table_->offloads.size())) {
      return;
    }
    table_->offloads[position] = part;
  }
  void depart() { departed_ = true; }
  void set_reasons(int n) { kept_.assign(n, 0); }

 private:
  Signature signature(py::handle obj, const at::Tensor& t) const {
    Signature s;
    s.type = Py_TYPE(obj.ptr());
    const auto& fn = t.grad_fn();
    if (fn) {
      const torch::autograd::Node& node = *fn;
      s.maker = &typeid(node);
      // A Python-defined autograd function's node is a PyNode, whatever the function
      // (torch_python does not export PyNode's type_info: its name, Itanium-mangled).
      s.usable = std::strcmp(s.maker->name(), "N5torch8autograd6PyNodeE") != 0;
    }
    s.device = t.device();
    s.dtype = t.scalar_type();
    s.layout = t.layout();
    if (s.layout != c10::kStrided || t.is_nested() || t.is_quantized()) {
      s.usable = false;  // Python's unsupported paths
      return s;
    }
    if (!t.has_storage()) {
      s.usable = false;  // a subclass without a storage: Python's alone
      return s;
    }
    s.sizes = t.sizes().vec();
    s.strides = t.strides().vec();
    s.offset = t.storage_offset();
    s.storage_nbytes = static_cast<int64_t>(t.storage().nbytes());
    s.conj = t.is_conj();
    s.neg = t.is_neg();
    s.weight = is_storage_in(t, weights_);
    s.input = is_storage_in(t, inputs_);
    return s;
  }

  py::object pack_, pack_at_, offload_at_;
  std::shared_ptr<FastTable> table_;
  py::object owner_ = py::none(), layer_ = py::none();
  std::unordered_set<std::intptr_t> weights_, inputs_;
  std::vector<int64_t> kept_;
  int64_t position_ = 0;
  bool armed_ = false, learning_ = false, departed_ = false;
};

// _eager_store.version_witness in C++ (Note [A leaner host path]): a tensor of t's
// dtype and device, with no elements, sharing t's version counter, so an in-place
// write to t shows in the witness's _version. None for a tensor without a version
// counter (an inference tensor): Python's way then answers.
py::object version_witness(py::handle obj) {
  if (!THPVariable_Check(obj.ptr())) throw py::type_error("version_witness: expected a tensor");
  const at::Tensor& t = THPVariable_Unpack(obj.ptr());
  const c10::VariableVersion& version = t.unsafeGetTensorImpl()->version_counter();
  if (!version.enabled()) return py::none();
  at::Tensor witness = at::empty({0}, t.options());
  witness.unsafeGetTensorImpl()->set_version_counter(version);
  return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(witness)));
}

}  // namespace

void init_fast_keep(py::module_& m) {
  m.def("version_witness", &version_witness, py::arg("tensor"),
        "A tensor of no elements sharing the given tensor's version counter");
  py::class_<FastTable, std::shared_ptr<FastTable>>(
      m, "FastTable", "What one learned table keeps in C++ (Note [Kept saves in C++])")
      .def(py::init<>())
      .def_property_readonly("learned", [](const FastTable& t) { return t.learned; })
      .def_property_readonly("kept", [](const FastTable& t) {
        int64_t n = 0;
        for (int r : t.reasons) n += r >= 0;
        return n;
      })
      .def_property_readonly("offloaded", [](const FastTable& t) {
        int64_t n = 0;
        for (int p : t.offloads) n += p >= 0;
        return n;
      });
  py::class_<FastKept>(m, "FastKept", "A save kept in C++: Python's _Kept, made by FastKeep")
      .def_property_readonly("tensor",
                             [](const FastKept& k) {
                               return py::reinterpret_steal<py::object>(THPVariable_Wrap(k.tensor));
                             })
      .def_readonly("version", &FastKept::version)
      .def_readonly("owner", &FastKept::owner)
      .def_readonly("layer", &FastKept::layer);
  py::class_<FastKeep>(m, "FastKeep", "A pack hook keeping a block call's learned saves in C++")
      .def(py::init<py::object, py::object, py::object>(), py::arg("pack"), py::arg("pack_at"),
           py::arg("offload_at") = py::none())
      .def("__call__", &FastKeep::call)
      .def("set_weights", &FastKeep::set_weights, py::arg("weights"))
      .def("arm", &FastKeep::arm, py::arg("table"), py::arg("owner"), py::arg("layer"),
           py::arg("inputs"))
      .def("disarm", &FastKeep::disarm)
      .def("note", &FastKeep::note, py::arg("position"), py::arg("reason"))
      .def("note_offload", &FastKeep::note_offload, py::arg("position"), py::arg("part"))
      .def("depart", &FastKeep::depart)
      .def("set_reasons", &FastKeep::set_reasons);
}

}  // namespace spillway::python
