// The MPI extension hetpipe_core._mpi: a PS shard rank's service (ShardService) over the
// communicator of the caller's mpi4py. Built only when CMake finds MPI; `import hetpipe_core` never
// loads it (hetpipe.ps.core_plane imports it after mpi4py, which loads the same libmpi).
#include <mpi.h>

#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
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
#include "hetpipe/wire.h"
#include "mpi/shard_service.h"
#include "mpi/stage_endpoint.h"

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
  m.doc() = "hetpipe_core._mpi: the core's MPI services: a PS shard's receive/serve path, a stage's endpoint";
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
      "ShardService(plane, comm, shard, trace=False, chunk_bytes, sources=[]): comm is an\n"
      "mpi4py communicator's handle (MPI._handleof(comm)); chunk_bytes the size its replies\n"
      "are cut at (0: one message each); sources the rank of each (vw, stage), VW by VW\n"
      "(empty: plan order); MPI must run at MPI_THREAD_MULTIPLE.")
      .def(py::init([](py::object plane, std::uint64_t comm, int shard, bool trace, std::int64_t chunk_bytes,
                       std::vector<int> sources) {
             auto& p = plane.cast<hetpipe::ShardPlane&>();
             return std::make_unique<hetpipe::ShardService>(p, comm_of<MPI_Comm>(comm), shard, trace, chunk_bytes,
                                                            std::move(sources));
           }),
           py::arg("plane"), py::arg("comm"), py::arg("shard"), py::arg("trace") = false,
           py::arg("chunk_bytes") = hetpipe::wire::kDefaultChunkBytes, py::arg("sources") = std::vector<int>{},
           py::keep_alive<1, 2>())  // the plane outlives the service
      .def("start", &hetpipe::ShardService::start)
      .def("stop", &hetpipe::ShardService::stop, py::call_guard<py::gil_scoped_release>(),
           "Stop and join the service's threads (GIL released; never waits on a peer).")
      .def_property_readonly("running", &hetpipe::ShardService::running)
      .def_property_readonly("failed", &hetpipe::ShardService::failed)
      .def_property_readonly("error", &hetpipe::ShardService::error, "The first failure of a service thread, or ''.")
      .def_property_readonly("error_kind", &hetpipe::ShardService::error_kind, "'wsp', 'mpi' or 'internal'.")
      .def_property_readonly("error_source", &hetpipe::ShardService::error_source,
                             "The rank whose message caused the first failure (its transport source), or -1.")
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

  py::class_<hetpipe::StageEndpoint>(m, "StageEndpoint",
                                     "A stage rank's message traffic over MPI, progressed by a core thread of its own\n"
                                     "(see csrc/mpi/stage_endpoint.h). StageEndpoint(pool, comm, chunk_bytes): pool is the\n"
                                     "stage's PinnedBufferPool, comm an mpi4py communicator's handle (MPI._handleof(comm)),\n"
                                     "chunk_bytes the size payloads are cut at (0: one message each); MPI must run at\n"
                                     "MPI_THREAD_MULTIPLE. One Python thread calls every method.")
      .def(py::init([](std::shared_ptr<hetpipe::PinnedBufferPool> pool, std::uint64_t comm, std::int64_t chunk_bytes) {
             return std::make_unique<hetpipe::StageEndpoint>(std::move(pool), comm_of<MPI_Comm>(comm), chunk_bytes);
           }),
           py::arg("pool"), py::arg("comm"), py::arg("chunk_bytes") = hetpipe::wire::kDefaultChunkBytes)
      .def(
          "send",
          [](hetpipe::StageEndpoint& e, int dest, py::array_t<std::int64_t, py::array::c_style> words,
             std::optional<hetpipe::Slot> slot) {
            if (words.size() != 16) throw py::value_error("StageEndpoint.send: a header is 16 int64 words");
            hetpipe::HeaderWords w;
            std::copy(words.data(), words.data() + 16, w.begin());
            e.send(dest, w, std::move(slot));
          },
          py::arg("dest"), py::arg("words"), py::arg("slot") = py::none(),
          "Start sending the header `words` (16 int64) and, when its nbytes word is above 0, that many bytes of\n"
          "`slot` to rank `dest`; takes the slot (back to the pool once sent). Never blocks.")
      .def(
          "try_recv",
          [](hetpipe::StageEndpoint& e, int src, std::int64_t kind) -> py::object {
            auto got = e.try_recv(src, kind);
            if (!got) return py::none();
            py::array_t<std::int64_t> words(16);
            std::copy(got->words.begin(), got->words.end(), words.mutable_data());
            py::object slot = got->slot ? py::cast(std::move(*got->slot)) : py::none();
            return py::make_tuple(got->src, words, slot);
          },
          py::arg("src"), py::arg("kind"),
          "The next `kind` message from rank `src` that fully arrived, as (src, words, slot or None), or None;\n"
          "the caller releases the slot. The first call for a (src, kind) starts receiving them.")
      .def_property_readonly("pending_sends", &hetpipe::StageEndpoint::pending_sends)
      .def_property_readonly("slot_wait", &hetpipe::StageEndpoint::slot_wait,
                             "What a receive waits for when no slot is free for its payload, or ''.")
      .def_property_readonly("failed", &hetpipe::StageEndpoint::failed)
      .def_property_readonly("error", &hetpipe::StageEndpoint::error, "The progress thread's first failure, or ''.")
      .def_property_readonly("error_kind", &hetpipe::StageEndpoint::error_kind,
                             "'mpi' (an MPI call failed: a peer gone, the network), 'internal', or ''.")
      .def("close", &hetpipe::StageEndpoint::close, py::call_guard<py::gil_scoped_release>(),
           "Stop and join the progress thread, cancel the posted receives, give back every slot; returns\n"
           "the messages consumed and not delivered (GIL released; never waits on a peer).");
}
