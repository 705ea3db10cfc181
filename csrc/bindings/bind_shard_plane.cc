// Python bindings of ShardPlane: buffers are checked here; push and pull run without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <sstream>
#include <string>

#include "bindings/bind.h"
#include "bindings/wait.h"
#include "hetpipe/errors.h"
#include "hetpipe/shard_plane.h"

namespace py = pybind11;

namespace hetpipe::bindings {

void bind_shard_plane(py::module_& m) {
  py::class_<ShardPlane>(m, "ShardPlane",
                         "One PS shard's data plane: WSP pushes, wave application in VW order and staleness-gated\n"
                         "pulls, callable from many threads at once without the GIL (see shard_plane.h).\n"
                         "ShardPlane(layer_numels, stage_layers, d, num_threads=0): stage_layers[vw][stage] lists\n"
                         "the indices of the shard's layers the stage holds.")
      .def(py::init<std::vector<std::size_t>, std::vector<std::vector<std::vector<int>>>, int, int>(),
           py::arg("layer_numels"), py::arg("stage_layers"), py::arg("d"), py::arg("num_threads") = 0)
      .def_property_readonly("num_layers", &ShardPlane::num_layers)
      .def_property_readonly("num_vws", &ShardPlane::num_vws)
      .def("stage_numel", &ShardPlane::stage_numel, py::arg("vw"), py::arg("stage"))
      .def(
          "weights",
          [](py::object self, int layer) {
            ShardPlane& p = self.cast<ShardPlane&>();
            const auto n = static_cast<py::ssize_t>(p.layer_numel(layer));
            return py::array_t<float>({n}, {static_cast<py::ssize_t>(sizeof(float))}, p.weights(layer), self);
          },
          py::arg("layer"),
          "A writable zero-copy view of layer `layer`'s weights: set them before the first push, read\n"
          "them after the last (not while pushes are applied).")
      .def(
          "push",
          [](ShardPlane& p, int vw, int stage, std::int64_t wave, const py::buffer& delta) {
            const py::buffer_info info = float32_buffer(delta, false, "ShardPlane.push", "delta");
            const auto* data = static_cast<const float*>(info.ptr);
            const auto n = static_cast<std::size_t>(info.size);
            py::gil_scoped_release release;
            p.push(vw, stage, wave, data, n);
          },
          py::arg("vw"), py::arg("stage"), py::arg("wave"), py::arg("delta"),
          "Copies the stage's wave delta (float32, the stage's layers in order); applies the waves the\n"
          "global clock passes. ValueError for a bad or duplicate push.")
      .def(
          "pull",
          [](ShardPlane& p, int vw, int stage, std::int64_t wave, const py::buffer& out,
             std::optional<double> timeout) {
            const py::buffer_info info = float32_buffer(out, true, "ShardPlane.pull", "out");
            auto* data = static_cast<float*>(info.ptr);
            const auto n = static_cast<std::size_t>(info.size);
            auto got = wait_interruptible(timeout, [&](std::chrono::nanoseconds chunk) -> std::optional<std::int64_t> {
              const std::int64_t a = p.pull_for(vw, stage, wave, data, n, chunk);
              if (a < 0) return std::nullopt;
              return a;
            });
            if (got) return *got;
            std::ostringstream msg;
            msg << "ShardPlane.pull(vw=" << vw << ", stage=" << stage << ", wave=" << wave << ") timed out after "
                << timeout.value_or(0.0) << " s: " << p.applied() << " waves applied";
            throw TimeoutError(msg.str());
          },
          py::arg("vw"), py::arg("stage"), py::arg("wave"), py::arg("out"), py::arg("timeout") = py::none(),
          "Waits (GIL released) until wave - D waves are applied, copies the stage's weights into out and\n"
          "returns the number of waves they contain. TimeoutError after `timeout` seconds.")
      .def("clock", &ShardPlane::clock, py::arg("vw"))
      .def_property_readonly("global_clock", &ShardPlane::global_clock)
      .def_property_readonly("applied", &ShardPlane::applied)
      .def_property_readonly("pushed_bytes", &ShardPlane::pushed_bytes);
}

}  // namespace hetpipe::bindings
