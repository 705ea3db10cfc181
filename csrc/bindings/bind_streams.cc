// Python bindings of Stream, Event and copy_async. Every blocking call releases the GIL.
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/bind.h"
#include "hetpipe/streams.h"

namespace py = pybind11;

namespace hetpipe::bindings {
namespace {

// An int address, or an object exporting a buffer (its first `nbytes` bytes, checked).
void* address(const py::object& obj, std::size_t nbytes, bool writable, const char* role) {
  if (py::isinstance<py::int_>(obj)) return reinterpret_cast<void*>(obj.cast<std::uintptr_t>());
  if (!PyObject_CheckBuffer(obj.ptr())) {
    throw py::type_error(std::string("copy_async: ") + role + " must be an int address or support the buffer protocol");
  }
  const py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request(writable);
  const auto size = static_cast<std::size_t>(info.size * info.itemsize);
  if (size < nbytes) {
    throw py::value_error(std::string("copy_async: ") + role + " holds " + std::to_string(size) +
                          " bytes, fewer than nbytes=" + std::to_string(nbytes));
  }
  return info.ptr;
}

}  // namespace

void bind_streams(py::module_& m) {
  py::class_<Stream>(m, "Stream",
                     "Ordered asynchronous work: a CUDA stream, or a CPU worker thread with the same semantics.\n"
                     "Stream(device=-1): -1, or no usable CUDA device, gives a CPU stream.")
      .def(py::init<int>(), py::arg("device") = -1)
      .def_property_readonly("is_cuda", &Stream::is_cuda)
      .def_property_readonly("device", &Stream::device)
      .def_property_readonly("handle", &Stream::handle, "The cudaStream_t as an int; 0 for a CPU stream.")
      .def_property_readonly("closed", &Stream::closed)
      .def("synchronize", &Stream::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Blocks until all work enqueued so far has completed.")
      .def("query", &Stream::query, "True when all work enqueued so far has completed; never blocks.")
      .def("wait_for", &Stream::wait_for, py::arg("event"), py::call_guard<py::gil_scoped_release>(),
           "Work enqueued afterwards waits for the event's recorded point; the caller does not block.")
      .def("enqueue_sleep", &Stream::enqueue_sleep, py::arg("seconds"), py::call_guard<py::gil_scoped_release>(),
           "For tests and benchmarks: occupies the stream for `seconds`.")
      .def("close", &Stream::close, py::call_guard<py::gil_scoped_release>(),
           "Drains the queue and joins the worker (or destroys the CUDA stream). Idempotent.")
      .def("__enter__", [](Stream& s) -> Stream& { return s; }, py::return_value_policy::reference)
      .def("__exit__", [](Stream& s, const py::args&) {
        py::gil_scoped_release release;
        s.close();
      })
      .def("__repr__", [](const Stream& s) {
        return std::string("Stream(") + (s.is_cuda() ? "cuda:" + std::to_string(s.device()) : "cpu") + ")";
      });

  py::class_<Event>(m, "Event", "A point in a stream's work; complete once the work before it has completed.")
      .def(py::init<>())
      .def("record", &Event::record, py::arg("stream"), py::call_guard<py::gil_scoped_release>())
      .def("synchronize", &Event::synchronize, py::call_guard<py::gil_scoped_release>())
      .def("query", &Event::query);

  m.def(
      "copy_async",
      [](const py::object& dst, const py::object& src, std::size_t nbytes, Stream& stream) {
        void* d = address(dst, nbytes, true, "dst");
        const void* s = address(src, nbytes, false, "src");
        py::gil_scoped_release release;
        stream.copy_async(d, s, nbytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"),
      "Copies nbytes from src to dst in stream order (host/device in any combination on CUDA).\n"
      "dst/src: int addresses or buffer-protocol objects; both must stay alive until the copy completes.");
}

}  // namespace hetpipe::bindings
