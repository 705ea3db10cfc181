// The only translation unit that defines the Python module; each area binds itself in bind_<area>.cc.
#include <pybind11/pybind11.h>

#include "hetpipe/build_info.h"

namespace py = pybind11;

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetpipe_core: the compiled core of hetpipe (framework-agnostic)";
  m.def("build_info", [] {
    const auto info = hetpipe::build_info();
    py::dict d;
    d["version"] = info.version;
    d["cuda_built"] = info.cuda_built;
    d["cuda_available"] = info.cuda_available;
    d["cuda_device_count"] = info.cuda_device_count;
    return d;
  }, "What was compiled in (version, cuda_built) and what is usable now (cuda_available, cuda_device_count).");
}
