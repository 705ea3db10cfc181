// Python bindings of ClockTable and its C++ test/benchmark loops.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <sstream>
#include <string>

#include "bindings/bind.h"
#include "bindings/wait.h"
#include "hetpipe/clock_bench.h"
#include "hetpipe/clock_table.h"
#include "hetpipe/errors.h"

namespace py = pybind11;

namespace hetpipe::bindings {

void bind_clock(py::module_& m) {
  py::class_<ClockTable>(m, "ClockTable",
                         "WSP clocks: one cache-line-padded atomic clock per virtual worker; the global clock is\n"
                         "the minimum over the active ones. Thread-safe; lock-free except when waiting.")
      .def(py::init<int>(), py::arg("num_vws"))
      .def_property_readonly("num_vws", &ClockTable::num_vws)
      .def("advance", &ClockTable::advance, py::arg("vw"), "Increments vw's clock; returns the new value.")
      .def("clock", &ClockTable::clock, py::arg("vw"))
      .def("active", &ClockTable::active, py::arg("vw"))
      .def("global_clock", &ClockTable::global_clock)
      .def(
          "wait_until",
          [](ClockTable& t, std::int64_t wave, std::int64_t bound_d, std::optional<double> timeout) {
            auto global = wait_interruptible(timeout, [&](std::chrono::nanoseconds chunk) {
              return t.wait_until_for(wave, bound_d, chunk);
            });
            if (global) return *global;
            std::ostringstream msg;
            msg << "ClockTable.wait_until(wave=" << wave << ", bound_d=" << bound_d << ") timed out after "
                << timeout.value_or(0.0) << " s: global clock " << t.global_clock() << " < " << wave - bound_d;
            throw TimeoutError(msg.str());
          },
          py::arg("wave"), py::arg("bound_d"), py::arg("timeout") = py::none(),
          "Blocks (GIL released, no spinning) until global_clock() >= wave - bound_d or no VW is active;\n"
          "returns the global clock. Raises TimeoutError after `timeout` seconds (None: wait forever).")
      .def("remove", &ClockTable::remove, py::arg("vw"), "Takes a departed VW out of the minimum; wakes waiters.");

  m.def(
      "clock_stress",
      [](ClockTable& t, int threads, std::int64_t ops) { return clock_stress(t, threads, ops); },
      py::arg("table"), py::arg("threads"), py::arg("ops"), py::call_guard<py::gil_scoped_release>(),
      "Test helper: `threads` C++ threads perform `ops` advances in total, spread over all VWs.\n"
      "Returns the wall seconds.");
  m.def(
      "clock_bench",
      [](ClockTable& t, const std::string& op, int threads, std::int64_t ops) {
        const ClockOp o = parse_clock_op(op);
        py::gil_scoped_release release;
        return clock_bench(t, o, threads, ops);
      },
      py::arg("table"), py::arg("op"), py::arg("threads"), py::arg("ops"),
      "Benchmark helper: `threads` C++ threads perform `ops` operations in total (op: advance, clock,\n"
      "global_clock, wait_check); thread t uses VW t % num_vws. Returns the wall seconds.");
  m.def(
      "mutex_clock_bench",
      [](int num_vws, const std::string& op, int threads, std::int64_t ops) {
        const ClockOp o = parse_clock_op(op);
        py::gil_scoped_release release;
        return mutex_clock_bench(num_vws, o, threads, ops);
      },
      py::arg("num_vws"), py::arg("op"), py::arg("threads"), py::arg("ops"),
      "Benchmark baseline: the clock_bench loop over counters behind one std::mutex. Returns seconds.");
}

}  // namespace hetpipe::bindings
