// Python access to the runtimes behind the custom ops: synchronization and
// statistics. Devices are named as torch names them ("cpu", "cuda:0").

#include <pybind11/stl.h>

#include <string>

#include "bindings.h"
#include "spillway/error.h"
#include "transfer_table.h"

namespace py = pybind11;

namespace spillway::python {
namespace {

DeviceKey parse_device(const std::string& name) {
  if (name == "cpu") return DeviceKey{false, 0};
  if (name == "cuda") return DeviceKey{true, 0};
  const std::string prefix = "cuda:";
  if (name.rfind(prefix, 0) == 0) {
    try {
      std::size_t used = 0;
      int index = std::stoi(name.substr(prefix.size()), &used);
      if (used == name.size() - prefix.size() && index >= 0) return DeviceKey{true, index};
    } catch (const std::exception&) {
    }
  }
  throw py::value_error("[ops] unknown device '" + name + "': expected cpu, cuda or cuda:N");
}

// Runs `body`, turning spillway's exceptions into Python's.
template <typename Body>
auto translate_errors(Body&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const InvalidArgument& e) {
    throw py::value_error(e.what());
  } catch (const Error& e) {
    throw std::runtime_error(e.what());
  }
}

}  // namespace

void init_runtime(py::module_& m) {
  m.def(
      "synchronize",
      [] {
        py::gil_scoped_release release;
        translate_errors([] { TransferTable::instance().synchronize(); });
      },
      "Blocks until every copy the ops started has completed. Raises RuntimeError for a "
      "copy failure no wait has reported yet.");
  m.def(
      "pending_waits", [] { return TransferTable::instance().pending_count(); },
      "Number of offloads and reloads whose wait_tensor has not run.");
  m.def(
      "copy_stats",
      [](const std::string& device) {
        CopyEngineStats s = TransferTable::instance().copy_stats(parse_device(device));
        py::dict d;
        d["transfers"] = s.transfers;
        d["chunks"] = s.chunks;
        d["bytes_d2h"] = s.bytes_d2h;
        d["bytes_h2d"] = s.bytes_h2d;
        return d;
      },
      py::arg("device"),
      "Copy-engine counters of the runtime serving `device` (zeros before its first op).");
  m.def(
      "pool_stats",
      [](const std::string& device) {
        PinnedPoolStats s = TransferTable::instance().pool_stats(parse_device(device));
        py::dict d;
        d["bytes_pinned"] = s.bytes_pinned;
        d["bytes_live"] = s.bytes_live;
        d["bytes_requested"] = s.bytes_requested;
        d["peak_bytes_live"] = s.peak_bytes_live;
        d["requests"] = s.requests;
        d["reuses"] = s.reuses;
        d["pinned_allocations"] = s.pinned_allocations;
        d["pinned_frees"] = s.pinned_frees;
        return d;
      },
      py::arg("device"),
      "Pinned-pool counters of the runtime serving `device` (zeros before its first op).");
  m.def(
      "trim_pool", [](const std::string& device) {
        TransferTable::instance().trim_pool(parse_device(device));
      },
      py::arg("device"),
      "Frees the pinned blocks the pool of `device`'s runtime caches (and released exact "
      "blocks) whose copies have completed.");
  m.def(
      "set_fake_copy_delay",
      [](int min_us, int max_us, std::uint64_t seed) {
        FakeControls* fake = TransferTable::instance().runtime(DeviceKey{false, 0}).fake_controls();
        fake->set_delay(FakeControls::Role::kD2H, min_us, max_us, seed);
        fake->set_delay(FakeControls::Role::kH2D, min_us, max_us, seed + 1);
      },
      py::arg("min_us"), py::arg("max_us"), py::arg("seed") = 0,
      "Test hook of the CPU path: before each copy task, the fake backend's copy streams "
      "sleep a random time in [min_us, max_us] (0, 0: no delay), to expose missing waits.");
  m.def(
      "fail_next_fake_pinned_allocations",
      [](int n) {
        TransferTable::instance().runtime(DeviceKey{false, 0}).fake_controls()
            ->fail_next_pinned_allocations(n);
      },
      py::arg("n"),
      "Test hook of the CPU path: the fake backend's next `n` pinned allocations fail "
      "(OutOfMemory), as exhausted pinned memory would.");
  m.def(
      "cuda_built",
      [] {
#ifdef SPILLWAY_TORCH_CUDA
        return true;
#else
        return false;
#endif
      },
      "Whether the ops have CUDA kernels (torch had CUDA and the CUDA backend was built).");
}

}  // namespace spillway::python
