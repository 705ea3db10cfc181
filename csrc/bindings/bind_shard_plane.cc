// Python bindings of ShardPlane: buffers are checked here; push and pull run without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "bindings/bind.h"
#include "bindings/foreign.h"
#include "bindings/wait.h"
#include "hetpipe/errors.h"
#include "hetpipe/shard_plane.h"

namespace py = pybind11;

namespace hetpipe::bindings {

namespace {

// The outer optimizer's options from the keyword arguments; std::invalid_argument naming a bad name
// (the numbers are checked by ShardPlane itself).
OuterOptions outer_options(const std::string& outer, float lr, float momentum, const std::string& staleness,
                           const std::string& gain, int delay) {
  OuterOptions options;
  if (outer == "sgd") {
    options.rule = OuterRule::kSgd;
  } else if (outer == "nesterov") {
    options.rule = OuterRule::kNesterov;
  } else if (outer == "delayed-nesterov") {
    options.rule = OuterRule::kDelayedNesterov;
  } else {
    throw std::invalid_argument("ShardPlane: outer must be 'sgd', 'nesterov' or 'delayed-nesterov', got '" + outer +
                                "'");
  }
  if (staleness == "none") {
    options.staleness = StalenessDecay::kNone;
  } else if (staleness == "inverse") {
    options.staleness = StalenessDecay::kInverse;
  } else if (staleness == "sqrt") {
    options.staleness = StalenessDecay::kSqrt;
  } else {
    throw std::invalid_argument("ShardPlane: outer_staleness must be 'none', 'inverse' or 'sqrt', got '" + staleness +
                                "'");
  }
  if (gain != "none" && gain != "sqrt") {
    throw std::invalid_argument("ShardPlane: outer_gain must be 'none' or 'sqrt', got '" + gain + "'");
  }
  options.sqrt_gain = gain == "sqrt";
  options.lr = lr;
  options.momentum = momentum;
  options.delay = delay;
  return options;
}

// A writable zero-copy float32 view of n floats at data, keeping the plane alive.
py::array_t<float> view(const py::object& owner, float* data, std::size_t n) {
  return py::array_t<float>({static_cast<py::ssize_t>(n)}, {static_cast<py::ssize_t>(sizeof(float))}, data, owner);
}

}  // namespace

void bind_shard_plane(py::module_& m) {
  py::class_<ShardPlane>(m, "ShardPlane",
                         "One PS shard's data plane: WSP pushes, wave application in VW order and staleness-gated\n"
                         "pulls, callable from many threads at once without the GIL (see shard_plane.h).\n"
                         "ShardPlane(layer_numels, stage_layers, d, num_threads=0, *, buffer_numels=[], replicas=[],\n"
                         "aggregate='sum', log_sums=False, outer='sgd', outer_lr=1.0, outer_momentum=0.9,\n"
                         "outer_staleness='none', outer_gain='none', outer_delay=0): stage_layers[vw][stage] lists\n"
                         "the indices of the shard's layers the stage holds; buffer_numels the synced buffers per\n"
                         "layer; replicas[vw][stage] the\n"
                         "(layer, offset, numel) slices of tied parameters the stage pulls without pushing them;\n"
                         "outer* the PS's outer optimizer (hetpipe.plan.outer).")
      .def(py::init([](std::vector<std::size_t> layer_numels, std::vector<std::vector<std::vector<int>>> stage_layers,
                       int d, int num_threads, std::vector<std::size_t> buffer_numels,
                       std::vector<std::vector<std::vector<std::tuple<int, std::size_t, std::size_t>>>> replicas,
                       const std::string& aggregate, bool log_sums, const std::string& outer, float outer_lr,
                       float outer_momentum, const std::string& outer_staleness, const std::string& outer_gain,
                       int outer_delay, std::vector<std::int64_t> wave_minibatches) {
             if (aggregate != "sum" && aggregate != "mean") {
               throw std::invalid_argument("ShardPlane: aggregate must be 'sum' or 'mean', got '" + aggregate + "'");
             }
             ShardPlaneOptions options;
             options.outer = outer_options(outer, outer_lr, outer_momentum, outer_staleness, outer_gain, outer_delay);
             options.buffer_numels = std::move(buffer_numels);
             for (const auto& vw : replicas) {
               auto& per_vw = options.replicas.emplace_back();
               for (const auto& stage : vw) {
                 auto& per_stage = per_vw.emplace_back();
                 for (const auto& [layer, offset, numel] : stage) per_stage.push_back({layer, offset, numel});
               }
             }
             options.mean = aggregate == "mean";
             options.wave_minibatches = std::move(wave_minibatches);
             options.log_sums = log_sums;
             return std::make_unique<ShardPlane>(std::move(layer_numels), std::move(stage_layers), d, num_threads,
                                                 std::move(options));
           }),
           py::arg("layer_numels"), py::arg("stage_layers"), py::arg("d"), py::arg("num_threads") = 0,
           py::kw_only(), py::arg("buffer_numels") = std::vector<std::size_t>{},
           py::arg("replicas") = std::vector<std::vector<std::vector<std::tuple<int, std::size_t, std::size_t>>>>{},
           py::arg("aggregate") = "sum", py::arg("log_sums") = false, py::arg("outer") = "sgd",
           py::arg("outer_lr") = 1.0f, py::arg("outer_momentum") = 0.9f, py::arg("outer_staleness") = "none",
           py::arg("outer_gain") = "none", py::arg("outer_delay") = 0,
           py::arg("wave_minibatches") = std::vector<std::int64_t>{})
      .def_property_readonly("num_layers", &ShardPlane::num_layers)
      .def_property_readonly("num_vws", &ShardPlane::num_vws)
      .def("stage_numel", &ShardPlane::stage_numel, py::arg("vw"), py::arg("stage"),
           "Floats of a push from the stage: its layers' weights, then their synced buffers.")
      .def("reply_numel", &ShardPlane::reply_numel, py::arg("vw"), py::arg("stage"),
           "Floats of a pull reply to the stage: weights, replica slices, synced buffers.")
      .def("pushes_from", &ShardPlane::pushes_from, py::arg("vw"), py::arg("stage"))
      .def("pulls_from", &ShardPlane::pulls_from, py::arg("vw"), py::arg("stage"))
      .def("num_stages", &ShardPlane::num_stages, py::arg("vw"))
      .def(
          "buffers",
          [](py::object self, int layer) {
            ShardPlane& p = self.cast<ShardPlane&>();
            const auto n = static_cast<py::ssize_t>(p.buffer_numel(layer));
            return py::array_t<float>({n}, {static_cast<py::ssize_t>(sizeof(float))}, p.buffers(layer), self);
          },
          py::arg("layer"), "A writable zero-copy view of layer `layer`'s synced buffers (as weights()).")
      .def(
          "momentum",
          [](py::object self, int layer) {
            ShardPlane& p = self.cast<ShardPlane&>();
            const auto n = static_cast<py::ssize_t>(p.momentum_numel(layer));
            return py::array_t<float>({n}, {static_cast<py::ssize_t>(sizeof(float))}, p.momentum(layer), self);
          },
          py::arg("layer"),
          "A writable zero-copy view of layer `layer`'s outer momentum buffer (empty unless outer is 'nesterov'\n"
          "or 'delayed-nesterov'), with the rules of weights(): set it before the first push, read it after the\n"
          "last or while held.")
      .def(
          "aggregated",
          [](py::object self, int layer) {
            ShardPlane& p = self.cast<ShardPlane&>();
            return view(self, p.aggregated(layer), p.aggregated_numel(layer));
          },
          py::arg("layer"),
          "A writable zero-copy view of layer `layer`'s aggregated pushes A (empty unless outer is 'nesterov',\n"
          "where it is zero at every wave boundary, or 'delayed-nesterov': the pushes since the layer's last\n"
          "momentum step), with the rules of momentum().")
      .def("outer_count", &ShardPlane::outer_count, py::arg("layer"),
           "delayed-nesterov: the pushes in layer `layer`'s A since its last momentum step.")
      .def("set_outer_count", &ShardPlane::set_outer_count, py::arg("layer"), py::arg("count"),
           "Sets outer_count (a checkpoint's), before the first push; ValueError for a negative count.")
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
          [](ShardPlane& p, int vw, int stage, std::int64_t wave, const py::object& delta) {
            const Foreign info = float32_array(delta, false, "ShardPlane.push", "delta");
            const auto* data = static_cast<const float*>(info.data());
            const auto n = info.count();
            py::gil_scoped_release release;
            p.push(vw, stage, wave, data, n);
          },
          py::arg("vw"), py::arg("stage"), py::arg("wave"), py::arg("delta"),
          "Copies the stage's wave delta (float32, the stage's layers in order); applies the waves the\n"
          "global clock passes. ValueError for a bad or duplicate push.")
      .def(
          "pull",
          [](ShardPlane& p, int vw, int stage, std::int64_t wave, const py::object& out,
             std::optional<double> timeout) {
            const Foreign info = float32_array(out, true, "ShardPlane.pull", "out");
            auto* data = static_cast<float*>(info.data());
            const auto n = info.count();
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
      .def("set_hold", &ShardPlane::set_hold, py::arg("hold"),
           "Hold the applier after each applied wave until release(applied) (a caller reading every wave\n"
           "boundary's weights, e.g. a checkpoint).")
      .def_property_readonly("held", &ShardPlane::held, "The wave count the applier holds at; -1: not holding.")
      .def("release", &ShardPlane::release, py::arg("applied"))
      .def(
          "log",
          [](const ShardPlane& p) {
            const ShardPlaneLog log = p.log();
            py::dict d;
            d["pushes"] = log.pushes;
            d["clocks"] = log.clocks;
            d["pulls"] = log.pulls;
            d["pull_clocks"] = log.pull_clocks;
            d["applied"] = log.applied;
            py::list sums;
            for (const auto& s : log.pushed_sum) {
              py::array_t<double> a(static_cast<py::ssize_t>(s.size()));
              std::copy(s.begin(), s.end(), a.mutable_data());
              sums.append(a);
            }
            d["pushed_sum"] = sums;
            return d;
          },
          "What the shard logged (a copy): pushes, clocks, pulls, pull_clocks, applied as lists of tuples,\n"
          "pushed_sum as float64 arrays per layer (log_sums only), as ShardLog of hetpipe.ps.shard.")
      .def("clock", &ShardPlane::clock, py::arg("vw"))
      .def_property_readonly("global_clock", &ShardPlane::global_clock)
      .def_property_readonly("applied", &ShardPlane::applied)
      .def_property_readonly("pushed_bytes", &ShardPlane::pushed_bytes);
}

}  // namespace hetpipe::bindings
