// The only translation unit that defines the Python module; each area binds itself in bind_<area>.cc.
#include <pybind11/pybind11.h>

#include <exception>
#include <new>
#include <stdexcept>

#include "bindings/bind.h"
#include "bindings/translate.h"
#include "hetpipe/build_info.h"
#include "hetpipe/device.h"
#include "hetpipe/errors.h"

namespace py = pybind11;

using hetpipe::bindings::register_translator;

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetpipe_core: the compiled core of hetpipe (framework-agnostic)";
  register_translator();
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
  hetpipe::bindings::bind_wire(m);
}
