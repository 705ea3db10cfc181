// The MPI extension hetpipe_core._mpi: a PS shard rank's service (ShardService) over the
// communicator of the caller's mpi4py. Built only when CMake finds MPI; `import hetpipe_core` never
// loads it (hetpipe.ps.core_plane imports it after mpi4py, which loads the same libmpi).
#include <mpi.h>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <exception>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <cstdint>

#include "bindings/translate.h"
#include "hetpipe/shard_plane.h"
#include "mpi/shard_service.h"

namespace py = pybind11;

namespace {

// mpi4py's handle of a communicator (MPI._handleof), as this MPI's MPI_Comm: an int in MPICH's ABI
// (mpi4py hands it over as the unsigned value of its bits), a pointer in the standard ABI.
template <class Comm>
Comm comm_of(std::uint64_t handle) {
  if constexpr (std::is_pointer_v<Comm>) {
    return reinterpret_cast<Comm>(static_cast<std::uintptr_t>(handle));
  } else {
    return static_cast<Comm>(static_cast<std::int64_t>(handle));
  }
}

}  // namespace

PYBIND11_MODULE(_mpi, m) {
  m.doc() = "hetpipe_core._mpi: the PS shard's receive/serve path over MPI on the core's own threads";
  hetpipe::bindings::register_translator();
  m.def("library_version", [] {
    char text[MPI_MAX_LIBRARY_VERSION_STRING];
    int len = 0;
    MPI_Get_library_version(text, &len);
    return std::string(text, static_cast<std::size_t>(len));
  }, "MPI_Get_library_version of the libmpi this module runs on (to compare with mpi4py's).");
  py::class_<hetpipe::ShardService>(m, "ShardService",
                                    "A PS shard rank's receive/serve path: the core's threads receive PUSH and PULL\n"
                                    "messages over MPI, apply waves and answer pulls (see csrc/mpi/shard_service.h).\n"
                                    "ShardService(plane, comm, shard, trace=False): comm is an mpi4py communicator's\n"
                                    "handle (MPI._handleof(comm)); MPI must run at MPI_THREAD_MULTIPLE.")
      .def(py::init([](py::object plane, std::uint64_t comm, int shard, bool trace) {
             auto& p = plane.cast<hetpipe::ShardPlane&>();
             return std::make_unique<hetpipe::ShardService>(p, comm_of<MPI_Comm>(comm), shard, trace);
           }),
           py::arg("plane"), py::arg("comm"), py::arg("shard"), py::arg("trace") = false,
           py::keep_alive<1, 2>())  // the plane outlives the service
      .def("start", &hetpipe::ShardService::start)
      .def("stop", &hetpipe::ShardService::stop, py::call_guard<py::gil_scoped_release>(),
           "Stop and join the service's threads (GIL released; never waits on a peer).")
      .def_property_readonly("running", &hetpipe::ShardService::running)
      .def_property_readonly("failed", &hetpipe::ShardService::failed)
      .def_property_readonly("error", &hetpipe::ShardService::error, "The first failure of a service thread, or ''.")
      .def_property_readonly("error_kind", &hetpipe::ShardService::error_kind, "'wsp', 'mpi' or 'internal'.")
      .def("pushes_received", &hetpipe::ShardService::pushes_received, py::arg("vw"), py::arg("stage"))
      .def_property_readonly("pulls_outstanding", &hetpipe::ShardService::pulls_outstanding)
      .def_property_readonly("events", &hetpipe::ShardService::events)
      .def(
          "trace",
          [](const hetpipe::ShardService& s) {
            py::list out;
            for (const auto& e : s.trace()) {
              out.append(py::make_tuple(e.push ? "PUSH" : "PULL", e.vw, e.stage, e.wave, e.start_s, e.end_s, e.from,
                                        e.to));
            }
            return out;
          },
          "(kind, vw, stage, wave, start_s, end_s, from, to) per push received and pull answered\n"
          "(time.perf_counter seconds; push: global clock before and after; pull: g twice).")
      .def("lost", &hetpipe::ShardService::lost, "Messages consumed but not handled when the service stopped.");
}
