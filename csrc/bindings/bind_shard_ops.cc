// Python bindings of the parameter-shard arithmetic: arrays (buffer protocol or DLPack on the host) are
// checked here, computed without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/bind.h"
#include "bindings/foreign.h"
#include "hetpipe/shard_ops.h"

namespace py = pybind11;

namespace hetpipe::bindings {
void bind_shard_ops(py::module_& m) {
  m.def(
      "apply_delta",
      [](const py::object& shard, const py::object& delta, float scale, int num_threads) {
        const Foreign s = float32_array(shard, true, "apply_delta", "shard");
        const Foreign d = float32_array(delta, false, "apply_delta", "delta");
        if (s.count() != d.count()) {
          throw py::value_error("apply_delta: shard has " + std::to_string(s.count()) + " elements but delta has " +
                                std::to_string(d.count()));
        }
        py::gil_scoped_release release;
        apply_delta(static_cast<float*>(s.data()), static_cast<const float*>(d.data()), s.count(), scale, num_threads);
      },
      py::arg("shard"), py::arg("delta"), py::arg("scale") = 1.0f, py::arg("num_threads") = 0,
      "shard += scale * delta in place (float32, C-contiguous, equal sizes; buffer protocol or host DLPack), bitwise equal to numpy's\n"
      "`shard += np.float32(scale) * delta`. num_threads 0: hardware concurrency (capped). GIL released.");
  m.def(
      "accumulate_change",
      [](const py::object& delta, const py::object& after, const py::object& before, int num_threads) {
        const Foreign d = float32_array(delta, true, "accumulate_change", "delta");
        const Foreign a = float32_array(after, false, "accumulate_change", "after");
        const Foreign b = float32_array(before, false, "accumulate_change", "before");
        if (a.count() != d.count() || b.count() != d.count()) {
          throw py::value_error("accumulate_change: delta has " + std::to_string(d.count()) + " elements, after " +
                                std::to_string(a.count()) + ", before " + std::to_string(b.count()));
        }
        py::gil_scoped_release release;
        accumulate_change(static_cast<float*>(d.data()), static_cast<const float*>(a.data()),
                          static_cast<const float*>(b.data()), d.count(), num_threads);
      },
      py::arg("delta"), py::arg("after"), py::arg("before"), py::arg("num_threads") = 1,
      "delta += after - before in place (float32, C-contiguous, equal sizes; delta must not overlap the\n"
      "others), bitwise equal to torch's `torch.sub(after, before, out=t); delta += t`. num_threads 1 (the\n"
      "default): the caller's thread only (a stage rank's step); 0: hardware concurrency. GIL released.");
  m.def(
      "snapshot",
      [](const py::object& shard, const py::object& out) -> py::object {
        const Foreign s = float32_array(shard, false, "snapshot", "shard");
        py::object result = out;
        if (out.is_none()) result = py::array_t<float>(std::vector<py::ssize_t>(s.shape().begin(), s.shape().end()));
        const Foreign o = float32_array(result, true, "snapshot", "out");
        if (s.count() != o.count()) {
          throw py::value_error("snapshot: shard has " + std::to_string(s.count()) + " elements but out has " +
                                std::to_string(o.count()));
        }
        {
          py::gil_scoped_release release;
          snapshot(s.data(), o.data(), s.count() * sizeof(float), 0);
        }
        return result;
      },
      py::arg("shard"), py::arg("out") = py::none(),
      "Copies a float32 shard into `out` (same size; a new numpy array when None) and returns it. GIL released.");
  m.def("shard_threads", &shard_threads, py::arg("num_threads"), py::arg("n"),
        "Threads apply_delta uses for n elements (num_threads 0: hardware concurrency, capped).");
}

}  // namespace hetpipe::bindings
