// The only translation unit that defines the Python module; each area binds itself in bind_<area>.cc.
#include <pybind11/pybind11.h>

#include "bindings/bind.h"
#include "hetpipe/build_info.h"
#include "hetpipe/errors.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetpipe_core: the compiled core of hetpipe (framework-agnostic)";
  // std::invalid_argument -> ValueError and std::out_of_range -> IndexError are pybind11's defaults.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const hetpipe::TimeoutError& e) {
      PyErr_SetString(PyExc_TimeoutError, e.what());
    }
  });
  m.def("build_info", [] {
    const auto info = hetpipe::build_info();
    py::dict d;
    d["version"] = info.version;
    d["cuda_built"] = info.cuda_built;
    d["cuda_available"] = info.cuda_available;
    d["cuda_device_count"] = info.cuda_device_count;
    return d;
  }, "What was compiled in (version, cuda_built) and what is usable now (cuda_available, cuda_device_count).");
  hetpipe::bindings::bind_buffers(m);
  hetpipe::bindings::bind_streams(m);
  hetpipe::bindings::bind_clock(m);
  hetpipe::bindings::bind_shard_ops(m);
}
