// Python bindings of the parameter-shard arithmetic: buffers are checked here, computed without the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "bindings/bind.h"
#include "hetpipe/shard_ops.h"

namespace py = pybind11;

namespace hetpipe::bindings {
namespace {

bool is_float32(const py::buffer_info& info) {
  std::string f = info.format;
  if (!f.empty() && (f[0] == '<' || f[0] == '=' || f[0] == '@')) f = f.substr(1);
  return f == "f" && info.itemsize == 4;
}

bool c_contiguous(const py::buffer_info& info) {
  py::ssize_t expected = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expected) return false;
    expected *= info.shape[d];
  }
  return true;
}

}  // namespace

py::buffer_info float32_buffer(const py::buffer& b, bool writable, const char* fn, const char* name) {
  py::buffer_info info = b.request(writable);
  if (!is_float32(info)) {
    throw py::type_error(std::string(fn) + ": " + name + " must be float32, got format '" + info.format + "' of " +
                         std::to_string(info.itemsize) + "-byte items");
  }
  if (!c_contiguous(info)) throw py::value_error(std::string(fn) + ": " + name + " must be C-contiguous");
  return info;
}

void bind_shard_ops(py::module_& m) {
  m.def(
      "apply_delta",
      [](const py::buffer& shard, const py::buffer& delta, float scale, int num_threads) {
        const py::buffer_info s = float32_buffer(shard, true, "apply_delta", "shard");
        const py::buffer_info d = float32_buffer(delta, false, "apply_delta", "delta");
        if (s.size != d.size) {
          throw py::value_error("apply_delta: shard has " + std::to_string(s.size) + " elements but delta has " +
                                std::to_string(d.size));
        }
        py::gil_scoped_release release;
        apply_delta(static_cast<float*>(s.ptr), static_cast<const float*>(d.ptr), static_cast<std::size_t>(s.size),
                    scale, num_threads);
      },
      py::arg("shard"), py::arg("delta"), py::arg("scale") = 1.0f, py::arg("num_threads") = 0,
      "shard += scale * delta in place (float32, C-contiguous, equal sizes), bitwise equal to numpy's\n"
      "`shard += np.float32(scale) * delta`. num_threads 0: hardware concurrency (capped). GIL released.");
  m.def(
      "accumulate_change",
      [](const py::buffer& delta, const py::buffer& after, const py::buffer& before, int num_threads) {
        const py::buffer_info d = float32_buffer(delta, true, "accumulate_change", "delta");
        const py::buffer_info a = float32_buffer(after, false, "accumulate_change", "after");
        const py::buffer_info b = float32_buffer(before, false, "accumulate_change", "before");
        if (a.size != d.size || b.size != d.size) {
          throw py::value_error("accumulate_change: delta has " + std::to_string(d.size) + " elements, after " +
                                std::to_string(a.size) + ", before " + std::to_string(b.size));
        }
        py::gil_scoped_release release;
        accumulate_change(static_cast<float*>(d.ptr), static_cast<const float*>(a.ptr),
                          static_cast<const float*>(b.ptr), static_cast<std::size_t>(d.size), num_threads);
      },
      py::arg("delta"), py::arg("after"), py::arg("before"), py::arg("num_threads") = 1,
      "delta += after - before in place (float32, C-contiguous, equal sizes; delta must not overlap the\n"
      "others), bitwise equal to torch's `torch.sub(after, before, out=t); delta += t`. num_threads 1 (the\n"
      "default): the caller's thread only (a stage rank's step); 0: hardware concurrency. GIL released.");
  m.def(
      "snapshot",
      [](const py::buffer& shard, const py::object& out) -> py::object {
        const py::buffer_info s = float32_buffer(shard, false, "snapshot", "shard");
        py::object result = out;
        if (out.is_none()) result = py::array_t<float>(std::vector<py::ssize_t>(s.shape.begin(), s.shape.end()));
        const py::buffer_info o = float32_buffer(result.cast<py::buffer>(), true, "snapshot", "out");
        if (s.size != o.size) {
          throw py::value_error("snapshot: shard has " + std::to_string(s.size) + " elements but out has " +
                                std::to_string(o.size));
        }
        {
          py::gil_scoped_release release;
          snapshot(s.ptr, o.ptr, static_cast<std::size_t>(s.size) * sizeof(float), 0);
        }
        return result;
      },
      py::arg("shard"), py::arg("out") = py::none(),
      "Copies a float32 shard into `out` (same size; a new numpy array when None) and returns it. GIL released.");
  m.def("shard_threads", &shard_threads, py::arg("num_threads"), py::arg("n"),
        "Threads apply_delta uses for n elements (num_threads 0: hardware concurrency, capped).");
}

}  // namespace hetpipe::bindings
