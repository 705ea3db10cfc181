// Python bindings of Stream, Event and copy_async. Every blocking call releases the GIL.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <deque>
#include <exception>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "bindings/bind.h"
#include "bindings/foreign.h"
#include "hetpipe/streams.h"

namespace py = pybind11;

namespace hetpipe::bindings {
namespace {

// Python's Stream: the core Stream, plus what its asynchronous copies borrowed from Python.
//
// Lifetime: copy_async borrows its dst and src (a buffer view, or a consumed DLPack tensor; see
// bindings/foreign.h) and hands them to `pending` with an Event recorded right after the copy. They
// are released once that event (or a later one: the stream runs in order) reports completion, which
// is checked on the next copy_async, query, synchronize, close or __exit__ of this stream, and at
// close every remaining one is released (a closed stream runs nothing more). So a temporary array
// given to copy_async lives until its copy ran, and no longer than the next call after that.
// Thread role: the core's worker thread and CUDA's host functions never touch Python objects;
// everything borrowed is released on a Python thread holding the GIL, which guards `pending` and
// `spare`. `enqueue` serialises a copy and the record of its event against close(), so an event is
// never refused by a stream closed between the two; it is only taken with the GIL released.
// Destruction: `stream` is declared last, so it is closed (draining its queue) before `pending` is
// released; Python destroys the object with the GIL held.
struct BoundStream {
  // What one copy borrowed, and the point after it (unset when recording failed: then it is
  // released when a later point completes, or at close).
  struct Pending {
    Event done;
    bool recorded = false;
    Foreign dst;
    Foreign src;
  };

  explicit BoundStream(int device) : stream(device) {}

  Reach reach() const {
    return stream.is_cuda() ? Reach{true, stream.handle(), "a CUDA stream"} : Reach{false, 0, "a CPU stream"};
  }

  // Releases what copies that completed borrowed. GIL held.
  void prune() {
    for (;;) {
      const auto it = std::find_if(pending.begin(), pending.end(), [](const Pending& p) { return p.recorded; });
      if (it == pending.end() || !reached(it->done)) return;
      const auto end = std::next(it);
      for (auto p = pending.begin(); p != end; ++p) {
        if (p->recorded && spare.size() < kSpare) spare.push_back(std::move(p->done));
      }
      pending.erase(pending.begin(), end);
    }
  }

  // Once the stream is closed: nothing it holds runs any more. GIL held.
  void release_all() { pending.clear(); }

  // An event to record after a copy: a recycled one when there is one. GIL held.
  Event take_event() {
    if (spare.empty()) return Event();
    Event e = std::move(spare.back());
    spare.pop_back();
    return e;
  }

  // A failed task still counts as reached: the copy ran or was dropped, and either way it is over.
  static bool reached(const Event& e) {
    try {
      return e.query();
    } catch (const StreamError&) {
      return true;
    }
  }

  static constexpr std::size_t kSpare = 16;
  std::deque<Pending> pending;  // guarded by the GIL, in enqueue order
  std::vector<Event> spare;     // guarded by the GIL
  std::mutex enqueue;           // taken with the GIL released only
  Stream stream;
};

void close(BoundStream& s) {
  std::exception_ptr failure;
  {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(s.enqueue);
    try {
      s.stream.close();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  s.release_all();
  if (failure) std::rethrow_exception(failure);
}

ExternalKind external_kind(const std::string& kind) {
  if (kind == "stream") return ExternalKind::kStream;
  if (kind == "event") return ExternalKind::kEvent;
  throw py::value_error("Stream.wait_external: kind must be 'stream' or 'event', got '" + kind + "'");
}

void copy(const py::object& dst, const py::object& src, std::size_t nbytes, BoundStream& s) {
  s.prune();
  const Reach reach = s.reach();
  BoundStream::Pending entry;
  entry.dst = Foreign::borrow(dst, Borrower{"copy_async", "dst", "destination", true, true}, reach);
  entry.src = Foreign::borrow(src, Borrower{"copy_async", "src", "source", false, true}, reach);
  for (const auto& [f, name] : {std::pair<const Foreign*, const char*>{&entry.dst, "dst"}, {&entry.src, "src"}}) {
    if (f->sized() && f->nbytes() < nbytes) {
      throw py::value_error(std::string("copy_async: ") + name + " holds " + std::to_string(f->nbytes()) +
                            " bytes, fewer than nbytes=" + std::to_string(nbytes));
    }
  }
  if (nbytes == 0) return;  // nothing is enqueued
  const bool keep = entry.dst.holds() || entry.src.holds();
  if (keep) entry.done = s.take_event();
  {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(s.enqueue);
    s.stream.copy_async(entry.dst.data(), entry.src.data(), nbytes);
    if (keep) {
      try {
        entry.done.record(s.stream);
        entry.recorded = true;
      } catch (const std::exception&) {
        // Kept unrecorded: released when a later point completes, or at close.
      }
    }
  }
  if (keep) s.pending.push_back(std::move(entry));
}

}  // namespace

void bind_streams(py::module_& m) {
  py::class_<BoundStream>(m, "Stream",
                          "Ordered asynchronous work: a CUDA stream, or a CPU worker thread with the same semantics.\n"
                          "Stream(device=-1): -1, or no usable CUDA device, gives a CPU stream.")
      .def(py::init<int>(), py::arg("device") = -1)
      .def_property_readonly("is_cuda", [](const BoundStream& s) { return s.stream.is_cuda(); })
      .def_property_readonly("device", [](const BoundStream& s) { return s.stream.device(); })
      .def_property_readonly("handle", [](const BoundStream& s) { return s.stream.handle(); },
                             "The cudaStream_t as an int; 0 for a CPU stream.")
      .def_property_readonly("closed", [](const BoundStream& s) { return s.stream.closed(); })
      .def(
          "synchronize",
          [](BoundStream& s) {
            {
              py::gil_scoped_release release;
              s.stream.synchronize();
            }
            s.prune();
          },
          "Blocks until all work enqueued so far has completed.")
      .def(
          "query",
          [](BoundStream& s) {
            s.prune();
            return s.stream.query();
          },
          "True when all work enqueued so far has completed; never blocks.")
      .def(
          "wait_for",
          [](BoundStream& s, const Event& e) {
            py::gil_scoped_release release;
            s.stream.wait_for(e);
          },
          py::arg("event"), "Work enqueued afterwards waits for the event's recorded point; the caller does not block.")
      .def(
          "wait_external",
          [](BoundStream& s, std::uintptr_t handle, const std::string& kind) {
            const ExternalKind k = external_kind(kind);
            py::gil_scoped_release release;
            s.stream.wait_external(handle, k);
          },
          py::arg("handle"), py::arg("kind") = "stream",
          "Work enqueued afterwards waits for another framework's stream or event, as it stands now; the\n"
          "caller does not block. kind='stream': a cudaStream_t (torch's stream.cuda_stream; 0 is the\n"
          "default stream); kind='event': a cudaEvent_t. A CPU stream accepts handle 0 (a host framework's\n"
          "null stream, always complete) and refuses any other (ValueError).")
      .def(
          "enqueue_sleep",
          [](BoundStream& s, double seconds) {
            py::gil_scoped_release release;
            s.stream.enqueue_sleep(seconds);
          },
          py::arg("seconds"), "For tests and benchmarks: occupies the stream for `seconds`.")
      .def("close", &close,
           "Drains the queue and joins the worker (or destroys the CUDA stream), then releases what\n"
           "copies borrowed. Idempotent.")
      .def("__enter__", [](BoundStream& s) -> BoundStream& { return s; }, py::return_value_policy::reference)
      .def("__exit__", [](BoundStream& s, const py::args&) { close(s); })
      .def("__repr__", [](const BoundStream& s) {
        return std::string("Stream(") + (s.stream.is_cuda() ? "cuda:" + std::to_string(s.stream.device()) : "cpu") + ")";
      });

  py::class_<Event>(m, "Event", "A point in a stream's work; complete once the work before it has completed.")
      .def(py::init<>())
      .def(
          "record",
          [](Event& e, BoundStream& s) {
            py::gil_scoped_release release;
            e.record(s.stream);
          },
          py::arg("stream"))
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &Event::query);

  m.def("copy_async", &copy, py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"),
        "Copies nbytes from src to dst in stream order (host/device in any combination on CUDA).\n"
        "dst/src: int addresses (kept valid by the caller), buffer-protocol objects or DLPack arrays (numpy,\n"
        "torch, JAX, CuPy: contiguous, on a device the stream reaches; a CUDA producer is handed the\n"
        "stream's handle, so its pending work is ordered before the copy). The stream holds the arrays\n"
        "until the copy completed: a temporary may be passed.");
}

}  // namespace hetpipe::bindings
