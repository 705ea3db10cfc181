// The only translation unit that defines the Python module; each area binds itself in bind_<area>.cc.
#include <pybind11/pybind11.h>

#include <exception>
#include <new>
#include <stdexcept>

#include "bindings/bind.h"
#include "hetpipe/build_info.h"
#include "hetpipe/device.h"
#include "hetpipe/errors.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetpipe_core: the compiled core of hetpipe (framework-agnostic)";
  // Module-local, and it handles every exception type the core throws, so pybind11 never offers
  // them to the global translators that other extensions (torch among them) register in a shared
  // pybind11 internals: a foreign translator built against another pybind11 or libstdc++ has been
  // seen to crash on an exception it does not know.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hetpipe::TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    } catch (const std::out_of_range& e) {
      PyErr_SetString(PyExc_IndexError, e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError, "hetpipe_core: out of host memory");
    } catch (const py::builtin_exception& e) {
      e.set_error();  // pybind11's own (value_error, type_error, buffer_error, ...)
    } catch (py::error_already_set& e) {
      e.restore();  // a Python error (a signal's KeyboardInterrupt) carried through C++
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
    }
  });
  m.def("build_info", [] {
    const auto info = hetpipe::build_info();
    py::dict d;
    d["version"] = info.version;
    d["cuda_built"] = info.cuda_built;
    d["cuda_available"] = info.cuda_available;
    d["cuda_device_count"] = info.cuda_device_count;
    d["mpi_built"] = info.mpi_built;
    return d;
  }, "What was compiled in (version, cuda_built, mpi_built: the extension hetpipe_core._mpi) and what is\n"
     "usable now (cuda_available, cuda_device_count).");
  m.def("cuda_context_active", &hetpipe::cuda_context_active, py::arg("device"),
        "Whether this process holds an active primary CUDA context on `device` (False without CUDA or\n"
        "that device). Creates none: the check that a rank without a GPU role opened no context.");
  hetpipe::bindings::bind_buffers(m);
  hetpipe::bindings::bind_streams(m);
  hetpipe::bindings::bind_clock(m);
  hetpipe::bindings::bind_shard_ops(m);
  hetpipe::bindings::bind_shard_plane(m);
}
